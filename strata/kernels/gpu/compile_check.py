"""Compile the Triton kernels for a GPU this machine may not have (default: sm_90, H100/H200).

The interpreter accepts code the GPU compiler refuses (and the reverse); compiling to a
cubin here, with Triton's bundled ptxas, catches that without a device, and reports each
kernel's registers and spills (from cuobjdump) for tuning. Must run in a process where
TRITON_INTERPRET is not set, since the interpreter replaces the kernels at import.

    python -m strata.kernels.gpu.compile_check [--types Q4_K,IQ2_XS] [--arch 90]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from strata import quant
from strata.kernels.gpu import KERNEL_TYPES

POINTERS = {  # pointer arguments of each kernel and their element types
    "_qmv_kernel": {"x": "*fp32", "w": "*u8", "out": "*fp32", "tables": "*fp32"},
    "_gate_up_kernel": {"x": "*fp32", "tok": "*i64", "gate": "*u8", "gate_off": "*i64", "up": "*u8",
                        "up_off": "*i64", "h": "*fp32", "g_tables": "*fp32", "u_tables": "*fp32"},
    "_qmm_kernel": {"x": "*bf16", "w": "*u8", "out": "*fp32", "tables": "*fp32"},
    "_down_kernel": {"h": "*fp32", "down": "*u8", "down_off": "*i64", "scale": "*fp32", "y": "*fp32",
                     "tables": "*fp32"},
}


def _type_constants(qtype, prefix: str = "") -> dict[str, int]:
    """The type's constants, with the widest word its layout allows (what aligned tensors get)."""
    from strata.kernels.gpu.decode import WORD

    q = quant.get(qtype)
    names = ("QTYPE", "QK", "TS", "W") if not prefix else (f"{prefix}T", f"{prefix}_QK", f"{prefix}_TS", f"{prefix}_W")
    return dict(zip(names, (int(q.ggml_type), q.block_size, q.type_size, WORD[q.ggml_type])))


ALIGNED_INTS = {"row_bytes", "g_row_bytes", "u_row_bytes", "x_stride", "out_stride", "K", "F", "H"}
NUM_WARPS = {"_qmm_kernel": 8}  # launch warps where not Triton's default 4 (the launchers pass the same)


def compile_kernel(name: str, constants: dict[str, int], arch: int):
    """The compiled kernel (`CompiledKernel`) for constants, targeting sm_<arch>."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from strata.kernels.gpu import kernels

    fn = getattr(kernels, name)
    if not isinstance(fn, triton.runtime.JITFunction):
        raise TypeError("the kernels were imported under TRITON_INTERPRET=1; run this in a fresh process")
    signature = {a: POINTERS[name].get(a, "constexpr" if a in constants else "i32") for a in fn.arg_names}
    # what a launch specialises on (Triton marks pointers and ints divisible by 16 so): aligned tensors,
    # and row sizes and strides that are multiples of 16, as real shapes' are
    aligned = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
               if a in POINTERS[name] or a in ALIGNED_INTS}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=aligned),
                          target=GPUTarget("cuda", arch, 32), options={"num_warps": NUM_WARPS.get(name, 4)})


def resources(compiled) -> str:
    """cuobjdump's register / stack / local-memory line for a compiled kernel."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([str(tool), "-res-usage", f.name], check=False, capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", out)
    return f"{m[1]} registers, stack {m[2]} B, local {m[3]} B" if m else "resources unknown"


_LOAD = re.compile(r"ld\.global(?:\.nc)?(?:\.v(\d))?\.[bufs](8|16|32|64)|cp\.async\.c[ag]\.shared\.global[^\n]*?\],\s*(0x[0-9a-f]+|\d+)")


def loads(compiled) -> str:
    """The global loads in the kernel's PTX by width (static count x bytes): word loads show as 4-16 B
    (`ld.global.v2.b32` is 8 B; `cp.async` 16 B copies feed the tiled kernel's dot), bytes as 1 B."""
    widths: dict[int, int] = {}
    for vec, bits, copy in _LOAD.findall(compiled.asm["ptx"]):
        width = int(copy, 0) if copy else int(vec or 1) * int(bits) // 8
        widths[width] = widths.get(width, 0) + 1
    return "loads " + " ".join(f"{n}x{w}B" for w, n in sorted(widths.items()))


def jobs(types, bn: int, batched: tuple[int, int] = (32, 32)):
    """(label, kernel name, constants) for every kernel over `types` (grouped: gate = up = down)."""
    for t in types:
        one = _type_constants(t)
        yield f"qmv {t.name}", "_qmv_kernel", {**one, "BN": bn, "BK": 256, "INTERP": 0}
        yield f"gate_up {t.name}", "_gate_up_kernel", {**_type_constants(t, "G"), **_type_constants(t, "U"),
                                                       "BN": bn, "BK": 256, "INTERP": 0}
        yield f"down {t.name}", "_down_kernel", {**one, "BN": bn, "BK": 256, "INTERP": 0}
        bm, bnn = batched
        yield f"qmm {t.name}", "_qmm_kernel", {**one, "BM": bm, "BN": bnn, "BK": 256, "DOT": 1}  # bf16 prefill


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default=",".join(t.name for t in KERNEL_TYPES))
    ap.add_argument("--arch", type=int, default=90, help="compute capability, 90 for H100/H200")
    ap.add_argument("--block-rows", type=int, default=8)
    args = ap.parse_args(argv)
    types = [quant.get(name).ggml_type for name in args.types.split(",")]
    failed = 0
    for label, name, constants in jobs(types, args.block_rows):
        t0 = time.perf_counter()
        try:
            compiled = compile_kernel(name, constants, args.arch)
            info = f"{resources(compiled)}; {loads(compiled)}"
        except Exception as e:  # noqa: BLE001  (compiler errors of any kind: report each kernel, then fail)
            failed += 1
            info = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        print(f"{label:18s} sm_{args.arch}  {time.perf_counter() - t0:5.1f} s  {info}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
