"""A Hugging Face checkpoint directory (config.json + sharded safetensors) as a weight source.

HF tensor names are mapped once, by the table below, to llama.cpp's names; per-expert
tensors are stacked into `[E, out, in]`. Architectures extend the table with
`HF_TENSOR_NAMES` and fix layouts with `sanitize_hf`.

A template is a format string, or:
  None                  the tensor is known and deliberately unused (e.g. a buffer recomputed from config);
  a tuple of strings    one HF tensor feeds several GGUF names (`sanitize_hf` cuts each one out);
  a callable            (groups, config) -> one of the above, for names that need arithmetic.
A `cat` group joins every HF tensor that maps to one name along axis 0, in order of `cat`
(numerically when it is a number), as for checkpoints that shard one table into parts.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from strata.errors import BadModelFile
from strata.formats.weights import QTensor

L = r"model\.layers\.(?P<i>\d+)"
E = r"\.(?P<e>\d+)\."
# (HF regex, GGUF name template); `e` groups are stacked along a new first axis.
COMMON_TENSOR_NAMES: list[tuple[str, str]] = [
    (r"model\.embed_tokens\.weight", "token_embd.weight"),
    (r"model\.norm\.weight", "output_norm.weight"),
    (r"lm_head\.weight", "output.weight"),
    (rf"{L}\.input_layernorm\.weight", "blk.{i}.attn_norm.weight"),
    (rf"{L}\.post_attention_layernorm\.weight", "blk.{i}.ffn_norm.weight"),
    (rf"{L}\.self_attn\.q_proj\.(?P<kind>weight|bias)", "blk.{i}.attn_q.{kind}"),
    (rf"{L}\.self_attn\.k_proj\.(?P<kind>weight|bias)", "blk.{i}.attn_k.{kind}"),
    (rf"{L}\.self_attn\.v_proj\.(?P<kind>weight|bias)", "blk.{i}.attn_v.{kind}"),
    (rf"{L}\.self_attn\.o_proj\.weight", "blk.{i}.attn_output.weight"),
    (rf"{L}\.self_attn\.q_norm\.weight", "blk.{i}.attn_q_norm.weight"),
    (rf"{L}\.self_attn\.k_norm\.weight", "blk.{i}.attn_k_norm.weight"),
    (rf"{L}\.mlp\.gate_proj\.weight", "blk.{i}.ffn_gate.weight"),
    (rf"{L}\.mlp\.up_proj\.weight", "blk.{i}.ffn_up.weight"),
    (rf"{L}\.mlp\.down_proj\.weight", "blk.{i}.ffn_down.weight"),
    (rf"{L}\.mlp\.gate\.weight", "blk.{i}.ffn_gate_inp.weight"),
    (rf"{L}\.mlp\.experts{E}gate_proj\.weight", "blk.{i}.ffn_gate_exps.weight"),
    (rf"{L}\.mlp\.experts{E}up_proj\.weight", "blk.{i}.ffn_up_exps.weight"),
    (rf"{L}\.mlp\.experts{E}down_proj\.weight", "blk.{i}.ffn_down_exps.weight"),
    (rf"{L}\.block_sparse_moe\.gate\.weight", "blk.{i}.ffn_gate_inp.weight"),
    (rf"{L}\.block_sparse_moe\.experts{E}w1\.weight", "blk.{i}.ffn_gate_exps.weight"),
    (rf"{L}\.block_sparse_moe\.experts{E}w3\.weight", "blk.{i}.ffn_up_exps.weight"),
    (rf"{L}\.block_sparse_moe\.experts{E}w2\.weight", "blk.{i}.ffn_down_exps.weight"),
]


def read_config(path: Path) -> dict:
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise BadModelFile(f"{path}: no config.json", "pass a .gguf file or a Hugging Face model directory")
    try:
        cfg = json.loads(cfg_path.read_bytes())
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise BadModelFile(f"{cfg_path}: not valid JSON ({str(e)[:120]})", "download config.json again") from None
    if not isinstance(cfg, dict):
        raise BadModelFile(f"{cfg_path}: holds a JSON {type(cfg).__name__}, not an object",
                           "download config.json again")
    text = cfg.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise BadModelFile(f"{cfg_path}: text_config is a {type(text).__name__}, not an object",
                           "download config.json again")
    # multimodal / nested configs keep the language model under text_config
    return {**cfg, **text} if text else cfg


def tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape in the directory's shards, from the safetensors headers only."""
    shapes = {}
    for file in _shard_files(Path(path)):
        f = _open(file)
        for key in f.keys():
            shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def _open(file: str):
    try:
        return safe_open(file, "pt")
    except Exception as e:  # SafetensorError: a truncated, garbage or non-safetensors file
        raise BadModelFile(f"{file}: not a readable safetensors file ({str(e)[:160]})",
                           "the download was cut short; fetch the shard again") from None


