"""The AMX prompt products (strata/kernels/prefill.c) against the exact dequantized math.

Each type's own dequantizer must equal gguf-py's decoder value for value, and its decoding straight
into bfloat16 parts must equal gguf-py's values split; each product, with 3
terms (the default "q8x2"), must stay within 2e-5 of max |y| of float64 math on gguf-py's
dequantized weights, and within 1e-2 with 1 term ("q8": bfloat16 rounding);
odd row counts (a partial 16-row tile, a partial 64-row panel), row counts of x that are not a
multiple of 16 (1 and 33), an odd number of blocks per row, 1 and 2 threads. Then a model: prefill logits of
files llama.cpp quantized, through these products, stay closer to the exact dequantized math than
llama.cpp's own logits.
"""

from __future__ import annotations

import contextlib
import ctypes

import gguf.quants
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from strata import kernels
from strata.formats.weights import QTensor
from strata.kernels import _build, prompt

pytestmark = pytest.mark.skipif(prompt.backend() != "amx", reason="no AMX-BF16 on this CPU (or no C compiler); the AVX2 products: test_prompt_avx2.py")

# type -> byte offsets of its float16 scales in a block (random bytes elsewhere are valid blocks)
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
              "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ2_XXS": (0,), "IQ2_XS": (0,),
              "IQ4_NL": (0,), "IQ4_XS": (0,), "MXFP4": (), "IQ3_XXS": (0,), "IQ3_S": (0,), "IQ2_S": (0,),
              "IQ1_S": (0,), "IQ1_M": ()}
OWN = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ2_XXS", "IQ2_XS",
       "IQ4_NL", "IQ4_XS", "MXFP4", "IQ3_XXS", "IQ3_S", "IQ2_S", "IQ1_S", "IQ1_M"]


def _count_calls(monkeypatch, *names: str) -> dict[str, int]:
    """Calls of each named `strata.kernels.prompt` entry point, counted as they happen."""
    calls = dict.fromkeys(names, 0)
    for name in names:
        real = getattr(prompt, name)
        monkeypatch.setattr(prompt, name, lambda *a, _r=real, _n=name, **k: calls.__setitem__(_n, calls[_n] + 1) or _r(*a, **k))
    return calls


