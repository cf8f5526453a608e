"""Is a qwen3next logit gap a formula difference or float32 rounding? Both sides run in float64.

    python bench/qwen3next_float64.py --seeds 1 2 3 4

The model is tests/test_llama_cpp_converter.py's tiny Qwen3-Next (torch seed 0, SmolLM2's 49,152
tokens), the prompt its 12 tokens of `--seeds`. `model.double()` is not float64 throughout in
transformers: its Gated DeltaNet, RMS norms and softmaxes cast to float32 by name. So the
reference here is transformers' own modeling_qwen3_next source with every float32 cast made
float64 (executed as a module, nothing written), and Strata's gated_deltanet.py gets the same
treatment for the layer-level check.

Printed per seed:
  logits   max |difference| over the prompt of transformers fp32 and Strata fp32 (one prefill, and
           token by token through the decode step) against the float64 reference, and of Strata
           against transformers fp32 (what the converter test checks);
  layers   each DeltaNet layer on transformers' own inputs, Strata in float64 against the float64
           reference, chunked prefill and token-by-token decode; `ssm_a` is the file's float32
           -exp(A_log) unless --exact-a;
  worst    the head whose DeltaNet output (the gated RMSNorm's input) transformers' fp32 gets
           relatively most wrong, its RMS, and the gain 1/sqrt(RMS^2 + eps) the norm applies to it:
           a near-cancelled output (RMS << sqrt(eps)) carries float32 rounding of the O(1) terms it
           was summed from, and the norm scales that absolute error up by ~1/sqrt(eps).
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import types
from pathlib import Path

import torch

ROOT = Path(__file__).parent.parent
VOCAB = 49152  # the converter test's tokenizer (SmolLM2)
TOKENS = 12


def float64_source(module: types.ModuleType, name: str) -> types.ModuleType:
    """`module`'s source with every float32 cast made float64, executed as a new module."""
    src = Path(module.__file__).read_text()
    for a, b in (("torch.float32", "torch.float64"), ("dtype=torch.float)", "dtype=torch.float64)"),
                 ("dtype=torch.float,", "dtype=torch.float64,"), (".float()", ".double()")):
        src = src.replace(a, b)
    out = types.ModuleType(name)
    out.__file__, out.__package__ = module.__file__, module.__package__
    sys.modules[name] = out  # transformers' decorators look the class's module up
    exec(compile(src, f"{module.__file__} [float64]", "exec"), out.__dict__)
    return out


def tiny_model():
    sys.path.insert(0, str(ROOT / "tests"))
    import test_qwen3next

    test_qwen3next.VOCAB = VOCAB
    torch.manual_seed(0)
    return test_qwen3next.tiny_qwen3next().eval()


def strata_mixer_float64(mixer, gd64):
    """A copy of Strata's GatedDeltaNet whose weights are float64 tensors (run with gd64's code)."""
    from strata.models.linear import Linear

    m = copy.copy(mixer)
    for name in ("wqkv", "wz", "wb", "wa", "wo"):
        w = getattr(m, name)
        setattr(m, name, (w.weight if isinstance(w, Linear) else w).double())
    for name in ("conv_w", "dt_bias", "a", "norm"):
        setattr(m, name, getattr(m, name).double())
    return m


