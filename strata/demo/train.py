"""Train the bundled demo model: a small qwen3moe code-completion model on the Python standard library.

    python -m strata.demo.train --out strata/demo/strata-demo.gguf [--minutes M] [--seed S]

Everything it needs is on every machine that runs strata: the corpus is the running Python's
standard library sources (no download), the tokenizer is trained here with `tokenizers`, the model
is `strata.demo.trainable.TrainableMoE` (qwen3moe's math), and the result is written with
`strata.gguf.writer.write_gguf` and checked by loading it back with `strata.load`.

A run is reproducible on a given machine: the tokenizer, the initialisation and the data order
are seeded, and training stops after `--steps` optimizer steps. `--minutes` is a safety cap for slow
machines: the learning-rate schedule follows whichever of the two budgets is further along, so a
time-capped run still anneals, but then its step count (and result) depends on the machine's speed.
The defaults (800 steps of 2,048 tokens, one thread) took 27 minutes on a busy 2-core AVX2 box; the
shipped strata-demo.gguf is that run (its settings and losses are in its strata.demo.* metadata).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

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


# -- model ---------------------------------------------------------------------------------------------


def demo_config(vocab_size: int, context: int = 512):
    from strata.models.qwen3moe import Config
    from strata.models.rope import RopeConfig

    hidden, heads, head_dim = 128, 4, 32
    return Config(vocab_size=vocab_size, hidden_size=hidden, n_layers=8, n_heads=heads, n_kv_heads=2,
                  head_dim=head_dim, ffn_size=0, expert_ffn_size=96, n_experts=32, n_experts_used=2,
                  norm_topk_prob=True, rms_eps=1e-6, rope=RopeConfig(dim=head_dim, theta=10000.0),
                  context_length=context)


def export_tensors(model):
    """(name, tensor, ggml type): experts Q8_0, other matrices F16, norms and routers F32."""
    import gguf

    T = gguf.GGMLQuantizationType
    out = []
    for name, t in model.gguf_tensors():
        if "_exps." in name:
            qtype = T.Q8_0
        elif t.dim() == 1 or "ffn_gate_inp" in name:
            qtype = T.F32
        else:
            qtype = T.F16
        out.append((name, t.float(), qtype))
    return out


def gguf_float_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a GGUF file dequantized to float32, by name."""
    from strata.gguf.reader import GGUFFile
    from strata.gguf.source import GGUFSource

    source = GGUFSource(GGUFFile(path))
    return {name: source.get(name).dequantize(torch.float32) for name in source.names()}


def demo_metadata(args, steps: int, train_loss: float, held_out_loss: float) -> dict:
    """general.* and the settings that determine the result (not the command line, so a default
    run that reproduces the shipped file writes it byte for byte)."""
    python = sys.version.split()[0]
    return {
        "general.name": "strata-demo",
        "general.description": f"strata's demo model: a small qwen3moe trained by strata/demo/train.py "
                               f"on the Python {python} standard library sources",
        "strata.demo.python": python,
        "strata.demo.seed": args.seed,
        "strata.demo.steps": steps,
        "strata.demo.batch_tokens": args.batch_tokens,
        "strata.demo.lr": float(args.lr),
        "strata.demo.aux_coef": float(args.aux_coef),
        "strata.demo.train_tokens": steps * args.batch_tokens,
        "strata.demo.train_loss": train_loss,
        "strata.demo.held_out_loss": held_out_loss,
    }


# -- training ------------------------------------------------------------------------------------------


def batch(data: torch.Tensor, starts: torch.Tensor, seq: int) -> torch.Tensor:
    idx = starts[:, None] + torch.arange(seq + 1)
    return data[idx].long()


