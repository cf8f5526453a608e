"""qwen3next's format: `Config` read from config.json or GGUF metadata, the metadata writer, the HF
names and layout surgery (the model is `strata.models.qwen3next`).

GGUF layout, as llama.cpp's converter writes arch `qwen3next` (names `blk.N.` + ...):

    attn_norm, post_attention_norm, output_norm, attn_q_norm, attn_k_norm   stored as 1 + w
    attn_q (2 * n_head * head_dim rows, per head [q | gate]), attn_k, attn_v, attn_output
    attn_qkv, attn_gate   DeltaNet input projection: conv channels [q heads, k heads, v heads], z
    ssm_in                legacy: HF's in_proj_qkvz unchanged (grouped per key head); also loaded
    ssm_ba                HF's in_proj_ba unchanged (per key head [beta x r, alpha x r])
    ssm_conv1d            (conv_dim, K): HF's conv1d weight squeezed
    ssm_dt.bias           dt_bias
    ssm_a                 -exp(A_log) (no `.weight` suffix)
    ssm_norm              the gated norm's weight, stored as is (it is not zero-centred)
    ssm_out               out_proj
    ffn_gate_inp, ffn_{gate,up,down}_exps, ffn_{gate,up,down}_shexp
    ffn_gate_inp_shexp    (1, hidden), as HF's shared_expert_gate

Metadata: the shared decoder keys, `rope.dimension_count` = rotated dims per head,
`expert_feed_forward_length`, `expert_shared_feed_forward_length`, `full_attention_interval`,
`ssm.conv_kernel` (K), `ssm.state_size` (key head dim), `ssm.group_count` (key heads),
`ssm.time_step_rank` (value heads), `ssm.inner_size` (value heads x value head dim).

The Hugging Face loader maps `in_proj_qkvz` to the legacy `ssm_in` name (one HF tensor maps to
one GGUF name), so `convert_hf_to_gguf` writes that legacy form; llama.cpp reads both, and so
does this file.

The multi-token-prediction layer (HF `mtp.*`, which transformers drops) loads as the draft head
(`strata.models.mtp`), named as llama.cpp's converter names Qwen3.5's: the block after the last,
`blk.{n_layers}`, with `nextn_predict_layers` = 1 and `block_count` = n_layers + 1:

    mtp.fc                       blk.N.nextn.eh_proj
    mtp.pre_fc_norm_embedding    blk.N.nextn.enorm             (1 + w, like every zero-centred norm)
    mtp.pre_fc_norm_hidden       blk.N.nextn.hnorm             (1 + w)
    mtp.norm                     blk.N.nextn.shared_head_norm  (1 + w)
    mtp.layers.0.*               blk.N.* as model.layers.i.* map (a full-attention block with its MoE)

A checkpoint holding only part of it loads without a draft head (`Model.mtp_skipped` says why).
(llama.cpp's own qwen3next converter still drops `mtp.*`; its qwen35 one writes these names.)
"""

from __future__ import annotations

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from strata.errors import BadModelFile, StrataError
from strata.formats.hf import COMMON_TENSOR_NAMES, L
from strata.formats.hparams import (RopeConfig, decoder_from_gguf, decoder_from_hf, gated_deltanet_from_gguf,
                                    gated_deltanet_from_hf)
from strata.gguf.writer import decoder_metadata

ARCH = "qwen3next"
HF_MODEL_TYPES = ("qwen3_next",)

HF_TENSOR_NAMES = [
    (rf"{L}\.post_attention_layernorm\.weight", "blk.{i}.post_attention_norm.weight"),
    (rf"{L}\.linear_attn\.in_proj_qkvz\.weight", "blk.{i}.ssm_in.weight"),
    (rf"{L}\.linear_attn\.in_proj_ba\.weight", "blk.{i}.ssm_ba.weight"),
    (rf"{L}\.linear_attn\.conv1d\.weight", "blk.{i}.ssm_conv1d.weight"),
    (rf"{L}\.linear_attn\.dt_bias", "blk.{i}.ssm_dt.bias"),
    (rf"{L}\.linear_attn\.A_log", "blk.{i}.ssm_a"),
    (rf"{L}\.linear_attn\.norm\.weight", "blk.{i}.ssm_norm.weight"),
    (rf"{L}\.linear_attn\.out_proj\.weight", "blk.{i}.ssm_out.weight"),
    (rf"{L}\.mlp\.shared_expert\.gate_proj\.weight", "blk.{i}.ffn_gate_shexp.weight"),
    (rf"{L}\.mlp\.shared_expert\.up_proj\.weight", "blk.{i}.ffn_up_shexp.weight"),
    (rf"{L}\.mlp\.shared_expert\.down_proj\.weight", "blk.{i}.ffn_down_shexp.weight"),
    (rf"{L}\.mlp\.shared_expert_gate\.weight", "blk.{i}.ffn_gate_inp_shexp.weight"),
]


