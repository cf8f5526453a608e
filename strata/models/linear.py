"""Dense layers whose weights stay in the file's type: `Linear` (y = x W^T + b) and `Embedding`.

A quantized weight (Q4_K, Q6_K, IQ2_XS, ...) is kept as its blocks, 4-8x smaller than float32,
and multiplied by the compiled kernels (`kernels.qmatmul`) for the few rows of a decode step;
a large batch (prefill) dequantizes it a bounded slab of rows at a time (`SCRATCH_BYTES`) and
uses BLAS, so a 2.5 GB-as-float output head never exists whole. An embedding dequantizes only
the rows it looks up. Float weights are plain torch tensors in their stored type (an F16 matrix
stays F16, not widened to F32 at load: a decode step's few rows go through `kernels.f16`, each
weight widened as it is read, x in F32; a prompt through torch's F16 matmul), and
`kernels.USE_KERNELS = False` sends quantized ones down the reference path (dequantize, then
`F.linear`), so tests can compare the two.

Both also answer `F.linear(x, layer)` / `F.embedding(ids, layer)` (torch's `__torch_function__`
protocol), so code that treats a weight as a tensor, such as a draft head sharing the model's
output projection, keeps working unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strata import kernels, quant
from strata.kernels import decode_ops, f16
from strata.kernels.threads import one_thread_if_small
from strata.formats.weights import FLOAT_TYPES, QTensor

Weight = torch.Tensor | QTensor
SCRATCH_BYTES = 64 << 20  # the most floats one dequantized slab of a weight may take


def keeps_quantized(t: QTensor) -> bool:
    """Whether a stored tensor is worth keeping in its blocks: quantized and with a CPU kernel.

    Types without a kernel (and every type when the kernels did not build) would be dequantized
    on every call, far slower than once at load, so they are dequantized at load as before.
    """
    return t.qtype not in FLOAT_TYPES and kernels.has_kernel(t.qtype)


def _device_qmatmul(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """x W^T on the device through the `strata::qmatmul` custom op (Triton from the blocks)."""
    from strata.kernels.gpu import ops  # noqa: F401  (registers torch.ops.strata.*)

    flat = x.reshape(-1, x.shape[-1])
    return torch.ops.strata.qmatmul(flat, w.raw, int(w.qtype), w.shape[-1]).reshape(*x.shape[:-1], w.shape[0])


def apply_linear(x: torch.Tensor, w: Linear | torch.Tensor) -> torch.Tensor:
    """x W^T for a `Linear` or a plain weight tensor (a layer whose weights a subclass regroups
    as floats at load holds either)."""
    return w(x) if isinstance(w, Linear) else F.linear(x, w)


def dequantized_product(x: torch.Tensor, w: QTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T through dequantized floats, `SCRATCH_BYTES` of W's rows at a time (one slab when W is small)."""
    rows, cols = w.shape
    step = max(1, SCRATCH_BYTES // max(cols * x.element_size(), 1))
    if step >= rows:
        return F.linear(x, w.dequantize(x.dtype), bias)
    out = torch.empty(*x.shape[:-1], rows, dtype=x.dtype, device=x.device)
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        slab = QTensor(w.raw[start:stop], w.qtype, (stop - start, cols))
        out[..., start:stop] = F.linear(x, slab.dequantize(x.dtype))
    return out if bias is None else out + bias


class _StoredWeight:
    """A weight as the file stores it (float tensor or `QTensor`): what `Linear` and `Embedding` share."""

    __slots__ = ("weight",)

    @property
    def quantized(self) -> bool:
        return isinstance(self.weight, QTensor)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    def to_device(self, device: torch.device):
        """Move the weight (its blocks, not floats) in place; returns self."""
        self.weight = self.weight.to(device)
        return self

    def __repr__(self) -> str:
        kind = self.weight.qtype.name if self.quantized else str(self.weight.dtype)
        return f"{type(self).__name__}({tuple(self.weight.shape)}, {kind}{self._repr_extra()})"

    def _repr_extra(self) -> str:
        return ""


class Linear(_StoredWeight):
    """y = x W^T (+ b); W a float tensor or a `QTensor` kept as the file stores it.

    A plain callable, not an `nn.Module`: a weight, like the tensors it replaces (a subclass may
    assign a tensor in its place), and one Python call cheaper per use on the decode path.
    """

    __slots__ = ("bias", "name")

    def __init__(self, weight: Weight, bias: torch.Tensor | None = None, name: str | None = None):
        self.weight = weight
        self.bias = bias
        self.name = name  # the file's tensor name, which the plan's per-weight choices are keyed by

    @property
    def device(self) -> torch.device:
        return self.weight.raw.device if self.quantized else self.weight.device

    @property
    def nbytes(self) -> int:
        b = 0 if self.bias is None else self.bias.nbytes
        return self.weight.nbytes + b

    def dense(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W as a float tensor (a dequantized copy when it is quantized)."""
        return self.weight.dequantize(dtype) if self.quantized else self.weight.to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if not isinstance(w, QTensor):
            if w.dtype != x.dtype:  # a float16/bfloat16 matrix kept as stored: multiplied in its type
                y = f16.try_f16_matmul(x, w) if w.dtype is torch.float16 else None  # decode rows: one C call
                if y is None:
                    with one_thread_if_small(x.numel() * w.shape[0], x.device):
                        y = F.linear(x.to(w.dtype), w).to(x.dtype)
                return y if self.bias is None else y + self.bias
            with one_thread_if_small(x.numel() * w.shape[0], x.device):
                return F.linear(x, w, self.bias)
        if x.device.type != "cpu":  # on the device: the Triton kernels read the blocks, nothing is dequantized
            # (decode rows one program each, prefill in tiles; a type without a decoder was
            # dequantized at placement: `device_budget.dense_forms`)
            y = _device_qmatmul(x, w)
            return y if self.bias is None else y + self.bias
        # a prompt's rows (from the fewest, `kernels.prompt_batches`) or more than the decode kernels
        # take: the AMX product (prefill.c); a verify pass or decode batch: the decode kernels
        y = kernels.try_qmatmul_prompt(x, w)
        if y is None:
            y = kernels.try_qmatmul(x, w)  # None: prefill, another device, no kernel, or kernels off
        if y is None and w.shape[0] * w.shape[1] * 4 <= SCRATCH_BYTES:  # else in slabs below
            y = kernels.try_qmatmul_dequantized(x, w)  # ggml dequantizes, one matmul
        if y is not None:
            return y if self.bias is None else y + self.bias
        return dequantized_product(x, w, self.bias)  # prefill, another device, or the reference

    def split_rows(self, regroup) -> list[Linear]:
        """Linears over row groups of W: `regroup(rows)` reorders or splits a (rows, ...) tensor
        along its first dimension only, so it applies to the blocks of a quantized W as well."""
        if self.bias is not None:
            raise ValueError("split_rows does not split a bias")
        w = self.weight
        if not self.quantized:
            return [Linear(t, name=self.name) for t in regroup(w)]
        return [Linear(QTensor(t.contiguous(), w.qtype, (t.shape[0], w.shape[-1])), name=self.name)
                for t in regroup(w.raw)]

    def to_device(self, device: torch.device, dequantize: torch.dtype | None = None) -> Linear:
        """Move to `device`; with `dequantize`, a quantized W becomes a float tensor of that dtype
        there, once (the plan's choice when the device has room for dense weights)."""
        if self.bias is not None:
            self.bias = self.bias.to(device)
        if dequantize is not None and self.quantized:
            self.weight = self.weight.to(device).dequantize(dequantize)
            return self
        return super().to_device(device)

    def _repr_extra(self) -> str:
        return f", bias={self.bias is not None}"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, layer, *rest = args
            bias = rest[0] if rest else kwargs.get("bias")
            if bias is not None and layer.bias is not None:
                raise ValueError("F.linear got a bias for a Linear that already has one")
            y = layer(x)
            return y if bias is None else y + bias
        if func is F.embedding and isinstance(args[1], cls):
            return Embedding(args[1].weight)(args[0])
        return NotImplemented


def linear_group(x: torch.Tensor, linears: tuple[Linear, ...]) -> list[torch.Tensor]:
    """Each Linear applied to the same x (q/k/v, gate/up): quantized ones of a decode step in one
    C call (`decode_ops.try_qmatmul_group`), else one by one."""
    if not kernels.in_prompt() and all(type(lin) is Linear and isinstance(lin.weight, QTensor) for lin in linears):
        ys = decode_ops.try_qmatmul_group(x, tuple(lin.weight for lin in linears), tuple(lin.bias for lin in linears))
        if ys is not None:
            return ys
    return [lin(x) for lin in linears]


class InputPermutedLinear(Linear):
    """y = x[..., order] W^T: a weight whose input columns the file stores in another order is
    used as stored (quantized blocks cannot be reordered by column), and the activation is
    reordered instead, a gather of one row per token."""

    __slots__ = ("order",)

    def __init__(self, weight: Weight, order: torch.Tensor, bias: torch.Tensor | None = None, name: str | None = None):
        super().__init__(weight, bias, name)
        self.order = order  # long (in,): input column i of W reads x[..., order[i]]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return super().__call__(x.index_select(-1, self.order.to(x.device)))

    def dense(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The equivalent weight over x in its own order (a float copy)."""
        w = super().dense(dtype)
        out = torch.empty_like(w)
        out[:, self.order.to(w.device)] = w
        return out

    def to_device(self, device: torch.device, dequantize: torch.dtype | None = None) -> InputPermutedLinear:
        self.order = self.order.to(device)
        return super().to_device(device, dequantize)


class Embedding(_StoredWeight):
    """Rows of a (vocab, hidden) table by token id; a quantized table decodes only those rows."""

    __slots__ = ("dtype",)

    def __init__(self, weight: Weight, dtype: torch.dtype = torch.float32):
        self.weight = weight
        self.dtype = dtype  # of the rows handed out when the table is quantized

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if not isinstance(w, QTensor):
            return F.embedding(ids.to(w.device, non_blocking=True), w).to(self.dtype)  # host ids: never read back
        hidden = w.shape[-1]
        rows = w.raw[ids.reshape(-1).to(w.raw.device, non_blocking=True)]  # (N, row_bytes)
        out = None
        if rows.device.type == "cpu" and rows.shape[0] <= kernels.FAST_BATCH_MAX and self.dtype is torch.float32:
            # a decode step's row by ggml's dequantizer: 5 us where the torch decode of a Q4_K row took 120
            out = kernels.dequantize_ggml(QTensor(rows, w.qtype, (rows.shape[0], hidden)), torch.float32, threads=1)
        if out is None:
            out = quant.dequantize(rows, w.qtype, (rows.shape[0], hidden)).to(self.dtype)
        return out.reshape(*ids.shape, hidden)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is F.embedding:
            return args[1](args[0])
        if func is F.linear:  # a tied output projection
            return Linear(args[1].weight)(args[0])
        return NotImplemented