def random_blocks(name: str, rows: int, cols: int, seed: int = 0) -> QTensor:
    qt = T[name]
    qk, ts = GGML_QUANT_SIZES[qt]
    g = np.random.default_rng(seed)
    raw = g.integers(0, 256, size=(rows, cols // qk, ts), dtype=np.uint8)
    scales = g.uniform(0.002, 0.02, size=(rows, cols // qk, len(F16_FIELDS[name]))).astype(np.float16)
    for i, off in enumerate(F16_FIELDS[name]):
        raw[:, :, off:off + 2] = scales[:, :, i:i + 1].view(np.uint8)
    if name == "MXFP4":  # its scale: one E8M0 byte, 2^(e - 127), e near 120 (and the two smallest)
        raw[:, :, 0] = g.integers(118, 124, size=raw.shape[:2])
        raw[0, 0, 0], raw[-1, -1, 0] = 0, 1
    if name == "IQ1_M":  # its f16 scale: the top nibbles of the four u16 sub-block scales (bytes 48-55)
        d = g.uniform(0.002, 0.02, size=raw.shape[:2]).astype(np.float16).view(np.uint16)
        sc = raw[:, :, 48:56].copy().view(np.uint16) & 0x0FFF
        for k in range(4):
            sc[:, :, k] |= ((d >> (4 * k)) & 0xF) << 12
        raw[:, :, 48:56] = sc.view(np.uint8)
    return QTensor(torch.from_numpy(raw.reshape(rows, -1).copy()), qt, (rows, cols))


def gguf_dequantized(w: QTensor) -> torch.Tensor:
    """w's values by gguf-py's own decoder (float32, as gguf-py returns them)."""
    return torch.from_numpy(gguf.quants.dequantize(w.raw.numpy(), w.qtype).reshape(w.shape).copy())


def _cols(name: str) -> int:
    return 3 * 256 if GGML_QUANT_SIZES[T[name]][0] == 256 else 7 * 32  # an odd number of blocks


@pytest.mark.parametrize("name", OWN)
def test_own_dequantizer_equals_reference(name):
    w = random_blocks(name, 3, _cols(name))
    ref = gguf_dequantized(w)
    assert torch.isfinite(ref).all() and ref.abs().max() > 0
    for r in range(3):
        got = prompt.dequant_row(w.raw[r], w.qtype, w.shape[1])
        assert got is not None
        torch.testing.assert_close(got, ref[r], rtol=0, atol=0)


def _bf16_parts(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """v's bfloat16 parts as AVX-512's conversion makes them: hi = v to nearest even, lo = v - hi
    likewise, float32 subnormals taken as zero (that instruction's rule)."""
    def bf(t):
        return torch.where(t.abs() < torch.finfo(torch.float32).tiny, torch.zeros_like(t), t).to(torch.bfloat16)

    hi = bf(v)
    return hi, bf(v - hi.float())


@pytest.mark.parametrize("name", OWN)
def test_own_decoder_writes_reference_bf16_parts(name):
    """The prompt products decode blocks straight into bfloat16 parts: they must be gguf-py's
    values split to nearest even, bit for bit."""
    w = random_blocks(name, 3, _cols(name), seed=5)
    ref = gguf_dequantized(w)
    for r in range(3):
        got = prompt.decode_bf16(w.raw[r], w.qtype, w.shape[1])
        assert got is not None
        want = _bf16_parts(ref[r])
        assert (want[1] != 0).any() or name == "MXFP4"  # lo carries something (MXFP4's values are bf16)
        for part, g, e in zip(("hi", "lo"), got, want):
            bad = (g.float() != e.float()).nonzero().flatten()
            assert not bad.numel(), (name, r, part, bad[:4].tolist(), g[bad[:4]].tolist(), e[bad[:4]].tolist())


@pytest.mark.parametrize("name", OWN)
@pytest.mark.parametrize("threads", [1, 2])
def test_prompt_product_matches_exact(name, threads):
    if not prompt.has_type(T[name]):
        pytest.skip(f"{name} needs ggml's dequantizer, which is not loaded")
    cols = _cols(name)
    for rows in (37, 70):  # one partial panel; a full one then a partial one
        w = random_blocks(name, rows, cols, seed=rows)
        exact_w = gguf_dequantized(w).double()
        for tokens in (1, 33):
            x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(tokens))
            ref = x.double() @ exact_w.T
            scale = float(ref.abs().max())
            for terms, bound in ((3, 2e-5), (1, 1e-2)):
                y = prompt.matmul(x, w, threads, terms)
                assert y is not None and y.shape == (tokens, rows) and y.dtype == torch.float32
                err = float((y.double() - ref).abs().max()) / scale
                assert err < bound, (name, rows, tokens, terms, err)


def test_prompt_product_leading_shape_and_refusals():
    w = random_blocks("Q4_K", 20, 256)
    x = torch.randn(2, 9, 256)
    y = prompt.matmul(x, w, 1)
    assert y.shape == (2, 9, 20)
    ref = x.double() @ w.dequantize(torch.float64).T
    assert float((y.double() - ref).abs().max()) < 2e-5 * float(ref.abs().max())
    assert prompt.matmul(torch.randn(4, 128), w, 1) is None  # wrong row length


def test_prefill_routes_prompt_batches_to_amx(monkeypatch):
    """In the 8-bit modes a prompt-sized batch takes the AMX product, a decode row does not, and
    exact / int16 activations never do."""
    calls = []
    real = prompt.matmul
    monkeypatch.setattr(prompt, "matmul", lambda *a, **k: calls.append(1) or real(*a, **k))
    w = random_blocks("IQ2_XS", 64, 512)
    before = kernels.activations()
    try:
        for mode, rows, used in (("q8x2", 80, True), ("q8", 80, True), ("q8x2", 1, False), ("int16", 80, False),
                                 ("float32", 80, False)):
            kernels.set_activations(mode)
            calls.clear()
            kernels.qmatmul(torch.randn(rows, 512), w)
            assert bool(calls) == used, (mode, rows)
    finally:
        kernels.set_activations(before)


# --- a model: prefill logits of llama.cpp-quantized files through the AMX products ---------------

PROMPT = [(7 * i + 3) % 250 + 2 for i in range(100)]  # > 64 tokens: the prompt path, not the decode kernels


@pytest.fixture(scope="module")
def quantized_files(tmp_path_factory):
    """test_kernels' llama.cpp-quantized tiny MoE llama, one layer, room for PROMPT."""
    from test_kernels import write_llama_quantized

    return write_llama_quantized(tmp_path_factory.mktemp("prefill-quantized"), n_layers=1, context_length=128)


def _prefill_logits(path, mode: str, threads: int = 1) -> tuple[torch.Tensor, dict]:
    """(prefill logits of PROMPT, how many AMX calls of each kind ran) with the kernels in `mode`."""
    import strata

    calls = {"matmul": 0, "moe": 0}
    real = {name: getattr(prompt, name) for name in calls}

    def counted(name):
        def call(*a, **k):
            calls[name] += 1
            return real[name](*a, **k)
        return call

    before = kernels.activations()
    kernels.set_activations(mode)
    mp = pytest.MonkeyPatch()
    for name in calls:
        mp.setattr(prompt, name, counted(name))
    try:
        engine = strata.load(path, cpu_threads=threads, draft="off")
        logits = engine.logits(PROMPT).float()
        engine.close()
    finally:
        mp.undo()
        kernels.set_activations(before)
    return logits, calls


def test_prefill_logits_within_llama_cpps_distance(quantized_files):
    import llama_cpp
    import numpy as np

    def llama_logits(path):
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, n_batch=128, n_threads=1, logits_all=True, verbose=False)
        llm.eval(PROMPT)
        return torch.tensor(np.array(llm.scores[: len(PROMPT)]))

    exact_f32, _ = _prefill_logits(quantized_files["F32"], "float32")  # first: both engines, one model
    assert float((llama_logits(quantized_files["F32"]) - exact_f32).abs().max()) < 1e-3 * float(exact_f32.abs().max()) + 1e-3
    for name in ("Q8_0", "Q4_K_M", "IQ2_XS"):
        path = quantized_files[name]
        exact, n_exact = _prefill_logits(path, "float32")
        assert not any(n_exact.values())
        theirs = float((llama_logits(path) - exact).abs().max())
        for mode, threads in (("q8x2", 1), ("q8x2", 2), ("q8", 1)):
            ours, n = _prefill_logits(path, mode, threads)
            assert n["matmul"] >= 4 and n["moe"] >= 1, (name, mode, n)  # q, k, v, output; the layer's experts
            dist = float((ours - exact).abs().max())
            print(f"{name} {mode} {threads} thr: prefill max logit distance from exact {dist:.4f}, llama.cpp {theirs:.4f}")
            assert dist <= theirs, (name, mode, dist, theirs)
            if mode == "q8x2":
                assert dist < 1e-2 * max(theirs, 1e-3) + 2e-3, (name, dist)


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("IQ2_XS", "IQ2_XS", "IQ2_XS"), ("Q8_0", "Q5_K", "Q4_0"),
                                   ("IQ1_M", "IQ3_S", "IQ2_S")])
@pytest.mark.parametrize("threads", [1, 2])
def test_prompt_experts_match_reference(types, threads, monkeypatch):
    """A prompt's routed experts (one C call for the layer, and one per expert for a tier's source)
    against the grouped reference; one expert gets fewer rows than PROMPT_AMX_MIN_ROWS (its decode
    kernels), one none."""
    from strata.kernels import grouped

    n_exp, hidden, ffn, tokens = 5, 512, 256, 70
    stacked = [random_blocks(t, n_exp * rows, cols, seed=i) for i, (t, rows, cols) in
               enumerate(zip(types, (ffn, ffn, hidden), (hidden, hidden, ffn)))]
    stacked = tuple(QTensor(q.raw.reshape(n_exp, q.shape[0] // n_exp, -1), q.qtype, (n_exp, q.shape[0] // n_exp, q.shape[1]))
                    for q in stacked)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, hidden, generator=g) * 0.1
    ids = torch.stack([torch.randint(0, 3, (tokens,), generator=g), torch.full((tokens,), 3)], dim=1)
    ids[:3, 1] = 4  # expert 4: three rows; expert 3: the rest
    weights = torch.rand(tokens, 2, generator=g)
    table = grouped.route_table(ids, weights)
    calls = _count_calls(monkeypatch, "moe", "swiglu")
    before = kernels.activations()
    kernels.set_activations("q8x2")
    try:
        ref = grouped.grouped_swiglu(x.double(), table, tuple(QTensor(q.raw, q.qtype, q.shape) for q in stacked),
                                     lambda xs, a, b, c: grouped.swiglu_reference(xs, *(q.dequantize(torch.float64) for q in (a, b, c))))
        got = kernels.grouped_swiglu(x, table, stacked, threads)
        assert calls == {"moe": 1, "swiglu": 0}
        source = grouped.as_source(stacked)
        with kernels.prompt_batches():  # a tier's experts over a prompt (a verify pass keeps the decode kernels)
            tiered = kernels.grouped_swiglu(x, table, lambda e: source(e), threads)  # callable: expert by expert
        assert calls == {"moe": 1, "swiglu": 4}  # expert 4's three rows: the decode kernels
    finally:
        kernels.set_activations(before)
    scale = float(ref.abs().max())
    for y in (got, tiered):
        assert float((y.double() - ref).abs().max()) < 2e-4 * scale


@pytest.mark.parametrize("tokens", [100, 2100])  # 2100 x 2 pair rows of 512 floats: two batches of them
def test_prompt_experts_whole_on_the_pool_equal_one_thread_bit_for_bit(tokens):
    """At 2 threads a layer's many experts go to the pool whole (each on one thread), and their rows
    are summed token by token in the route table's order: out must equal the 1-thread result (one
    expert after another, each product split) bit for bit. One expert has 3 rows (its decode
    kernels), one none."""
    from strata.kernels import grouped

    n_exp, hidden, ffn = 12, 512, 256
    stacked = [random_blocks(t, n_exp * rows, cols, seed=i) for i, (t, rows, cols) in
               enumerate(zip(("Q4_K", "IQ2_XS", "Q6_K"), (ffn, ffn, hidden), (hidden, hidden, ffn)))]
    stacked = tuple(QTensor(q.raw.reshape(n_exp, q.shape[0] // n_exp, -1), q.qtype, (n_exp, q.shape[0] // n_exp, q.shape[1]))
                    for q in stacked)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g) * 0.1
    ids = torch.stack([torch.randint(0, 5, (tokens,), generator=g), torch.randint(5, 10, (tokens,), generator=g)], dim=1)
    ids[:3, 1] = 11  # expert 11: three rows; expert 10: none
    table = grouped.route_table(ids, torch.rand(tokens, 2, generator=g))
    used, counts = torch.unique_consecutive(table.expert, return_counts=True)
    before = kernels.activations()
    kernels.set_activations("q8x2")
    try:
        spec = kernels._prompt_experts(x, stacked)
        outs = []
        for threads in (1, 2):
            out = prompt.moe(x, used, counts, table.token, table.weight, stacked, threads, *spec)
            assert out is not None
            outs.append(out)
    finally:
        kernels.set_activations(before)
    assert outs[0].abs().max() > 0 and torch.equal(outs[0], outs[1])


def test_prefill_logits_match_transformers(tmp_path, monkeypatch):
    """A tiny Qwen3-MoE (transformers' class, randomised norms) stored as Q8_0 / Q4_0 experts: its
    prefill logits through the AMX products ("q8x2", a 100-token prompt: the dense products and the
    layers' experts) against transformers given the same weights through gguf-py's quantize and
    dequantize."""
    import strata
    from reference import gguf_roundtrip, hf_logits, randomise, save_hf
    from test_models import VOCAB, qwen3moe

    from strata.gguf.convert import convert_hf_to_gguf

    torch.manual_seed(0)
    model = randomise(qwen3moe().eval())
    save_hf(model, tmp_path / "hf")
    convert_hf_to_gguf(tmp_path / "hf", tmp_path / "q.gguf", dense_type=T.Q8_0, expert_type=T.Q4_0)
    ref = gguf_roundtrip(model, T.Q8_0, T.Q4_0)
    ids = [(5 * i + 1) % VOCAB for i in range(100)]
    want = hf_logits(ref, ids)
    calls = _count_calls(monkeypatch, "matmul", "moe")
    before = kernels.activations()
    kernels.set_activations("q8x2")
    try:
        engine = strata.load(tmp_path / "q.gguf", cpu_threads=1, draft="off")
        got = engine.logits(ids)
        engine.close()
    finally:
        kernels.set_activations(before)
    assert calls["matmul"] >= 12 and calls["moe"] == 3, calls  # 3 layers: q, k, v, o; each layer's experts
    dist = (got - want).abs().max().item()
    print(f"prefill max logit distance from transformers: {dist:.2e} (max |logit| {want.abs().max().item():.2f})")
    assert dist < 5e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_prompt_at_two_threads_runs_torch_on_one_and_the_pool_on_two(tmp_path, monkeypatch):
    """A 2-thread prompt (runtime.generate.prefill): its small torch operators run on one thread
    (`threads.torch_team_for_large_only`: on shared cores each was a barrier for torch's team, whose
    workers spun between them), the prompt products keep the pool's two threads, torch's count is
    restored after, and the last logits match transformers on the same weights (randomised norms)."""
    import strata
    from reference import gguf_roundtrip, hf_logits, randomise, save_hf
    from test_models import VOCAB, qwen3moe

    from strata.gguf.convert import convert_hf_to_gguf
    from strata.runtime.generate import prefill

    torch.manual_seed(1)
    model = randomise(qwen3moe().eval())
    save_hf(model, tmp_path / "hf")
    convert_hf_to_gguf(tmp_path / "hf", tmp_path / "q.gguf", dense_type=T.Q8_0, expert_type=T.Q4_0)
    ids = [(3 * i + 2) % VOCAB for i in range(80)]
    want = hf_logits(gguf_roundtrip(model, T.Q8_0, T.Q4_0), ids)[-1]
    seen = []
    real = prompt.matmul
    monkeypatch.setattr(prompt, "matmul", lambda *a, **k: seen.append((torch.get_num_threads(), _build.pool_threads(None)))
                        or real(*a, **k))
    before, threads = kernels.activations(), torch.get_num_threads()
    kernels.set_activations("q8x2")
    try:
        engine = strata.load(tmp_path / "q.gguf", cpu_threads=2, draft="off")
        with torch.inference_mode():
            got = prefill(engine.model, [ids], engine.model.new_cache(1))[0].float()
        assert torch.get_num_threads() == 2
        engine.close()
    finally:
        kernels.set_activations(before)
        torch.set_num_threads(threads)
    assert seen and set(seen) == {(1, 2)}, set(seen)
    assert (got - want).abs().max().item() < 5e-4
    assert got.argmax() == want.argmax()


@contextlib.contextmanager
def refused_allocations(first: int, count: int = 1):
    """prefill.c's test hook: its buffer requests first .. first + count - 1 (counted from here) are
    refused as if memory had run out."""
    fn = _build.entry("strata_pp_test_fail_allocs", (ctypes.c_long, ctypes.c_long))
    fn(first, count)
    try:
        yield
    finally:
        fn(0, 0)


@pytest.mark.parametrize("first", [0, 1, 4])  # the packing of x; the first and the last of 4 panels
def test_prompt_product_out_of_memory_is_refused_and_falls_back(first):
    """A product whose packing or one 64-row panel cannot get its buffer returns None (that panel's
    rows were never written), and the caller's next path computes the whole product: within float32
    rounding of gguf-py's dequantized weights."""
    w = random_blocks("Q4_K", 200, 512)
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(2))
    ref = x.double() @ gguf_dequantized(w).double().T
    with refused_allocations(first):
        assert prompt.matmul(x, w, 1) is None
    before = kernels.activations()
    kernels.set_activations("q8x2")
    try:
        with kernels.prompt_batches(), refused_allocations(first):
            y = kernels.qmatmul(x, w, 1)
    finally:
        kernels.set_activations(before)
    assert float((y.double() - ref).abs().max()) < 2e-5 * float(ref.abs().max())


@pytest.mark.parametrize("name,cols", [("Q4_K", 3 * 4096 + 256), ("Q8_0", 4096 + 7 * 32)])
def test_ggml_bf16_dequantize_in_pieces_equals_reference(name, cols):
    """ggml's dequantize to bfloat16 (the prompt products' other path) decodes a row through a
    fixed stack buffer, piece by piece, where a failed allocation used to leave the rows at zero:
    rows longer than a piece (and a last piece of a few blocks) equal gguf-py's values rounded to
    bfloat16."""
    w = random_blocks(name, 5, cols)
    got = kernels.dequantize_ggml(w, torch.bfloat16, 2)
    if got is None:
        pytest.skip(f"ggml's dequantizer for {name} is not loaded")
    assert torch.equal(got, gguf_dequantized(w).to(torch.bfloat16))


def _stacked_experts(n_exp: int, hidden: int, ffn: int, types=("Q4_K", "Q4_K", "Q6_K")):
    parts = [random_blocks(t, n_exp * rows, cols, seed=i) for i, (t, rows, cols) in
             enumerate(zip(types, (ffn, ffn, hidden), (hidden, hidden, ffn)))]
    return tuple(QTensor(q.raw.reshape(n_exp, q.shape[0] // n_exp, -1), q.qtype, (n_exp, q.shape[0] // n_exp, q.shape[1]))
                 for q in parts)


def _experts_reference(x, table, stacked):
    from strata.kernels import grouped

    return grouped.grouped_swiglu(x.double(), table, tuple(QTensor(q.raw, q.qtype, q.shape) for q in stacked),
                                  lambda xs, a, b, c: grouped.swiglu_reference(xs, *(q.dequantize(torch.float64) for q in (a, b, c))))


# 1 thread: the experts one after another (request 0 their scratch; 1 x's packing; 2-5 gate's panels).
# 2 threads, 12 experts: whole experts on the pool; from request 3 on every buffer is refused, some
# expert part way, whichever thread asks first.
@pytest.mark.parametrize("threads,first,count", [(1, 0, 1), (1, 3, 1), (1, 40, 1), (2, 3, 10 ** 6)])
def test_prompt_experts_out_of_memory_fall_back_to_the_whole_sum(threads, first, count):
    """A layer's prompt experts whose buffers run out, before any expert or part way (out already
    holding some experts' rows), give None from prompt.moe, and grouped_swiglu's other path
    computes the whole sum, once: against float64 math on gguf-py-style dequantized weights."""
    from strata.kernels import grouped

    n_exp, hidden, ffn, tokens = 12, 256, 256, 70
    stacked = _stacked_experts(n_exp, hidden, ffn)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, hidden, generator=g) * 0.1
    ids = torch.stack([torch.randint(0, 6, (tokens,), generator=g), torch.randint(6, 12, (tokens,), generator=g)], dim=1)
    table = grouped.route_table(ids, torch.rand(tokens, 2, generator=g))
    used, counts = torch.unique_consecutive(table.expert, return_counts=True)
    ref = _experts_reference(x, table, stacked)
    before = kernels.activations()
    kernels.set_activations("q8x2")
    try:
        spec = kernels._prompt_experts(x, stacked)
        with refused_allocations(first, count):
            assert prompt.moe(x, used, counts, table.token, table.weight, stacked, threads, *spec) is None
        with refused_allocations(first, count):
            got = kernels.grouped_swiglu(x, table, stacked, threads)
        one = grouped.as_source(stacked)(0)
        for f in (0, 2, 14):  # one expert alone: its scratch, gate's first panel, down's last
            with refused_allocations(f):
                assert prompt.swiglu(x[:20], *one, threads, *spec) is None, f
        assert prompt.swiglu(x[:20], *one, threads, *spec) is not None
    finally:
        kernels.set_activations(before)
    assert float((got.double() - ref).abs().max()) < 2e-4 * float(ref.abs().max())


# --- a prompt's small operations in C: RMS norm (prefill.c) and the rotary embedding (qmm.c) ------

@pytest.mark.parametrize("dim", [128, 72])  # 72: a tail after the 16-lane sums
def test_prompt_rmsnorm_matches_float64(dim):
    from strata.kernels import decode_ops
    from strata.models.layers import RMSNorm

    g = torch.Generator().manual_seed(dim)
    norm = RMSNorm(torch.randn(dim, generator=g), 1e-5)
    x = torch.randn(3, 400, dim, generator=g) * torch.rand(3, 400, 1, generator=g) * 4  # rows of unequal size
    assert x.numel() > decode_ops.DECODE_MAX
    got = decode_ops.try_rmsnorm(x, norm.weight, norm.eps)
    assert got is not None and got.shape == x.shape
    xd = x.double()
    want = norm.weight.double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + norm.eps)
    err = float(((got.double() - want).abs() / want.abs().amax(-1, keepdim=True)).max())
    assert err < 1e-6, err
    assert torch.equal(norm(x), got)  # the module takes it
    assert decode_ops.try_rmsnorm(x[:, :2], norm.weight, norm.eps) is None  # decode-sized: torch's


@pytest.mark.parametrize("interleaved", [False, True])
def test_prompt_rope_matches_float64(interleaved):
    from strata.kernels import decode_ops

    tokens, heads, dim, rot = 600, 4, 64, 48  # a partial rotation: the last 16 values pass through
    g = torch.Generator().manual_seed(int(interleaved))
    x = torch.randn(1, tokens, heads, dim, generator=g)
    angle = torch.rand(1, tokens, 1, rot // 2, generator=g) * 6.3
    cos, sin = angle.cos(), angle.sin()
    assert x.numel() > decode_ops.DECODE_MAX
    got = decode_ops.try_rope(x, cos, sin, rot, interleaved)
    assert got is not None
    xd, c, s = x.double(), cos.double(), sin.double()
    x1, x2 = (xd[..., 0:rot:2], xd[..., 1:rot:2]) if interleaved else (xd[..., : rot // 2], xd[..., rot // 2: rot])
    a, b = x1 * c - x2 * s, x2 * c + x1 * s
    out = torch.stack((a, b), -1).flatten(-2) if interleaved else torch.cat((a, b), -1)
    want = torch.cat((out, xd[..., rot:]), -1)
    assert float((got.double() - want).abs().max()) < 1e-5


def test_prompt_delta_rule_solves_on_one_thread(monkeypatch):
    """qwen3-next's chunked delta rule runs its batched triangular solve with torch on one thread
    (at 2 threads on a shared machine MKL's took up to 1.5 s for a 512-token layer) and gives the
    caller's thread count back."""
    from strata.models import gated_deltanet

    seen = []
    real = torch.linalg.solve_triangular
    monkeypatch.setattr(torch.linalg, "solve_triangular", lambda *a, **k: seen.append(torch.get_num_threads()) or real(*a, **k))
    g = torch.Generator().manual_seed(0)
    b, h, t, dk, dv = 1, 2, 40, 8, 4
    q, k = torch.randn(b, h, t, dk, generator=g), torch.nn.functional.normalize(torch.randn(b, h, t, dk, generator=g), dim=-1)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gated_deltanet.chunk_gated_delta_rule(q, k, torch.randn(b, h, t, dv, generator=g), -torch.rand(b, h, t, generator=g),
                                              torch.rand(b, h, t, generator=g), torch.zeros(b, h, dk, dv), 16)
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