def _mtp_name(template: str):
    """An MTP tensor's name: `template` with block i = n_layers, the block after the model's."""
    return lambda groups, config: template.format(**{**groups, "i": config.n_layers})


MTP = r"mtp\.layers\.0"
HF_TENSOR_NAMES += [
    (r"mtp\.fc\.weight", _mtp_name("blk.{i}.nextn.eh_proj.weight")),
    (r"mtp\.pre_fc_norm_embedding\.weight", _mtp_name("blk.{i}.nextn.enorm.weight")),
    (r"mtp\.pre_fc_norm_hidden\.weight", _mtp_name("blk.{i}.nextn.hnorm.weight")),
    (r"mtp\.norm\.weight", _mtp_name("blk.{i}.nextn.shared_head_norm.weight")),
] + [(MTP + pattern[len(L):], _mtp_name(template))  # the block, named like model.layers.i's
     for pattern, template in HF_TENSOR_NAMES + COMMON_TENSOR_NAMES
     if pattern.startswith(L) and isinstance(template, str)]


@dataclass(frozen=True, slots=True)
class Config:
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_size: int  # dense layers (mlp_only_layers), if any
    expert_ffn_size: int
    shared_ffn_size: int
    n_experts: int
    n_experts_used: int
    norm_topk_prob: bool
    rms_eps: float
    rope: RopeConfig  # dim = rotated dims per head (partial rotary)
    context_length: int
    recurrent: tuple[bool, ...]  # per layer: Gated DeltaNet (True) or full attention
    conv_kernel: int
    linear_k_heads: int
    linear_v_heads: int
    linear_k_dim: int
    linear_v_dim: int
    dense_layers: tuple[int, ...] = ()
    mtp_layers: int = 0  # MTP (NextN) blocks after the model's, `blk.{n_layers}`: 0 or 1

    @classmethod
    def from_gguf(cls, meta: dict) -> "Config":
        a = ARCH
        base = decoder_from_gguf(meta, a, default_eps=1e-6, default_ctx=262144)
        mtp_layers = meta.get(f"{a}.nextn_predict_layers", 0)
        n_layers = base["n_layers"] = base["n_layers"] - mtp_layers  # llama.cpp counts the MTP block
        if f"{a}.attention.recurrent_layers" in meta:  # llama.cpp's converter writes the explicit list, and reads it first
            recurrent = tuple(bool(x) for x in meta[f"{a}.attention.recurrent_layers"][:n_layers])
        else:
            interval = meta.get(f"{a}.full_attention_interval", 4)
            recurrent = tuple((i + 1) % interval != 0 for i in range(n_layers))
        if len(recurrent) != n_layers:
            raise BadModelFile(f"{a}.attention.recurrent_layers has {len(recurrent)} entries for {n_layers} layers",
                               "re-convert the model")
        return cls(**base, **gated_deltanet_from_gguf(meta, a),
                   ffn_size=meta.get(f"{a}.feed_forward_length", 0),
                   expert_ffn_size=meta[f"{a}.expert_feed_forward_length"],
                   shared_ffn_size=meta.get(f"{a}.expert_shared_feed_forward_length", 0),
                   n_experts=meta[f"{a}.expert_count"], n_experts_used=meta[f"{a}.expert_used_count"],
                   # llama.cpp always renormalises qwen3next's top-k weights
                   norm_topk_prob=bool(meta.get(f"{a}.expert_weights_norm", True)),
                   rope=RopeConfig.from_gguf(meta, a, meta.get(f"{a}.rope.dimension_count", base["head_dim"] // 4),
                                             interleaved=False),
                   recurrent=recurrent, mtp_layers=mtp_layers)

    @classmethod
    def from_hf(cls, cfg: dict) -> "Config":
        base = decoder_from_hf(cfg, default_eps=1e-6, default_ctx=262144)
        head_dim, n_layers = base["head_dim"], base["n_layers"]
        types = cfg.get("layer_types")
        if types is None:
            interval = cfg.get("full_attention_interval", 4)
            types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)]
        rope_params = cfg.get("rope_parameters") or {}
        # transformers' default for qwen3_next is 0.25
        partial = cfg.get("partial_rotary_factor") or rope_params.get("partial_rotary_factor") or 0.25
        n_experts = cfg.get("num_experts", 0)
        step = cfg.get("decoder_sparse_step", 1) or 1
        dense = tuple(i for i in range(n_layers)
                      if i in (cfg.get("mlp_only_layers") or []) or not (n_experts > 0 and (i + 1) % step == 0))
        return cls(**base, **gated_deltanet_from_hf(cfg),
                   ffn_size=cfg.get("intermediate_size", 0), expert_ffn_size=cfg["moe_intermediate_size"],
                   shared_ffn_size=cfg.get("shared_expert_intermediate_size", 0),
                   n_experts=n_experts, n_experts_used=cfg["num_experts_per_tok"],
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                   rope=RopeConfig.from_hf(cfg, int(head_dim * partial)),
                   recurrent=tuple(t == "linear_attention" for t in types), dense_layers=dense,
                   # Qwen3-Next's config.json does not say; `config_with_weights` looks at the tensors
                   mtp_layers=min(1, int(cfg.get("num_nextn_predict_layers") or cfg.get("mtp_num_hidden_layers") or 0)))