def strata_chunked_and_decode(gd64, mixer64, x):
    """Strata's DeltaNet (gd64's code, float64 weights) over x (1, T, hidden): one prefill, and
    token by token through the decode step."""
    from strata.models.cache import StepInfo

    t = x.shape[1]
    chunked = gd64.GatedDeltaNet.forward(mixer64, x, gd64.GDNCache(), StepInfo(torch.tensor([0]), torch.tensor([t]), t))
    cache = gd64.GDNCache()
    decode = torch.cat([gd64.GatedDeltaNet.forward(mixer64, x[:, i:i + 1], cache, StepInfo(
        torch.tensor([i]), torch.tensor([1]), 1)) for i in range(t)], 1)
    return chunked, decode


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--exact-a", action="store_true", help="ssm_a = -exp(A_log) in float64 in the layer check")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    import strata
    import strata.models.gated_deltanet as gd
    from transformers.models.qwen3_next import modeling_qwen3_next as mq

    mq64 = float64_source(mq, "transformers.models.qwen3_next.modeling_qwen3_next_float64")
    gd64 = float64_source(gd, "strata.models.gated_deltanet_float64")
    model = tiny_model()
    model.set_experts_implementation("eager")  # grouped_mm takes no float64
    ref = mq64.Qwen3NextForCausalLM(copy.deepcopy(model.config))
    ref.load_state_dict(model.state_dict())
    ref = ref.double().eval()
    ref.set_experts_implementation("eager")
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        engine = strata.load(d)
    deltanet = [i for i, layer in enumerate(model.model.layers) if hasattr(layer, "linear_attn")]

    def worst(a, b):
        return (a.double() - b.double()).abs().max().item()

    for seed in args.seeds:
        ids = torch.randint(0, VOCAB, (TOKENS,), generator=torch.Generator().manual_seed(seed))[None]
        inputs, normed, normed32 = {}, {}, {}
        hooks = [model.model.layers[i].linear_attn.register_forward_pre_hook(
            lambda mod, a, kw, i=i: inputs.__setitem__(i, kw.get("hidden_states", a[0] if a else None).clone()),
            with_kwargs=True) for i in deltanet]
        hooks += [ref.model.layers[i].linear_attn.norm.register_forward_pre_hook(
            lambda mod, a, i=i: normed.__setitem__(i, a[0].clone())) for i in deltanet]
        hooks += [model.model.layers[i].linear_attn.norm.register_forward_pre_hook(
            lambda mod, a, i=i: normed32.__setitem__(i, a[0].clone())) for i in deltanet]
        with torch.inference_mode():
            hf32, hf64 = model(ids).logits[0], ref(ids).logits[0]
            st32 = engine.model(ids, engine.model.new_cache(1))[0]
            cache = engine.model.new_cache(1)
            st32_decode = torch.cat([engine.model(ids[:, t:t + 1], cache)[0] for t in range(TOKENS)])
        for h in hooks:
            h.remove()
        print(f"seed {seed}  logits from float64: transformers fp32 {worst(hf32, hf64):.2e}, Strata fp32 "
              f"{worst(st32, hf64):.2e} (token by token {worst(st32_decode, hf64):.2e}); "
              f"Strata - transformers fp32 {worst(st32, hf32):.2e}")
        for i in deltanet:
            x = inputs[i].double()
            with torch.inference_mode():
                want = ref.model.layers[i].linear_attn(x)
                mixer = strata_mixer_float64(engine.model.blocks[i].attn, gd64)
                if args.exact_a:
                    mixer.a = -ref.model.layers[i].linear_attn.A_log.detach().exp()
                chunked, decode = strata_chunked_and_decode(gd64, mixer, x)
            o64 = normed[i].reshape(TOKENS, -1, normed[i].shape[-1])
            o32 = normed32[i].double().reshape(o64.shape)
            rel = ((o32 - o64).norm(dim=-1) / o64.norm(dim=-1))  # (token, head)
            t, h = divmod(int(rel.argmax()), rel.shape[1])
            rms = o64[t, h].pow(2).mean().sqrt().item()
            eps = ref.model.layers[i].linear_attn.norm.variance_epsilon
            print(f"  layer {i}: Strata float64 - reference: chunked {worst(chunked, want):.1e}, "
                  f"decode {worst(decode, want):.1e}; transformers fp32's worst head output: relative "
                  f"error {rel[t, h]:.0e} (token {t}, head {h}), RMS {rms:.1e}, norm gain "
                  f"{(rms * rms + eps) ** -0.5:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
