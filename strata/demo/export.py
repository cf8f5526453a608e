"""Write the demo GGUF from the trained trunk and MTP head, then check it with `strata.load`.

The trunk is saved as transformers saves it, the head's `mtp.*` tensors beside it, and the pair
goes through Strata's own HF -> GGUF name table (`strata.formats.checkpoint.open_config`), so the file is
exactly what the converter makes of a checkpoint with an MTP layer. Types: experts Q8_0, the
n-gram table F16 (read from disk row by row), other matrices F16, norms, routers and convs F32.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import gguf
import torch

T = gguf.GGMLQuantizationType


def tensor_type(name: str, t: torch.Tensor) -> gguf.GGMLQuantizationType:
    if t.ndim == 1 or "ffn_gate_inp" in name or "norm" in name or "conv1d" in name:
        return T.F32
    if "_exps" in name and t.shape[-1] % 32 == 0:
        return T.Q8_0
    return T.F16


def write_hf(trunk, mtp, out: Path) -> Path:
    from safetensors.torch import save_file

    trunk.save_pretrained(out, safe_serialization=True)
    if mtp is not None:
        save_file(mtp.hf_tensors(), str(out / "mtp.safetensors"))
    return out


def demo_metadata(args, results: dict) -> dict:
    """general.* and the settings that determine the result (not the command line, so a default
    run that reproduces the shipped file writes it byte for byte)."""
    python = sys.version.split()[0]
    meta = {
        "general.name": "strata-demo",
        "general.description": f"strata's demo model: a tiny qwen4exp (Gated DeltaNet, QSA, MoE, hyper-connections, "
                               f"an n-gram table, an MTP draft layer) trained by strata/demo/train.py on the Python "
                               f"{python} standard library sources",
        "strata.demo.python": python,
        "strata.demo.seed": args.seed,
        "strata.demo.batch_tokens": args.batch_tokens,
        "strata.demo.seq": args.seq,
        "strata.demo.lr": float(args.lr),
        "strata.demo.mtp_lr": float(args.mtp_lr),
        "strata.demo.aux_coef": float(args.aux_coef),
    }
    for key in ("trunk_steps", "mtp_steps"):
        meta[f"strata.demo.{key}"] = int(results[key])
    for key in ("trunk_train_loss", "held_out_loss", "mtp_loss", "mtp_held_out_agreement"):
        meta[f"strata.demo.{key}"] = float(results[key])
    meta["strata.demo.train_tokens"] = int(results["trunk_steps"]) * args.batch_tokens
    return meta


def write_demo_gguf(hf_dir: Path, out: Path, extra_meta: dict) -> Path:
    from strata.gguf.writer import write_gguf
    from strata.formats.checkpoint import open_config

    arch, config, source, _ = open_config(hf_dir)
    meta = arch.gguf_metadata(config) | extra_meta
    tensors = []
    for name in source.names():
        t = source.get(name).dequantize()
        tensors.append((name, t, tensor_type(name, t)))
    out.parent.mkdir(parents=True, exist_ok=True)
    return write_gguf(out, arch.ARCH, meta, tensors)


def export_demo(out: Path, trunk, mtp, tok, tok_metadata: dict, args, results: dict,
                held_data: torch.Tensor) -> bool:
    """`tok_metadata`: the trained tokenizer's GGUF keys (`train.tokenizer_metadata`)."""
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = write_hf(trunk, mtp, Path(tmp) / "hf")
        write_demo_gguf(hf_dir, out, demo_metadata(args, results) | tok_metadata)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB)", flush=True)
    return verify(out, trunk, mtp, tok, held_data)


@torch.no_grad()
def verify(path: Path, trunk, mtp, tok, held_data: torch.Tensor, n: int = 128) -> bool:
    """The file against what was trained: trunk logits (F16/Q8_0 weights vs float), the head's
    logits, the tokenizer, and greedy decoding with drafts equal to decoding without."""
    import strata
    from strata.demo import trunk as trunk_stage

    engine = strata.load(path)
    ids = held_data[:n].tolist()
    got = engine.logits(ids)
    with trunk_stage.dense_indexer():
        want = trunk(input_ids=torch.tensor([ids])).logits[0]
        h = trunk.model(input_ids=torch.tensor([ids])).last_hidden_state
        want_head = mtp(torch.tensor([ids[1:]]), h[:, :-1])[0]
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    model = engine.model
    with torch.inference_mode():
        _, hs = model(torch.tensor([ids]), model.new_cache(1), hidden=True)
        got_head, _ = model.mtp(torch.tensor([ids[1:]]), hs[:, :-1], model.mtp.new_cache(1))
    head_agree = (got_head[0].argmax(-1) == want_head.argmax(-1)).float().mean().item()
    print(f"check: strata.load logits vs the trained trunk: max |diff| {(got - want).abs().max().item():.3f}, "
          f"argmax agreement {agree:.1%}; MTP head: max |diff| {(got_head[0] - want_head).abs().max().item():.3f}, "
          f"argmax agreement {head_agree:.1%}")
    ok = agree > 0.95 and head_agree > 0.9
    text = tok.decode(ids)
    same = engine.tokenizer.encode(text) == tok.encode(text, add_special_tokens=False).ids
    print(f"check: engine tokenizer matches the trained one on held-out text: {same}")
    prompt = engine.tokenizer.encode("def read_config(path):\n")
    out = engine.generate(prompt, max_new_tokens=64, stop_at_eos=False)
    draft = engine.stats["draft"]
    engine.drafting = False
    plain = engine.generate(prompt, max_new_tokens=64, stop_at_eos=False)
    print(f"check: greedy with drafts equals greedy without: {out == plain}; acceptance "
          f"{draft['acceptance_rate']:.1%} ({draft['accepted']}/{draft['drafted']}, "
          f"{draft['tokens_per_round']:.2f} tokens per verify pass)")
    print("sample (greedy):\ndef read_config(path):\n" + engine.tokenizer.decode(out))
    return ok and same and out == plain
