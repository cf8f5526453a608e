"""One validation pass between a reader and a model: bad metadata becomes a `BadModelFile`
naming the key and its value, before any architecture code sizes anything from it.

`check_gguf` runs on a GGUF's key/values and tensor names before the architecture's config
reader; `check_hf` on a config.json and the safetensors names; `check_config` on the config
the reader built (consistency: heads divisible, experts used <= experts, rope dims even and within
the head). A count is checked against the tensors the file holds wherever the model builds one
thing per unit of it (layers), so no value in a file makes Strata allocate more than the file's own
tensors need. The bounds are generous: real models are far inside them.
"""

from __future__ import annotations

import math
import re

from strata.errors import BadModelFile

MAX_SIZE = 2**31 - 1  # any count or width; llama.cpp keeps these in int32 too
_COUNT = re.compile(r"(count|length|size|rank|kernel|interval|top_k|dimension_count|_input|"
                    r"ngram_size|heads_per_ngram|layers|eos_token_id)$")
_POSITIVE = ("block_count", "embedding_length", "context_length", "vocab_size", "attention.head_count",
             "attention.head_count_kv", "attention.key_length", "attention.value_length",
             "ssm.group_count", "ssm.time_step_rank")  # Gated DeltaNet's key and value heads: divisors
# sizes a model allocates by before its tensors are read: each must be some tensor's dimension or less
# (FFN widths are not here: a MoE file may name a dense width that no layer of it uses)
_WIDTHS = ("embedding_length", "attention.key_length", "attention.value_length", "rope.dimension_count",
           "attention.head_count", "attention.head_count_kv", "expert_count", "expert_used_count", "vocab_size")
_HF_WIDTHS = ("hidden_size", "head_dim", "num_attention_heads", "num_key_value_heads", "vocab_size")
_FLOAT = re.compile(r"(epsilon|freq_base|factor|scale|_multiplier)$")
_STRING = ("rope.scaling.type", "ssm.output_gate_type")
_LAYER = re.compile(r"^blk\.(\d+)\.")
_HF_LAYER = re.compile(r"^(?:hf:)?model\.(?:language_model\.)?layers\.(\d+)\.")


def _bad(where: str, key: str, value, why: str, fix: str | None = None) -> BadModelFile:
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return BadModelFile(f"{where}: {key} = {shown} {why}", fix or "the file is corrupt or was written by a "
                        "broken converter; re-convert the model")


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and (not isinstance(value, float) or math.isfinite(value)))


def _check_count(where: str, key: str, value, positive: bool) -> None:
    if not is_int(value):
        raise _bad(where, key, value, "is not an integer")
    if not (1 if positive else 0) <= value <= MAX_SIZE:
        raise _bad(where, key, value, f"is out of range ({'1' if positive else '0'}..{MAX_SIZE})")


def _check_list(where: str, key: str, value: list, limit: int) -> None:
    if len(value) > limit:
        raise _bad(where, key, value, f"has {len(value)} items, more than the {limit} this model can use")
    for i, item in enumerate(value):
        if not (is_number(item) or isinstance(item, bool)):  # per-layer flags are bools
            raise _bad(where, f"{key}[{i}]", item, "is not a finite number")
        if is_int(item) and not -(2**63) <= item < 2**64:
            raise _bad(where, f"{key}[{i}]", item, "does not fit 64 bits")


def layer_count(names, pattern=_LAYER) -> int:
    """1 + the highest layer index among tensor names (0 when there are no layers)."""
    top = -1
    for name in names:
        m = pattern.match(name)
        if m:
            top = max(top, int(m.group(1)))
    return top + 1


def check_gguf(meta: dict, arch: str, shapes: dict, where: str) -> None:
    """Types and ranges of the architecture's keys and the tokenizer's arrays; sizes vs the tensors.

    `shapes`: tensor name -> shape. block_count may not exceed the layers present, and every width the
    model sizes a buffer by must fit in some tensor dimension (a head dim no tensor has is a lie).
    """
    prefix = arch + "."
    n_layers = layer_count(shapes)
    widest = max((d for shape in shapes.values() for d in shape), default=0)
    for key, value in meta.items():
        if not key.startswith(prefix):
            continue
        name = key[len(prefix):]
        if isinstance(value, list):
            if _COUNT.search(name) and not name.endswith("layers"):
                raise _bad(where, key, value, "is a list, not an integer")
            _check_list(where, key, value, max(n_layers, 1) * 64 + 64)
        elif _FLOAT.search(name):
            if not is_number(value):
                raise _bad(where, key, value, "is not a finite number")
            if value <= 0 and not name.endswith("_multiplier"):
                raise _bad(where, key, value, "must be > 0")
        elif _COUNT.search(name):
            _check_count(where, key, value, name in _POSITIVE)
            if name in _WIDTHS and value > widest:
                raise _bad(where, key, value, f"is wider than any tensor in the file (the widest dimension is "
                           f"{widest})")
        elif name in _STRING:
            if not isinstance(value, str):
                raise _bad(where, key, value, "is not a string")
        elif isinstance(value, float) and not math.isfinite(value):
            raise _bad(where, key, value, "is not a finite number")
    blocks = meta.get(prefix + "block_count")
    if is_int(blocks) and blocks > n_layers:  # fewer is the model's business: an MTP block after the count
        raise _bad(where, prefix + "block_count", blocks,
                   f"but the file holds tensors for {n_layers} layers (blk.0 to blk.{n_layers - 1})")
    _check_tokenizer(meta, where)


