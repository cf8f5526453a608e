"""Train the bundled demo model: a tiny qwen4exp code-completion model on the Python standard library.

    python -m strata.demo.train --out strata/demo/strata-demo.gguf [--minutes M] [--seed S]

Everything it needs is on every machine that runs strata: the corpus is the running Python's
standard library sources (no download), the tokenizer is trained here with `tokenizers`. Two
stages:

  1. the trunk (`strata.demo.trunk`): transformers' `Qwen4ExpForCausalLM` (Gated DeltaNet, QSA,
     32 experts top-2 + a shared expert, 4 hyper-connection streams, an n-gram table on layer 1),
     trained on next-token loss plus a load-balancing loss;
  2. the MTP draft layer (`strata.demo.trainable.TrainableMTP`), trained with the trunk frozen to
     predict the trunk's own next-token distribution one position ahead, so its drafts get accepted.

The result is converted with Strata's HF name table (`strata.gguf.convert`), written with
`strata.gguf.writer.write_gguf` and checked by loading it back with `strata.load`: logits against
transformers, drafts against the trainable MTP layer.

A run is reproducible: the tokenizer, the initialisation and the data order are seeded, training
runs in one thread (`--threads 1`) and stops after `--steps` optimizer steps, so the same command
gives the same file on the same software (about 18 min on a 2-core machine). `--minutes` is an
optional cap for slow machines: the learning-rate schedule then follows whichever of the two budgets
is further along, so a capped run still anneals, but its step count (and result) depends on the
machine's speed.
`--save-trunk DIR` / `--trunk-from DIR` split the two stages (the shipped file was made that way:
the same code, the same result). The shipped strata-demo.gguf's settings and losses are in its
strata.demo.* metadata.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sysconfig
import time
from pathlib import Path

import torch

EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, "<|im_start|>", "<|im_end|>"]
# The pre-tokenizer the vocabulary is trained with: Qwen2's regex split (+ NFC) then GPT-2 byte
# spelling, which `strata.formats.tokenizer` rebuilds from tokenizer.ggml.pre = "qwen2".
PRE = "qwen2"
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Top-level stdlib directories that are not ordinary library code: tests, the IDE, demos, vendored
# wheels, generated tables (encodings, pydoc topics), build configuration.
SKIP_DIRS = frozenset({
    "site-packages", "dist-packages", "test", "tests", "idlelib", "turtledemo", "lib2to3", "ensurepip",
    "pydoc_data", "encodings", "__pycache__", "__phello__", "lib-dynload",
})  # fmt: skip
HELD_OUT_EVERY = 50  # files whose index in the sorted corpus is a multiple of this are held out


# -- corpus --------------------------------------------------------------------------------------------


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path | None = None) -> list[Path]:
    """The standard library's library `.py` files, sorted by their path relative to `root`."""
    root = root or stdlib_root()
    out = []
    for here, dirs, files in os.walk(root):
        rel = Path(here).relative_to(root)
        dirs[:] = [d for d in dirs if not _skip_dir(d)]  # prune: never walk site-packages or tests
        out += [rel / f for f in files if f.endswith(".py") and not f.startswith(("test_", "_sysconfigdata"))]
    return [root / r for r in sorted(out, key=lambda r: r.as_posix())]


def _skip_dir(name: str) -> bool:
    return name in SKIP_DIRS or name.startswith(("test", "config-"))


def held_out_files(root: Path | None = None) -> list[Path]:
    """The files never trained on: every `HELD_OUT_EVERY`-th file of `corpus_files()` (index 0, 50, ...)."""
    return [p for i, p in enumerate(corpus_files(root)) if i % HELD_OUT_EVERY == 0]


def train_files(root: Path | None = None) -> list[Path]:
    return [p for i, p in enumerate(corpus_files(root)) if i % HELD_OUT_EVERY != 0]


def read_source(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def held_out_text(n_chars: int | None = None) -> str:
    """The held-out files joined by EOS, optionally cut to `n_chars` characters."""
    text = EOS.join(t for p in held_out_files() if (t := read_source(p)) is not None)
    return text if n_chars is None else text[:n_chars]


def held_out_tokens(encode, n_tokens: int = 2000) -> list[int]:
    """The first `n_tokens` ids of the held-out text under `encode` (text -> ids), e.g. an engine's
    `tokenizer.encode`; what the cache benchmarks replay."""
    ids: list[int] = []
    for path in held_out_files():
        text = read_source(path)
        if text is None:
            continue
        ids += encode(text)
        if len(ids) >= n_tokens:
            break
    return ids[:n_tokens]


# -- tokenizer -----------------------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int = 4096):
    """Byte-level BPE with the qwen2 split; special tokens get ids 0, 1, 2. Deterministic."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def tokenizer_metadata(tok) -> dict:
    """llama.cpp's gpt2-style tokenizer keys for a trained byte-level BPE."""
    spec = json.loads(tok.to_str())
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = [""] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    special = set(SPECIAL_TOKENS)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    eos = vocab[EOS]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": PRE,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if t in special else 1 for t in tokens],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": eos,
        "tokenizer.ggml.eos_token_id": eos,
        "tokenizer.ggml.padding_token_id": eos,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.chat_template": CHATML,
    }


def encode_files(tok, paths: list[Path]) -> torch.Tensor:
    """Every file's ids, each followed by EOS, as one long int32 stream."""
    texts = [t for p in paths if (t := read_source(p)) is not None]
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids += enc.ids
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)