class HFSource:
    """Safetensors tensors under GGUF names; files are memory-mapped by safetensors."""

    def __init__(self, path: Path, extra_names: list[tuple[str, str]] = (), sanitize=None, config=None):
        self.path = Path(path)
        self.description = str(path)
        self._files = _shard_files(self.path)
        # one memory-mapped handle per shard, opened once; tensors are read from them on demand
        self._handles = {file: _open(file) for file in self._files}
        self._where: dict[str, str] = {}  # HF name -> file
        for file, f in self._handles.items():
            for key in f.keys():
                self._where[key] = file
        table = [(re.compile(p), t) for p, t in list(extra_names) + COMMON_TENSOR_NAMES]
        self._parts: dict[str, list[tuple[int, str]]] = {}  # GGUF name -> [(expert, HF name)]
        self._cat: dict[str, list[tuple[tuple, str]]] = {}  # GGUF name -> [(order, HF name)], joined on axis 0
        self.unmapped: list[str] = []
        self.dropped: list[str] = []  # mapped to None: known, deliberately unused
        for key in self._where:
            for pattern, template in table:
                m = pattern.fullmatch(key)
                if m:
                    groups = m.groupdict()
                    names = _resolve(template, groups, config)
                    if not names:
                        self.dropped.append(key)
                    for name in names:
                        self._parts.setdefault(name, []).append((int(groups.get("e") or -1), key))
                        if groups.get("cat") is not None:
                            self._cat.setdefault(name, []).append((_cat_order(groups["cat"]), key))
                    break
            else:
                self.unmapped.append(key)
        self._sanitize = sanitize
        self.config = config  # the hyper-parameters `sanitize` needs; the loader may refine it

    def close(self) -> None:
        """Let go of the shards' safetensors handles (each closes its mapping when no tensor views it)."""
        self._handles.clear()

    def names(self) -> list[str]:
        return list(self._parts) + [f"hf:{k}" for k in self.unmapped]

    def get(self, name: str) -> QTensor:
        if name in self._cat:
            t = torch.cat([self._read(key) for _, key in self.locate(name)])
        else:
            parts = sorted(self._parts[name])
            tensors = [self._read(key) for _, key in parts]
            if parts[0][0] >= 0 and len({x.shape for x in tensors}) > 1:
                shapes = sorted({tuple(x.shape) for x in tensors})
                raise BadModelFile(f"{self.path}: the experts of {name} have different shapes {shapes[:3]}",
                                   "every expert of a layer must have the same shape; re-download the model")
            t = torch.stack(tensors) if parts[0][0] >= 0 else tensors[0]
        if t.dim() == 0:
            raise BadModelFile(f"{self.path}: {self.locate(name)[0][1]} (for {name}) is a 0-d scalar, not a tensor",
                               "the checkpoint is corrupt; re-download it")
        if self._sanitize is not None:
            t = self._sanitize(name, t, self.config)
        return QTensor.from_float(t)

    def info(self, name: str) -> tuple[str, tuple[int, ...], int]:
        """Stored dtype, logical shape and bytes, from the safetensors headers only."""
        parts = self._parts[name]
        sl = self._handles[self._where[parts[0][1]]].get_slice(parts[0][1])
        shape, dtype = tuple(sl.get_shape()), sl.get_dtype()
        size = {"F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1}.get(dtype, 4)
        n = len(parts) if parts[0][0] >= 0 else 1
        full = (n, *shape) if parts[0][0] >= 0 else shape
        if name in self._cat:
            rows = 0
            for file, key in self.locate(name):
                rows += self._handles[file].get_slice(key).get_shape()[0]
            full = (rows, *shape[1:])
        count = 1
        for d in full:
            count *= d
        return dtype, full, count * size

    def _read(self, key: str) -> torch.Tensor:
        return self._handles[self._where[key]].get_tensor(key)

    def locate(self, name: str) -> list[tuple[str, str]]:
        """(file, HF name) of each part of a GGUF name, in join order; nothing is read."""
        keys = [key for _, key in sorted(self._cat[name])] if name in self._cat else \
            [key for _, key in sorted(self._parts[name])]
        return [(self._where[key], key) for key in keys]

    def hf_tensor(self, key: str) -> torch.Tensor | None:
        """One HF tensor by its own name, exactly as stored (int64 buffers stay int64); None if absent."""
        return self._read(key) if key in self._where else None


def _resolve(template, groups: dict, config) -> tuple[str, ...]:
    if callable(template):
        template = template(groups, config)
        if isinstance(template, str):
            return (template,)
        return tuple(template or ())
    if template is None:
        return ()
    if isinstance(template, str):
        return (template.format(**groups),)
    return tuple(t.format(**groups) for t in template)


def _cat_order(value: str) -> tuple:
    return (0, int(value), "") if value.isdigit() else (1, 0, value)


def _shard_files(path: Path) -> list[str]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_bytes()).get("weight_map")
        except (ValueError, RecursionError, AttributeError):  # not JSON, or JSON but not an object
            weight_map = None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise BadModelFile(f"{index}: not a safetensors index (a JSON object with a weight_map of "
                               "tensor names to shard files)", "download model.safetensors.index.json again")
        files = sorted(set(weight_map.values()))
        outside = [f for f in files if Path(f).is_absolute() or ".." in Path(f).parts]
        if outside:
            raise BadModelFile(f"{index}: shard {outside[0]!r} is outside the model directory",
                               "download model.safetensors.index.json again")
        missing = [f for f in files if not (path / f).exists()]
        if missing:
            raise BadModelFile(f"{path}: safetensors shard {missing[0]} is missing "
                               f"({len(missing)} of {len(files)} shards absent)",
                               "download every shard listed in model.safetensors.index.json")
        return [str(path / f) for f in files]
    files = sorted(str(p) for p in path.glob("*.safetensors"))
    if not files:
        raise BadModelFile(f"{path}: no *.safetensors files", "download the model's weights")
    return files
