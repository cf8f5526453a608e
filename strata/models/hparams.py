"""Hyper-parameters every decoder architecture reads the same way, from GGUF or HF config.

Architecture files add their own fields (experts, rope style, recurrent layers) on top.
"""

from __future__ import annotations


def decoder_from_gguf(meta: dict, arch: str, default_eps: float = 1e-5, default_ctx: int = 4096) -> dict:
    hidden = meta[f"{arch}.embedding_length"]
    n_heads = meta[f"{arch}.attention.head_count"]
    return dict(vocab_size=meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"]),
                hidden_size=hidden, n_layers=meta[f"{arch}.block_count"], n_heads=n_heads,
                n_kv_heads=meta.get(f"{arch}.attention.head_count_kv", n_heads),
                head_dim=meta.get(f"{arch}.attention.key_length", hidden // n_heads),
                rms_eps=meta.get(f"{arch}.attention.layer_norm_rms_epsilon", default_eps),
                context_length=meta.get(f"{arch}.context_length", default_ctx))


def decoder_from_hf(cfg: dict, default_eps: float = 1e-5, default_ctx: int = 4096) -> dict:
    hidden, n_heads = cfg["hidden_size"], cfg["num_attention_heads"]
    return dict(vocab_size=cfg["vocab_size"], hidden_size=hidden, n_layers=cfg["num_hidden_layers"],
                n_heads=n_heads, n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
                head_dim=cfg.get("head_dim") or hidden // n_heads,
                rms_eps=cfg.get("rms_norm_eps", default_eps),
                context_length=cfg.get("max_position_embeddings", default_ctx))


def gated_deltanet_from_gguf(meta: dict, arch: str) -> dict:
    """The Gated DeltaNet fields qwen3next and qwen4exp share (llama.cpp's `ssm.*` keys)."""
    v_heads = meta[f"{arch}.ssm.time_step_rank"]
    return dict(conv_kernel=meta[f"{arch}.ssm.conv_kernel"], linear_k_heads=meta[f"{arch}.ssm.group_count"],
                linear_v_heads=v_heads, linear_k_dim=meta[f"{arch}.ssm.state_size"],
                linear_v_dim=meta[f"{arch}.ssm.inner_size"] // v_heads)


def gated_deltanet_from_hf(cfg: dict) -> dict:
    return dict(conv_kernel=cfg.get("linear_conv_kernel_dim", 4), linear_k_heads=cfg["linear_num_key_heads"],
                linear_v_heads=cfg["linear_num_value_heads"], linear_k_dim=cfg["linear_key_head_dim"],
                linear_v_dim=cfg["linear_value_head_dim"])
