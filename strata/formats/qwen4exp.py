"""qwen4exp's format: its hyper-parameters (`Config`) read from an HF config.json or GGUF metadata,
the GGUF metadata writer, the HF -> GGUF tensor names and the HF layout surgery (`sanitize_hf`).
The model itself is `strata.models.qwen4exp`.

GGUF layout, as llama.cpp's converter writes arch `qwen4exp` (src/models/qwen4exp.cpp and
conversion/qwen4exp.py upstream); names `blk.N.` + ...:

    hc_attn_{norm,down,up,inject}, hc_ffn_{norm,down,up,inject}   per block; norm stored as 1 + w
    output_hc_{norm,down,up}                                       the final mixer (no output_norm)
    attn_qkv, attn_gate, ssm_beta, ssm_alpha, ssm_conv1d (C, K), ssm_dt.bias, ssm_a (= -exp(A_log)),
    ssm_norm (as is), ssm_out                                      Gated DeltaNet, value heads tiled:
                                                                   GGUF head r*n_k+k is HF head k*ratio+r
    attn_q ([q | gate] per head), attn_k, attn_v, attn_output, attn_q_norm, attn_k_norm (1 + w)
    indexer.q_proj, indexer.k_proj (HF's index_qk_proj split), indexer.q_norm, indexer.k_norm (1 + w)
    ple_key, ple_value, ple_norm_{key,query,conv} (1 + w), ple_conv1d (hc*hidden, K)
    per_layer_token_embd    the n-gram table (no `blk.` prefix): HF's shards joined along rows
    ffn_gate_inp, ffn_{gate,up,down}_exps, ffn_{gate,up,down}_shexp, ffn_gate_inp_shexp (1, hidden)
    blk.{n_layers}.*        the MTP block (llama.cpp's NextN): a trunk-shaped block plus
                            nextn.eh_proj ([fc_embedding | fc_hidden]), nextn.enorm, nextn.hnorm,
                            nextn.hc_head_{norm,down,up}; the draft head (`qwen4exp_mtp`)

Metadata (`qwen4exp.` + ...): the shared decoder keys (block_count counts the MTP block),
`rope.dimension_count` (rotated dims), `rope.dimension_sections`, `expert_feed_forward_length`,
`expert_shared_feed_forward_length`, `expert_weights_norm`, `full_attention_interval`, `ssm.*` as
qwen3next, `hyper_connection.count`, `hyper_connection.low_rank`, `attention.indexer.head_count`,
`attention.indexer.key_length`, `attention.indexer.top_k` (the token budget),
`attention.compress_ratios` (per block, 0 = dense), `ple.layers` (0-based), `ple.ngram_size`,
`ple.heads_per_ngram`, `ple.conv_kernel`, `ple.eos_token_id`, `embedding_length_per_layer_input`
(one head's row width), `ple.layer_multipliers`, `ple.head_offsets`, `ple.head_vocab_sizes`
(uint64 arrays), `nextn_predict_layers`. One key is Strata's own: `ssm.output_gate_type`
("sigmoid" or "silu"; absent means sigmoid, which is what llama.cpp hard-codes).

Like llama.cpp, a GGUF holds at most one PLE layer (its table has one global name). The EOS that
resets n-grams is transformers' choice, the first of a list of eos ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from strata.errors import BadModelFile, StrataError
from strata.formats.hparams import (RopeConfig, decoder_from_gguf, decoder_from_hf, gated_deltanet_from_gguf,
                                    gated_deltanet_from_hf)
from strata.formats.ngram_hash import TABLE, NgramHash, padded_rows
from strata.gguf.writer import decoder_metadata

ARCH = "qwen4exp"
HF_MODEL_TYPES = ("qwen4_exp", "qwen4_exp_text")


@dataclass(frozen=True)
class Config:
    vocab_size: int
    hidden_size: int
    n_layers: int  # the trunk; the MTP blocks come after
    n_heads: int
    n_kv_heads: int
    head_dim: int
    expert_ffn_size: int
    shared_ffn_size: int
    n_experts: int
    n_experts_used: int
    norm_topk_prob: bool
    rms_eps: float
    rope: RopeConfig  # dim = rotated dims per head
    rope_sections: tuple[int, ...]
    context_length: int
    recurrent: tuple[bool, ...]
    conv_kernel: int
    linear_k_heads: int
    linear_v_heads: int
    linear_k_dim: int
    linear_v_dim: int
    gate_act: str  # the Gated DeltaNet's output gate: sigmoid | silu
    hc_count: int
    hc_rank: int
    indexer_heads: int
    indexer_dim: int
    indexer_budget: int
    compress_ratios: tuple[int, ...]  # per trunk layer; 0 = dense (linear layers, or no indexer)
    ple_layers: tuple[int, ...] = ()  # 0-based
    ple_conv_kernel: int = 4
    ple_row_dim: int = 0  # one hash head's row width
    ple_hash: NgramHash | None = None
    nextn_layers: int = 0
    ple_rows: int | None = field(default=None, compare=False)  # the table's exact size, when the config fixes it

    @property
    def ple_embed_dim(self) -> int:
        return self.ple_row_dim * self.ple_hash.n_heads if self.ple_hash else 0

    @classmethod
    def from_hf(cls, cfg: dict) -> "Config":
        base = decoder_from_hf(cfg, default_eps=1e-6, default_ctx=32768)
        hidden, head_dim, n_layers = base["hidden_size"], base["head_dim"], base["n_layers"]
        types = cfg.get("layer_types") or ["linear_attention" if (i + 1) % cfg.get("full_attention_interval", 4)
                                           else "indexed_attention" for i in range(n_layers)]
        rope_params = cfg.get("rope_parameters") or {}
        partial = rope_params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        sections = list(rope_params.get("mrope_section") or [11, 11, 10])
        ratio = cfg.get("indexer_compress_ratio") if cfg.get("indexer_n_heads") else None
        recurrent = tuple(t == "linear_attention" for t in types)
        ple = tuple(i - 1 for i in sorted(set(cfg.get("ple_layer_ids") or [])))
        if len(ple) > 1:
            raise StrataError(f"PLE on layers {[i + 1 for i in ple]}: only one PLE layer is supported",
                              "llama.cpp's GGUF layout holds one n-gram table, and so does Strata")
        ple_hash = NgramHash.from_config(cfg) if ple else None
        row_dim = (cfg.get("ple_embed_dim") or hidden) // ple_hash.n_heads if ple else 0
        expected = padded_rows(ple_hash, cfg.get("make_ngram_vocab_size_divisible_by", 128)) if ple else None
        return cls(**base, **gated_deltanet_from_hf(cfg), expert_ffn_size=cfg["moe_intermediate_size"],
                   shared_ffn_size=cfg.get("shared_expert_intermediate_size", 0),
                   n_experts=cfg["num_experts"], n_experts_used=cfg["num_experts_per_tok"],
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                   rope=RopeConfig.from_hf(cfg, int(head_dim * partial)),
                   rope_sections=tuple((sections + [0, 0, 0, 0])[:4]), recurrent=recurrent,
                   gate_act=cfg.get("output_gate_type") or cfg.get("hidden_act", "silu"),
                   hc_count=cfg.get("hc_count", 4), hc_rank=cfg.get("hc_lowrank", 320),
                   indexer_heads=cfg.get("indexer_n_heads") or 0, indexer_dim=cfg.get("indexer_head_dim") or 0,
                   indexer_budget=cfg.get("indexer_budget") or 0,
                   compress_ratios=tuple(0 if rec or not ratio else ratio for rec in recurrent),
                   ple_layers=ple, ple_conv_kernel=cfg.get("ple_conv_kernel_size", 4), ple_row_dim=row_dim,
                   ple_hash=ple_hash, nextn_layers=cfg.get("mtp_num_hidden_layers", 0) or 0, ple_rows=expected)

    @classmethod
    def from_gguf(cls, meta: dict) -> "Config":
        a = ARCH
        base = decoder_from_gguf(meta, a, default_eps=1e-6, default_ctx=32768)
        nextn = meta.get(f"{a}.nextn_predict_layers", 0)
        n_layers = base["n_layers"] = base["n_layers"] - nextn  # llama.cpp counts the MTP block
        if f"{a}.attention.recurrent_layers" in meta:
            recurrent = tuple(bool(x) for x in meta[f"{a}.attention.recurrent_layers"][:n_layers])
        else:
            interval = meta.get(f"{a}.full_attention_interval", 4)
            recurrent = tuple((i + 1) % interval != 0 for i in range(n_layers))
        ratios = meta.get(f"{a}.attention.compress_ratios", 0)
        ratios = list(ratios) if isinstance(ratios, list) else [ratios] * n_layers
        ratios = tuple(0 if recurrent[i] else int(ratios[i]) for i in range(n_layers))
        indexed = any(ratios)
        ple = tuple(int(i) for i in meta.get(f"{a}.ple.layers", []))
        if len(ple) > 1:
            raise BadModelFile(f"{a}.ple.layers lists {len(ple)} layers, but only one PLE layer is supported")
        return cls(**base, **gated_deltanet_from_gguf(meta, a), expert_ffn_size=meta[f"{a}.expert_feed_forward_length"],
                   shared_ffn_size=meta.get(f"{a}.expert_shared_feed_forward_length", 0),
                   n_experts=meta[f"{a}.expert_count"], n_experts_used=meta[f"{a}.expert_used_count"],
                   norm_topk_prob=bool(meta.get(f"{a}.expert_weights_norm", True)),
                   rope=RopeConfig.from_gguf(meta, a, meta.get(f"{a}.rope.dimension_count", base["head_dim"]),
                                             interleaved=False),
                   rope_sections=tuple(meta.get(f"{a}.rope.dimension_sections", [11, 11, 10, 0])),
                   recurrent=recurrent, gate_act=meta.get(f"{a}.ssm.output_gate_type", "sigmoid"),
                   hc_count=meta[f"{a}.hyper_connection.count"], hc_rank=meta[f"{a}.hyper_connection.low_rank"],
                   indexer_heads=meta[f"{a}.attention.indexer.head_count"] if indexed else 0,
                   indexer_dim=meta[f"{a}.attention.indexer.key_length"] if indexed else 0,
                   indexer_budget=meta[f"{a}.attention.indexer.top_k"] if indexed else 0,
                   compress_ratios=ratios, ple_layers=ple,
                   ple_conv_kernel=meta[f"{a}.ple.conv_kernel"] if ple else 4,
                   ple_row_dim=meta[f"{a}.embedding_length_per_layer_input"] if ple else 0,
                   ple_hash=NgramHash.from_gguf(meta, a) if ple else None, nextn_layers=nextn)


def gguf_metadata(c: Config) -> dict:
    interval = next((n for n in range(1, c.n_layers + 2)
                     if all(rec == ((i + 1) % n != 0) for i, rec in enumerate(c.recurrent))), None)
    extra = {"expert_feed_forward_length": c.expert_ffn_size,
             "expert_shared_feed_forward_length": c.shared_ffn_size, "expert_count": c.n_experts,
             "expert_used_count": c.n_experts_used, "expert_weights_norm": c.norm_topk_prob,
             "rope.dimension_sections": list(c.rope_sections),
             "ssm.conv_kernel": c.conv_kernel, "ssm.state_size": c.linear_k_dim,
             "ssm.group_count": c.linear_k_heads, "ssm.time_step_rank": c.linear_v_heads,
             "ssm.inner_size": c.linear_v_heads * c.linear_v_dim, "ssm.output_gate_type": c.gate_act,
             "hyper_connection.count": c.hc_count, "hyper_connection.low_rank": c.hc_rank}
    if interval is not None:
        extra["full_attention_interval"] = interval
    else:  # llama.cpp reads an explicit per-layer list when the pattern is not an interval
        extra["attention.recurrent_layers"] = [bool(r) for r in c.recurrent] + [False] * c.nextn_layers
    if any(c.compress_ratios):
        extra.update({"attention.indexer.head_count": c.indexer_heads, "attention.indexer.key_length": c.indexer_dim,
                      "attention.indexer.top_k": c.indexer_budget,
                      "attention.compress_ratios": list(c.compress_ratios) + [0] * c.nextn_layers})
    if c.ple_layers:
        h = c.ple_hash
        extra.update({"ple.layers": list(c.ple_layers), "ple.ngram_size": h.ngram_size,
                      "ple.heads_per_ngram": h.heads_per_ngram, "ple.conv_kernel": c.ple_conv_kernel,
                      "ple.eos_token_id": h.eos, "embedding_length_per_layer_input": c.ple_row_dim,
                      "ple.layer_multipliers": np.array(h.multipliers, dtype=np.uint64),
                      "ple.head_offsets": np.array(h.offsets, dtype=np.uint64),
                      "ple.head_vocab_sizes": np.array(h.vocab_sizes, dtype=np.uint64)})
    if c.nextn_layers:
        extra["nextn_predict_layers"] = c.nextn_layers
    meta = decoder_metadata(ARCH, c, **extra)
    meta[f"{ARCH}.block_count"] = c.n_layers + c.nextn_layers
    return meta


# -- Hugging Face names -------------------------------------------------------------------------

_LAYER = r"(?:model\.(?:language_model\.)?layers\.(?P<i>\d+)|mtp\.layers\.(?P<j>\d+))"
_TOP = r"model\.(?:language_model\.)?"


def _block(suffix: str):
    """A template for a per-block tensor; MTP layer j becomes block n_layers + j."""
    def name(groups: dict, c: Config) -> str:
        i = int(groups["i"]) if groups.get("i") is not None else c.n_layers + int(groups["j"])
        return f"blk.{i}.{suffix}"
    return name


def _mtp(suffix: str):
    return lambda groups, c: f"blk.{c.n_layers}.{suffix}"


_PER_BLOCK = [
    (r"attn_hyper_connection\.hc_norm\.weight", "hc_attn_norm.weight"),
    (r"attn_hyper_connection\.input_mix_weight_down\.weight", "hc_attn_down.weight"),
    (r"attn_hyper_connection\.input_mix_weight_up\.weight", "hc_attn_up.weight"),
    (r"attn_hyper_connection\.block_inject_weight\.weight", "hc_attn_inject.weight"),
    (r"mlp_hyper_connection\.hc_norm\.weight", "hc_ffn_norm.weight"),
    (r"mlp_hyper_connection\.input_mix_weight_down\.weight", "hc_ffn_down.weight"),
    (r"mlp_hyper_connection\.input_mix_weight_up\.weight", "hc_ffn_up.weight"),
    (r"mlp_hyper_connection\.block_inject_weight\.weight", "hc_ffn_inject.weight"),
    (r"linear_attn\.in_proj_qkv\.weight", "attn_qkv.weight"),
    (r"linear_attn\.in_proj_z\.weight", "attn_gate.weight"),
    (r"linear_attn\.in_proj_b\.weight", "ssm_beta.weight"),
    (r"linear_attn\.in_proj_a\.weight", "ssm_alpha.weight"),
    (r"linear_attn\.conv1d\.weight", "ssm_conv1d.weight"),
    (r"linear_attn\.dt_bias", "ssm_dt.bias"),
    (r"linear_attn\.A_log", "ssm_a"),
    (r"linear_attn\.norm\.weight", "ssm_norm.weight"),
    (r"linear_attn\.out_proj\.weight", "ssm_out.weight"),
    (r"self_attn\.q_proj\.weight", "attn_q.weight"),
    (r"self_attn\.k_proj\.weight", "attn_k.weight"),
    (r"self_attn\.v_proj\.weight", "attn_v.weight"),
    (r"self_attn\.o_proj\.weight", "attn_output.weight"),
    (r"self_attn\.q_norm\.weight", "attn_q_norm.weight"),
    (r"self_attn\.k_norm\.weight", "attn_k_norm.weight"),
    (r"self_attn\.indexer\.q_layernorm\.weight", "indexer.q_norm.weight"),
    (r"self_attn\.indexer\.k_layernorm\.weight", "indexer.k_norm.weight"),
    (r"mlp\.gate\.weight", "ffn_gate_inp.weight"),
    (r"mlp\.experts\.(?P<e>\d+)\.gate_proj\.weight", "ffn_gate_exps.weight"),
    (r"mlp\.experts\.(?P<e>\d+)\.up_proj\.weight", "ffn_up_exps.weight"),
    (r"mlp\.experts\.(?P<e>\d+)\.down_proj\.weight", "ffn_down_exps.weight"),
    (r"mlp\.experts\.down_proj", "ffn_down_exps.weight"),
    (r"mlp\.shared_expert\.gate_proj\.weight", "ffn_gate_shexp.weight"),
    (r"mlp\.shared_expert\.up_proj\.weight", "ffn_up_shexp.weight"),
    (r"mlp\.shared_expert\.down_proj\.weight", "ffn_down_shexp.weight"),
    (r"mlp\.shared_expert_gate\.weight", "ffn_gate_inp_shexp.weight"),
    (r"ple\.key_proj\.weight", "ple_key.weight"),
    (r"ple\.value_proj\.weight", "ple_value.weight"),
    (r"ple\.norm_key\.weight", "ple_norm_key.weight"),
    (r"ple\.norm_query\.weight", "ple_norm_query.weight"),
    (r"ple\.norm_conv\.weight", "ple_norm_conv.weight"),
    (r"ple\.conv1d\.weight", "ple_conv1d.weight"),
]

HF_TENSOR_NAMES = [
    (rf"{_TOP}embed_tokens\.weight", "token_embd.weight"),
    (r"lm_head\.weight", "output.weight"),
    (rf"{_TOP}hyper_connection_mixer\.hc_norm\.weight", "output_hc_norm.weight"),
    (rf"{_TOP}hyper_connection_mixer\.input_mix_weight_down\.weight", "output_hc_down.weight"),
    (rf"{_TOP}hyper_connection_mixer\.input_mix_weight_up\.weight", "output_hc_up.weight"),
    # one fused HF projection feeds two GGUF tensors; sanitize_hf cuts each out
    (rf"{_LAYER}\.self_attn\.indexer\.index_qk_proj\.weight",
     lambda g, c: (_block("indexer.q_proj.weight")(g, c), _block("indexer.k_proj.weight")(g, c))),
    (rf"{_LAYER}\.mlp\.experts\.gate_up_proj",
     lambda g, c: (_block("ffn_gate_exps.weight")(g, c), _block("ffn_up_exps.weight")(g, c))),
    # the n-gram table: checkpoints shard it (`split_ngram_parts`); joined along rows, never loaded here
    (rf"{_LAYER}\.ple\.ple_embedding\.ngram_embedding\.shard_(?P<cat>\d+)\.weight", TABLE),
    (rf"{_LAYER}\.ple\.ple_embedding\.ngram_embedding\.weight", TABLE),
    # hash constants are recomputed from config.json (and checked against these at load)
    (rf"{_LAYER}\.ple\.ple_embedding\.(?:layer_multipliers|ngram_heads_vocab_sizes|ngram_heads_offsets)", None),
    *[(rf"{_LAYER}\.{pattern}", _block(suffix)) for pattern, suffix in _PER_BLOCK],
    # the MTP head beside its block (llama.cpp's NextN names)
    (r"mtp\.fc_(?P<cat>embedding|hidden)\.weight", _mtp("nextn.eh_proj.weight")),
    (r"mtp\.pre_fc_norm_embedding\.weight", _mtp("nextn.enorm.weight")),
    (r"mtp\.pre_fc_norm_hidden\.weight", _mtp("nextn.hnorm.weight")),
    (r"mtp\.hyper_connection_mixer\.hc_norm\.weight", _mtp("nextn.hc_head_norm.weight")),
    (r"mtp\.hyper_connection_mixer\.input_mix_weight_down\.weight", _mtp("nextn.hc_head_down.weight")),
    (r"mtp\.hyper_connection_mixer\.input_mix_weight_up\.weight", _mtp("nextn.hc_head_up.weight")),
    (r"model\.visual\..*", None),  # the vision tower of Qwen4ExpForConditionalGeneration checkpoints
]


def tile_value_heads(t: torch.Tensor, dim: int, c: Config, head: int) -> torch.Tensor:
    """HF's value heads grouped by key head -> llama.cpp's tiled order (GGUF head r*n_k+k is HF
    head k*ratio+r), along `dim` whose size is v_heads * head."""
    nk, nv = c.linear_k_heads, c.linear_v_heads
    if nk == nv:
        return t
    dim = dim % t.ndim
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], nk, nv // nk, head, *shape[dim + 1:]).transpose(dim, dim + 1)
    return t.reshape(shape).contiguous()


def untile_value_heads(t: torch.Tensor, dim: int, c: Config, head: int) -> torch.Tensor:
    """The inverse of `tile_value_heads`."""
    nk, nv = c.linear_k_heads, c.linear_v_heads
    if nk == nv:
        return t
    dim = dim % t.ndim
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], nv // nk, nk, head, *shape[dim + 1:]).transpose(dim, dim + 1)
    return t.reshape(shape).contiguous()


def sanitize_hf(name: str, t: torch.Tensor, c: Config) -> torch.Tensor:
    """HF layouts into llama.cpp's: zero-centred norms as 1 + w, A_log as -exp(A_log), convs
    squeezed, Gated DeltaNet value heads tiled, fused projections split."""
    key_dim, dv = c.linear_k_heads * c.linear_k_dim, c.linear_v_dim
    zero_centred = name.endswith(("norm.weight", "ple_norm_key.weight", "ple_norm_query.weight",
                                  "ple_norm_conv.weight"))
    if zero_centred and not name.endswith("ssm_norm.weight"):
        return t.float() + 1
    if name.endswith(".ssm_a"):
        return tile_value_heads(-torch.exp(t.float()), 0, c, 1)
    if name.endswith(".ssm_dt.bias") or name.endswith((".ssm_beta.weight", ".ssm_alpha.weight")):
        return tile_value_heads(t, 0, c, 1)
    if name.endswith(".attn_gate.weight"):
        return tile_value_heads(t, 0, c, dv)
    if name.endswith(".ssm_out.weight"):
        return tile_value_heads(t, 1, c, dv)
    if name.endswith(".attn_qkv.weight"):
        return torch.cat([t[:2 * key_dim], tile_value_heads(t[2 * key_dim:], 0, c, dv)])
    if name.endswith(".ssm_conv1d.weight"):
        t = t.reshape(t.shape[0], t.shape[-1])
        return torch.cat([t[:2 * key_dim], tile_value_heads(t[2 * key_dim:], 0, c, dv)])
    if name.endswith(".ple_conv1d.weight"):
        return t.reshape(t.shape[0], t.shape[-1])
    if name.endswith(".indexer.q_proj.weight"):
        return t[:c.indexer_heads * c.indexer_dim]
    if name.endswith(".indexer.k_proj.weight"):
        return t[c.indexer_heads * c.indexer_dim:]
    if name.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight")) and t.shape[1] == 2 * c.expert_ffn_size:
        half = c.expert_ffn_size  # a fused gate_up_proj: gate rows first
        return t[:, :half] if "gate" in name.rsplit(".", 2)[-2] else t[:, half:]
    if name.endswith("nextn.eh_proj.weight"):  # [fc_embedding; fc_hidden] rows -> side by side
        return torch.cat(t.chunk(2), dim=1)
    return t


def check_hash_buffers(source, c: Config) -> None:
    """An HF checkpoint also stores the hash constants; they must be the ones config.json makes."""
    if not hasattr(source, "hf_tensor"):
        return
    h = c.ple_hash
    expected = {"layer_multipliers": h.multipliers, "ngram_heads_vocab_sizes": h.vocab_sizes,
                "ngram_heads_offsets": h.offsets}
    for key in getattr(source, "dropped", []):
        leaf = key.rsplit(".", 1)[-1]
        if leaf in expected:
            stored = tuple(int(v) for v in source.hf_tensor(key).tolist())
            if stored != tuple(expected[leaf]):
                raise BadModelFile(f"{source.description}: {key} is {list(stored)[:4]}..., but config.json "
                                   f"makes it {list(expected[leaf])[:4]}...",
                                   "the n-gram hash settings in config.json do not match the checkpoint")


__all__ = ["ARCH", "HF_MODEL_TYPES", "HF_TENSOR_NAMES", "Config", "check_hash_buffers", "gguf_metadata",
           "sanitize_hf", "tile_value_heads", "untile_value_heads"]