# -- stages --------------------------------------------------------------------------------------------


def prepare_data(args, trunk_from: Path | None):
    """(tokenizer, training ids, held-out ids); the tokenizer is the saved trunk's when resuming."""
    from tokenizers import Tokenizer

    train_paths, held_paths = train_files(), held_out_files()
    texts = [t for p_ in train_paths if (t := read_source(p_)) is not None]
    print(f"corpus: {stdlib_root()}: {len(train_paths)} training files ({sum(map(len, texts)) / 1e6:.1f} M chars), "
          f"{len(held_paths)} held out", flush=True)
    if trunk_from is not None:
        tok = Tokenizer.from_file(str(trunk_from / "tokenizer.json"))
    else:
        tok = train_tokenizer(texts, args.vocab)
    if tok.token_to_id(EOS) != 0:
        raise SystemExit(f"the tokenizer gave {EOS} id {tok.token_to_id(EOS)}, not 0")
    return tok, encode_files(tok, train_paths), encode_files(tok, held_paths)


def train_trunk(args, tok, train_data: torch.Tensor, held_data: torch.Tensor):
    from strata.demo import trunk

    config = trunk.demo_hf_config(tok.get_vocab_size(), args.context)
    model = trunk.new_trunk(config, args.seed)
    n_params = sum(p_.numel() for p_ in model.parameters())
    print(f"trunk: qwen4exp {config.num_hidden_layers} layers ({', '.join(sorted(set(config.layer_types)))}) x "
          f"{config.num_experts} experts (top-{config.num_experts_per_tok}) + shared, hidden {config.hidden_size} x "
          f"{config.hc_count} streams, n-gram table on layer 1; {n_params / 1e6:.1f} M parameters", flush=True)
    model.train()
    t0 = time.perf_counter()
    with trunk.dense_indexer():
        steps, ema, by = trunk.train_loop(trunk.trunk_step_loss(model, args.aux_coef), model.parameters(),
                                          train_data, steps=args.steps, minutes=args.minutes, seq=args.seq,
                                          batch_tokens=args.batch_tokens, lr=args.lr, seed=args.seed + 1,
                                          label="trunk")
        held = trunk.evaluate(model, held_data, args.seq, max_windows=64)
    minutes = (time.perf_counter() - t0) / 60
    print(f"trunk: {steps} steps ({steps * args.batch_tokens / 1e6:.2f} M tokens) in {minutes:.1f} min, stopped by "
          f"{by}; train loss {ema:.3f}; held-out loss {held:.3f} (perplexity {math.exp(held):.1f})", flush=True)
    return model.eval(), {"trunk_steps": steps, "trunk_train_loss": float(ema), "held_out_loss": float(held),
                          "trunk_minutes": round(minutes, 1)}


def save_trunk(model, tok, results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "trunk_results.json").write_text(json.dumps(results, indent=1))
    print(f"saved the trunk to {out}", flush=True)


def load_trunk(path: Path):
    from transformers import Qwen4ExpForCausalLM

    model = Qwen4ExpForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, json.loads((path / "trunk_results.json").read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m strata.demo.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(__file__).with_name("strata-demo.gguf"))
    p.add_argument("--minutes", type=float, default=math.inf,
                   help="optional wall-clock cap on the trunk's training (default none: a capped run depends "
                        "on the machine's speed)")
    p.add_argument("--steps", type=int, default=500, help="the trunk's optimizer steps (default 500)")
    p.add_argument("--mtp-steps", type=int, default=170, help="the MTP layer's optimizer steps (default 170)")
    p.add_argument("--mtp-minutes", type=float, default=math.inf,
                   help="optional wall-clock cap on the MTP layer's training (default none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-tokens", type=int, default=2048, help="tokens per step")
    p.add_argument("--seq", type=int, default=256, help="training sequence length (at most the QSA budget)")
    p.add_argument("--context", type=int, default=4096, help="the context length the file declares")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--mtp-lr", type=float, default=3e-3)
    p.add_argument("--aux-coef", type=float, default=0.01, help="load-balancing loss weight")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--save-trunk", type=Path, help="save the trained trunk (HF checkpoint + tokenizer) here")
    p.add_argument("--trunk-only", action="store_true", help="stop after the trunk (with --save-trunk)")
    p.add_argument("--trunk-from", type=Path, help="skip stage 1: the trunk saved by --save-trunk")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    tok, train_data, held_data = prepare_data(args, args.trunk_from)
    print(f"tokenizer: {tok.get_vocab_size()} tokens; {len(train_data) / 1e6:.2f} M training tokens, "
          f"{len(held_data) / 1e3:.0f} k held-out tokens ({time.perf_counter() - t_start:.0f} s)", flush=True)
    if args.trunk_from is not None:
        model, results = load_trunk(args.trunk_from)
    else:
        model, results = train_trunk(args, tok, train_data, held_data)
        if args.save_trunk is not None:
            save_trunk(model, tok, results, args.save_trunk)
    if args.trunk_only:
        return 0
    from strata.demo.export import export_demo
    from strata.demo.trainable import train_mtp

    mtp, mtp_results = train_mtp(model, train_data, held_data, args)
    ok = export_demo(args.out, model, mtp, tok, tokenizer_metadata(tok), args, results | mtp_results, held_data)
    print(f"total {(time.perf_counter() - t_start) / 60:.1f} min")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
