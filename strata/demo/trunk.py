"""The demo's trunk: a tiny qwen4exp trained through transformers' own `Qwen4ExpForCausalLM`.

Training the reference class (rather than a copy of the math written here) means the file
Strata exports is checked against the same code its architecture tests compare with. Two
settings keep that class practical on a CPU:

  * sequences no longer than the QSA budget: the indexer then keeps every block (the attention
    is exactly dense), so `dense_indexer` returns the causal mask instead of looping over every
    query in Python. Inference past the budget prunes as the model specifies; the indexer's
    weights get no gradient in transformers either (its choice is a top-k).
  * one n-gram shard (`split_ngram_parts=1`): the table is one small embedding.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

EOS_ID = 0  # <|endoftext|>: the tokenizer's first special token; it resets the n-gram context


def demo_hf_config(vocab_size: int, context: int = 4096):
    """8 layers (3 Gated DeltaNet + 1 QSA, twice), 32 experts top-2 + a shared expert, 4 streams,
    an n-gram table on layer index 1 (4 hash heads of 32 values, ~65 k rows), one MTP layer."""
    from transformers import Qwen4ExpTextConfig

    return Qwen4ExpTextConfig(
        vocab_size=vocab_size, hidden_size=128, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
        moe_intermediate_size=96, shared_expert_intermediate_size=64, num_experts=32, num_experts_per_tok=2,
        norm_topk_prob=True, hc_count=4, hc_lowrank=32, ple_layer_ids=[2], ngram_size=3, heads_per_ngram=2,
        ngram_vocab_size_base=16384, split_ngram_parts=1, indexer_n_heads=2, indexer_kv_heads=1,
        indexer_head_dim=32, indexer_budget=256, indexer_compress_ratio=4, eos_token_id=EOS_ID,
        pad_token_id=EOS_ID, bos_token_id=EOS_ID, output_gate_type="sigmoid", max_position_embeddings=context,
        rms_norm_eps=1e-6, tie_word_embeddings=False, mtp_num_hidden_layers=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})


def _dense_indexer(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
    n_keys = attention_mask.shape[-1]
    if n_keys > self.token_budget + self.compress_ratio - 1:
        raise ValueError(f"{n_keys} keys exceed the QSA budget {self.token_budget}: training is dense only")
    return attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0


@contextlib.contextmanager
def dense_indexer():
    """Within the budget the indexer keeps everything: skip its per-query Python loop."""
    from transformers.models.qwen4_exp import modeling_qwen4_exp as hf

    original = hf.Qwen4ExpTextQSAIndexer.forward
    hf.Qwen4ExpTextQSAIndexer.forward = _dense_indexer
    try:
        yield
    finally:
        hf.Qwen4ExpTextQSAIndexer.forward = original


def new_trunk(config, seed: int):
    """transformers' own initialisation, seeded (norms at their zero-centred 0, PLE conv at 0)."""
    from transformers import Qwen4ExpForCausalLM

    torch.manual_seed(seed)
    return Qwen4ExpForCausalLM(config)


def lr_at(progress: float, step: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def batch(data: torch.Tensor, starts: torch.Tensor, seq: int) -> torch.Tensor:
    idx = starts[:, None] + torch.arange(seq + 1)
    return data[idx].long()


def optimizer(params, lr: float) -> torch.optim.AdamW:
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8)


def train_loop(step_loss, params, data: torch.Tensor, *, steps: int, minutes: float, seq: int,
               batch_tokens: int, lr: float, seed: int, label: str, log_every: int = 10):
    """AdamW with warm-up and cosine decay; `step_loss(x (B, seq+1)) -> (loss, main, extra)`.
    The schedule follows whichever budget (steps or minutes) is further along. -> (steps, ema, by)."""
    import time

    params = [p for p in params if p.requires_grad]
    opt = optimizer(params, lr)
    gen = torch.Generator().manual_seed(seed)
    warmup = max(1, min(30, steps // 10))
    t0 = time.perf_counter()
    step, ema, stopped_by = 0, None, "steps"
    while step < steps:
        progress = max(step / steps, (time.perf_counter() - t0) / (minutes * 60))
        if progress >= 1.0:
            stopped_by = "time"
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(progress, step, lr, warmup)
        starts = torch.randint(0, len(data) - seq - 1, (batch_tokens // seq,), generator=gen)
        loss, main, extra = step_loss(batch(data, starts, seq))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        ema = main if ema is None else 0.95 * ema + 0.05 * main
        if step % log_every == 0 or step == 1:
            elapsed = time.perf_counter() - t0
            print(f"{label} step {step:4d}  loss {main:.3f} (avg {ema:.3f})  {extra}  "
                  f"lr {opt.param_groups[0]['lr']:.2e}  {step * batch_tokens / elapsed:.0f} tok/s  "
                  f"{elapsed / 60:.1f} min", flush=True)
    return step, ema, stopped_by


def trunk_step_loss(model, aux_coef: float):
    def step_loss(x):
        out = model(input_ids=x[:, :-1], use_cache=False, output_router_logits=True)
        ce = F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), x[:, 1:].reshape(-1))
        return ce + aux_coef * out.aux_loss, ce.item(), f"balance {out.aux_loss.item():.2f}"
    return step_loss


@torch.no_grad()
def evaluate(model, data: torch.Tensor, seq: int, max_windows: int) -> float:
    """Mean next-token loss (nats) over the first `max_windows` non-overlapping windows of `data`."""
    model.eval()
    n = min(max_windows, (len(data) - 1) // seq)
    total, count = 0.0, 0
    for w in range(0, n, 8):
        x = batch(data, torch.arange(w, min(w + 8, n)) * seq, seq)
        logits = model(input_ids=x[:, :-1], use_cache=False).logits
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum").item()
        count += x[:, 1:].numel()
    model.train()
    return total / max(count, 1)