def config_with_weights(c: Config, names) -> Config:
    """The checkpoint's tensors decide whether it has an MTP layer (config.json rarely says)."""
    has = f"blk.{c.n_layers}.nextn.eh_proj.weight" in set(names)
    return c if c.mtp_layers == int(has) else dataclasses.replace(c, mtp_layers=int(has))


def full_attention_interval(c: Config) -> int:
    """The n with layer i full attention exactly when (i + 1) % n == 0, as GGUF records it."""
    for n in range(1, c.n_layers + 2):
        if all(rec == ((i + 1) % n != 0) for i, rec in enumerate(c.recurrent)):
            return n
    raise StrataError("this qwen3next layer pattern has no full_attention_interval",
                      "GGUF (like llama.cpp) records the layer kinds only as an interval")


def gguf_metadata(c: Config) -> dict:
    meta = decoder_metadata(
        ARCH, c, feed_forward_length=c.ffn_size, expert_feed_forward_length=c.expert_ffn_size,
        expert_shared_feed_forward_length=c.shared_ffn_size, expert_count=c.n_experts,
        expert_used_count=c.n_experts_used, expert_weights_norm=c.norm_topk_prob,
        full_attention_interval=full_attention_interval(c),
        **{"ssm.conv_kernel": c.conv_kernel, "ssm.state_size": c.linear_k_dim,
           "ssm.group_count": c.linear_k_heads, "ssm.time_step_rank": c.linear_v_heads,
           "ssm.inner_size": c.linear_v_heads * c.linear_v_dim})
    if c.mtp_layers:  # as llama.cpp writes Qwen3.5's: block_count counts the MTP block
        meta[f"{ARCH}.block_count"] = c.n_layers + c.mtp_layers
        meta[f"{ARCH}.nextn_predict_layers"] = c.mtp_layers
    return meta


def sanitize_hf(name: str, t: torch.Tensor, c: Config) -> torch.Tensor:
    """HF layouts into llama.cpp's: zero-centred norms as 1 + w, A_log as -exp(A_log), conv squeezed."""
    if name.endswith("norm.weight") and not name.endswith("ssm_norm.weight"):
        return t.float() + 1
    if name.endswith(".ssm_a"):
        return -torch.exp(t.float())
    if name.endswith("ssm_conv1d.weight"):
        return t.reshape(t.shape[0], t.shape[-1])
    return t