@torch.no_grad()
def evaluate(model, data: torch.Tensor, seq: int, max_windows: int) -> float:
    """Mean next-token loss (nats) over the first `max_windows` non-overlapping windows of `data`."""
    model.eval()
    n = min(max_windows, (len(data) - 1) // seq)
    total, count = 0.0, 0
    for w in range(0, n, 4):
        starts = torch.arange(w, min(w + 4, n)) * seq
        x = batch(data, starts, seq)
        logits = model(x[:, :-1])
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum").item()
        count += x[:, 1:].numel()
    model.train()
    return total / max(count, 1)


@torch.no_grad()
def expert_use(model, data: torch.Tensor, seq: int, windows: int = 8) -> list[list[float]]:
    """Per layer, the share of routed slots each expert got over held-out text."""
    model.eval()
    x = batch(data, torch.arange(min(windows, (len(data) - 1) // seq)) * seq, seq)
    _, routing = model(x[:, :-1], return_routing=True)
    model.train()
    out = []
    for _, ids in routing:
        counts = torch.bincount(ids.reshape(-1), minlength=model.c.n_experts).float()
        out.append((counts / counts.sum()).tolist())
    return out


def seq_len(progress: float, context: int) -> int:
    """Sequence-length warm-up: a quarter of training at context/4, a quarter at context/2, then the
    full context (attention is most of the cost of a step, and early training needs no long range)."""
    return context // 4 if progress < 0.25 else context // 2 if progress < 0.5 else context


def lr_at(progress: float, step: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m strata.demo.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(__file__).with_name("strata-demo.gguf"))
    p.add_argument("--minutes", type=float, default=60.0,
                   help="wall-clock cap on training for slow or busy machines (default 60)")
    p.add_argument("--steps", type=int, default=800, help="optimizer steps (default 800)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-tokens", type=int, default=2048, help="tokens per step")
    p.add_argument("--seq", type=int, default=512, help="the model's context: the longest training sequence")
    p.add_argument("--lr", type=float, default=4e-3)
    p.add_argument("--aux-coef", type=float, default=0.01, help="load-balancing loss weight")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.perf_counter()

    # corpus and tokenizer
    train_paths, held_paths = train_files(), held_out_files()
    texts = [t for p_ in train_paths if (t := read_source(p_)) is not None]
    print(f"corpus: {stdlib_root()}: {len(train_paths)} training files ({sum(map(len, texts)) / 1e6:.1f} M chars), "
          f"{len(held_paths)} held out", flush=True)
    tok = train_tokenizer(texts, args.vocab)
    tmeta = tokenizer_metadata(tok)
    train_data = encode_files(tok, train_paths)
    held_data = encode_files(tok, held_paths)
    print(f"tokenizer: {tok.get_vocab_size()} tokens; {len(train_data) / 1e6:.2f} M training tokens, "
          f"{len(held_data) / 1e3:.0f} k held-out tokens ({time.perf_counter() - t_start:.0f} s)", flush=True)

    # model
    from strata.demo.trainable import TrainableMoE, load_balance_loss

    c = demo_config(tok.get_vocab_size(), args.seq)
    model = TrainableMoE(c)
    model.init_weights(torch.Generator().manual_seed(args.seed))
    n_params = sum(p_.numel() for p_ in model.parameters())
    print(f"model: qwen3moe {c.n_layers} layers x {c.n_experts} experts (top-{c.n_experts_used}), hidden {c.hidden_size}, "
          f"expert ffn {c.expert_ffn_size}, heads {c.n_heads}/{c.n_kv_heads}x{c.head_dim}, ctx {c.context_length}; "
          f"{n_params / 1e6:.1f} M parameters", flush=True)
    decay = [p_ for p_ in model.parameters() if p_.dim() >= 2]
    no_decay = [p_ for p_ in model.parameters() if p_.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    data_gen = torch.Generator().manual_seed(args.seed + 1)
    budget = args.minutes * 60
    warmup = max(1, min(30, args.steps // 10))
    t_train = time.perf_counter()
    step, progress, ema = 0, 0.0, None
    stopped_by = "steps"
    while step < args.steps:
        elapsed = time.perf_counter() - t_train
        progress = max(step / args.steps, elapsed / budget)
        if progress >= 1.0:
            stopped_by = "time"
            break
        lr = lr_at(progress, step, args.lr, warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        seq = seq_len(progress, args.seq)
        starts = torch.randint(0, len(train_data) - seq - 1, (args.batch_tokens // seq,), generator=data_gen)
        x = batch(train_data, starts, seq)
        logits, routing = model(x[:, :-1], return_routing=True)
        ce = F.cross_entropy(logits.reshape(-1, c.vocab_size), x[:, 1:].reshape(-1))
        aux = load_balance_loss(routing, c.n_experts)
        opt.zero_grad(set_to_none=True)
        (ce + args.aux_coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        ema = ce.item() if ema is None else 0.95 * ema + 0.05 * ce.item()
        if step % 10 == 0 or step == 1:
            elapsed = time.perf_counter() - t_train
            print(f"step {step:4d}  seq {seq:3d}  loss {ce.item():.3f} (avg {ema:.3f})  balance {aux.item():.2f}  "
                  f"lr {lr:.2e}  {step * args.batch_tokens / elapsed:.0f} tok/s  {elapsed / 60:.1f} min", flush=True)
    train_s = time.perf_counter() - t_train
    held_loss = evaluate(model, held_data, args.seq, max_windows=64)
    print(f"trained {step} steps ({step * args.batch_tokens / 1e6:.2f} M tokens) in {train_s / 60:.1f} min, "
          f"stopped by {stopped_by}; final train loss {ema:.3f}; held-out loss {held_loss:.3f} "
          f"(perplexity {math.exp(held_loss):.1f})", flush=True)
    use = expert_use(model, held_data, args.seq)
    busiest = [max(u) for u in use]
    active = [sum(x > 0.01 for x in u) for u in use]
    print("expert use on held-out text: busiest expert's share per layer "
          + " ".join(f"{b:.2f}" for b in busiest) + "; experts with >1% share " + " ".join(map(str, active)))

    # export
    from strata.models.qwen3moe import gguf_metadata
    from strata.gguf.writer import write_gguf

    meta = demo_metadata(args, step, float(ema), float(held_loss)) | gguf_metadata(c) | tmeta
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_gguf(args.out, "qwen3moe", meta, export_tensors(model))
    size = args.out.stat().st_size
    print(f"wrote {args.out} ({size / 1e6:.1f} MB)", flush=True)

    ok = verify(args.out, model, tok, held_data)
    print(f"total {(time.perf_counter() - t_start) / 60:.1f} min")
    return 0 if ok else 1


def verify(path: Path, model, tok, held_data: torch.Tensor, n: int = 128) -> bool:
    """Load the file with `strata.load` and compare it with the trainable model, tightly (same
    dequantized weights) and loosely (the float weights it was trained to)."""
    import copy

    import strata

    engine = strata.load(path)
    ids = held_data[:n].tolist()
    got = engine.logits(ids)
    exact = copy.deepcopy(model).eval()
    exact.load_gguf_tensors(gguf_float_tensors(path))
    with torch.no_grad():
        want_q = exact(torch.tensor([ids]))[0]
        want_f = model.eval()(torch.tensor([ids]))[0]
    tight = (got - want_q).abs().max().item()
    loose = (got - want_f).abs().max().item()
    agree = (got.argmax(-1) == want_f.argmax(-1)).float().mean().item()
    ok = tight < 2e-3  # float32 summation order (strata's kernels vs torch) is all that may differ
    print(f"check: strata.load logits vs trainable model on the file's weights: max |diff| {tight:.2e} "
          f"({'ok' if ok else 'MISMATCH'}); vs the float weights: max |diff| {loose:.3f}, "
          f"argmax agreement {agree:.1%}")
    if engine.tokenizer is not None:
        text = tok.decode(ids)
        same = engine.tokenizer.encode(text) == tok.encode(text, add_special_tokens=False).ids
        print(f"check: engine tokenizer matches the trained one on held-out text: {same}")
        ok &= same
        prompt = "def read_config(path):\n"
        out = engine.generate(engine.tokenizer.encode(prompt), max_new_tokens=48)
        print("sample (greedy):\n" + prompt + engine.tokenizer.decode(out))
    return ok


if __name__ == "__main__":
    raise SystemExit(main())