def _check_tokenizer(meta: dict, where: str) -> None:
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is None:
        return
    key = "tokenizer.ggml.tokens"
    if not isinstance(tokens, list) or not tokens:
        raise _bad(where, key, tokens, "is not a non-empty list of strings")
    if not all(isinstance(t, str) for t in tokens):
        raise _bad(where, key, next(t for t in tokens if not isinstance(t, str)), "holds an item that is not a string")
    n = len(tokens)
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        value = meta.get(key)
        if value is None:
            continue
        if not isinstance(value, list) or len(value) != n:
            size = len(value) if isinstance(value, list) else "not a list"
            raise _bad(where, key, f"<{size} items>", f"does not match tokenizer.ggml.tokens' {n} items")
        _check_list(where, key, value, n)
    merges = meta.get("tokenizer.ggml.merges")
    if merges is not None and (not isinstance(merges, list) or not all(isinstance(m, str) for m in merges)):
        raise _bad(where, "tokenizer.ggml.merges", merges, "is not a list of strings")
    model = meta.get("tokenizer.ggml.model")
    if model is not None and not isinstance(model, str):
        raise _bad(where, "tokenizer.ggml.model", model, "is not a string")
    for key, value in meta.items():
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id") and not isinstance(value, list):
            if not is_int(value) or not 0 <= value < n:
                raise _bad(where, key, value, f"is not a token id (the vocabulary has {n} tokens)")


def check_hf(cfg, shapes: dict, where: str) -> None:
    """config.json: an object whose sizes are integers in range; num_hidden_layers and widths vs the shards."""
    if not isinstance(cfg, dict):
        raise BadModelFile(f"{where}: is not a JSON object ({type(cfg).__name__})",
                           "download the model's config.json again")
    widest = max((d for shape in shapes.values() for d in shape), default=0)
    for key, value in cfg.items():
        if isinstance(value, (dict, list)) or value is None or (isinstance(value, bool) and not key.startswith("num_")):
            continue
        if key.startswith("num_") or key.endswith(("_size", "_dim", "_heads", "_layers", "_length", "_count",
                                                      "_embeddings", "_per_tok", "_experts")):
            _check_count(where, key, value, key in ("hidden_size", "num_attention_heads", "num_hidden_layers",
                                                    "vocab_size"))
            if key in _HF_WIDTHS and value > widest:
                raise _bad(where, key, value, f"is wider than any tensor in the safetensors (the widest dimension "
                           f"is {widest})")
        elif key.endswith(("_eps", "_theta")) and not (is_number(value) and value > 0):
            raise _bad(where, key, value, "is not a finite number > 0")
    layers = cfg.get("num_hidden_layers")
    present = layer_count(shapes, _HF_LAYER)
    if is_int(layers) and layers > present:
        raise _bad(where, "num_hidden_layers", layers, f"but the safetensors hold layers 0 to {present - 1} only")


def check_config(c, where: str) -> None:
    """Consistency of the hyper-parameters an architecture built (any architecture: fields by name)."""
    def get(name, default=None):
        return getattr(c, name, default)

    for name in ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "head_dim", "context_length"):
        value = get(name)
        if value is not None:
            _check_count(where, name, value, positive=True)
    heads, kv_heads = get("n_heads"), get("n_kv_heads")
    if heads and kv_heads and heads % kv_heads:
        raise BadModelFile(f"{where}: {heads} attention heads is not a multiple of {kv_heads} KV heads",
                           "the head counts in the metadata are inconsistent; re-convert the model")
    k_heads, v_heads = get("linear_k_heads"), get("linear_v_heads")
    if k_heads and v_heads and v_heads % k_heads:
        raise BadModelFile(f"{where}: {v_heads} Gated DeltaNet value heads is not a multiple of {k_heads} key heads",
                           "ssm.time_step_rank must be a multiple of ssm.group_count; re-convert the model")
    experts, used = get("n_experts", 0), get("n_experts_used", 0)
    for name, value in (("n_experts", experts), ("n_experts_used", used)):
        _check_count(where, name, value, positive=False)
    if experts and not 1 <= used <= experts:
        raise BadModelFile(f"{where}: {used} experts used per token, but the model has {experts}",
                           "expert_used_count must be between 1 and expert_count")
    eps = get("rms_eps")
    if eps is not None and not (is_number(eps) and 0 < eps < 1):
        raise BadModelFile(f"{where}: RMS norm epsilon {eps!r} is not in (0, 1)", "re-convert the model")
    rope, head_dim = get("rope"), get("head_dim")
    if rope is not None and head_dim is not None:
        if not is_int(rope.dim) or rope.dim < 0 or rope.dim % 2 or rope.dim > head_dim:
            raise BadModelFile(f"{where}: rope dimension count {rope.dim!r} must be even and at most the head "
                               f"dimension {head_dim}", "re-convert the model")
        for name in ("theta", "factor"):
            value = getattr(rope, name)
            if not (is_number(value) and value > 0):
                raise BadModelFile(f"{where}: rope {name} {value!r} is not a finite number > 0", "re-convert the model")
    budget = get("indexer_budget", 0)
    for i, ratio in enumerate(get("compress_ratios") or ()):
        if ratio and not (is_int(ratio) and ratio > 0 and is_int(budget) and budget > 0 and budget % ratio == 0):
            raise BadModelFile(f"{where}: layer {i}'s compress ratio {ratio!r} does not divide the indexer budget "
                               f"(attention.indexer.top_k) {budget!r}",
                               "each non-zero attention.compress_ratios entry must divide it; re-convert the model")
