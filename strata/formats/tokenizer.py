"""Text <-> token ids for a model, from GGUF metadata or a Hugging Face `tokenizer.json` directory.

The heavy lifting (BPE, byte fallback, added-token matching) is HF's Rust `tokenizers`; this module
only rebuilds the pipeline a GGUF describes, because a GGUF carries a vocabulary, merges and a
pre-tokenizer *name* rather than a `tokenizer.json`. Where transformers' GGUF loader and llama.cpp
disagree with the model's own `tokenizer.json`, we follow the latter (see `_BYTE_LEVEL_PRE`, and the
SentencePiece prefix space after special tokens in `_sentencepiece_backend`).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from strata.errors import StrataError
from strata.formats.chat_template import render_chat

log = logging.getLogger(__name__)

# llama.cpp token types (tokenizer.ggml.token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Token texts llama.cpp treats as end-of-generation whatever the metadata says: chat models often name
# only the pretraining EOS (e.g. <|endoftext|>) while ending turns with another token (<|im_end|>).
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
    "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
})  # fmt: skip

_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_O200K_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK3_SPLITS = (
    r"\p{N}{1,3}",
    r"[一-龥\u3040-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)

# tokenizer.ggml.pre -> (regex splits applied in order, ignore_merges, NFC). The splits are those of the
# models' own tokenizer.json (which llama.cpp's per-name regexes reproduce). "digits" is the
# StarCoder/SmolLM pre-tokenizer: every digit alone, then the GPT-2 split -- transformers' GGUF loader
# misses that one and groups digits.
_LLAMA3 = ((_LLAMA3_SPLIT,), True, False)
_QWEN2 = ((_QWEN2_SPLIT,), False, True)
_DIGITS = (("digits", _GPT2_SPLIT), False, False)
_GPT4O = ((_O200K_SPLIT,), False, False)
_BYTE_LEVEL_PRE: dict[str, tuple[tuple[str, ...], bool, bool]] = {
    **dict.fromkeys(("default", "gpt2", "gpt-2", "phi-2", "olmo", "mpt", "jais"), ((_GPT2_SPLIT,), False, False)),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0"), _LLAMA3),
    "lfm2": _LLAMA3,
    **dict.fromkeys(("dbrx", "smaug-bpe"), ((_LLAMA3_SPLIT,), False, False)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "megrez", "stablelm2"), _QWEN2),
    "qwen35": ((_QWEN35_SPLIT,), False, True),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"), _DIGITS),
    "tekken": ((_TEKKEN_SPLIT,), True, False),
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2", "kanana2"), _GPT4O),
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense"), (_DEEPSEEK3_SPLITS, False, False)),
}  # fmt: skip
# Pre-tokenizers whose models llama.cpp starts with BOS when the file does not say.
_BOS_BY_DEFAULT = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "tekken"}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, in which byte-level vocabularies are spelled."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class Tokenizer:
    """A `tokenizers.Tokenizer` plus what generation needs: BOS/EOS ids, and the chat template."""

    def __init__(
        self,
        backend: Backend,
        *,
        bos_id: int | None = None,
        eos_ids: Sequence[int] = (),
        pad_id: int | None = None,
        unk_id: int | None = None,
        chat_template: str | None = None,
        chat_templates: Mapping[str, str] | None = None,
        vocab_size: int | None = None,
    ):
        self.backend = backend
        self.bos_id = bos_id
        # eos_ids[0] is the model's named EOS; all of them end generation.
        self.eos_id = eos_ids[0] if eos_ids else None
        self.eos_ids: set[int] = set(eos_ids)
        self.pad_id = pad_id
        self.unk_id = unk_id
        self.chat_template = chat_template
        self.chat_templates = dict(chat_templates or {})
        self.vocab_size = vocab_size if vocab_size is not None else backend.get_vocab_size(with_added_tokens=True)

    # -- text <-> ids ------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; `add_special_tokens` adds BOS/EOS where the model wants them.

        Special-token text inside `text` (e.g. "<|im_start|>") becomes that token, as in a rendered chat prompt.
        """
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def special_tokens(self) -> dict[str, str]:
        """bos_token/eos_token/unk_token/pad_token texts, as chat templates expect them."""
        named = {"bos_token": self.bos_id, "eos_token": self.eos_id, "unk_token": self.unk_id, "pad_token": self.pad_id}
        return {k: t for k, i in named.items() if i is not None and (t := self.backend.id_to_token(i)) is not None}

    def apply_chat_template(
        self,
        messages,
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        fallback: str | None = None,
        **kwargs,
    ) -> str:
        """The prompt text for `messages`; encode it with `add_special_tokens=False` (the template writes BOS).

        `chat_template` picks a named template from the model (e.g. "tool_use") or is a template
        itself; `fallback="chatml"` renders ChatML for models without one. Other kwargs (tools,
        documents, enable_thinking, ...) reach the template.
        """
        template = self.chat_template
        if chat_template is not None:
            template = self.chat_templates.get(chat_template, chat_template)
        elif kwargs.get("tools") and "tool_use" in self.chat_templates:
            template = self.chat_templates["tool_use"]
        return render_chat(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens(),
            fallback=fallback,
            **kwargs,
        )

    # -- constructors ------------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """From GGUF key/values (see `strata.formats.gguf_metadata.gguf_fields_to_dict`)."""
        kind = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise StrataError(
                "the GGUF file has no tokenizer vocabulary", "load the tokenizer from a tokenizer.json directory"
            )
        types = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
        defaults: dict[str, int] = {}
        if kind == "gpt2":
            backend, add_bos = _byte_level_backend(meta, tokens, types)
        elif kind == "llama":
            backend, add_bos = _sentencepiece_backend(meta, tokens, types)
            defaults = {"bos": 1, "eos": 2, "unknown": 0}  # llama.cpp's defaults for this vocabulary type
        else:
            raise StrataError(
                f"GGUF tokenizer type {kind!r} is not supported",
                "supported: 'gpt2' (byte-level BPE) and 'llama' (SentencePiece BPE), "
                "or load a tokenizer.json directory",
            )
        ids = {n: _token_id(meta, n, len(tokens), defaults.get(n)) for n in ("bos", "eos", "unknown", "padding")}
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos)) and ids["bos"] is not None
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and ids["eos"] is not None
        bos_text = tokens[ids["bos"]] if add_bos else None
        _set_post_processor(backend, bos_text, tokens[ids["eos"]] if add_eos else None, ids)
        named_extra = [_token_id(meta, name, len(tokens)) for name in ("eot", "eom")]
        eos_ids = _end_ids(ids["eos"], named_extra, tokens)
        templates = {
            key.removeprefix("tokenizer.chat_template."): value
            for key, value in meta.items()
            if key.startswith("tokenizer.chat_template.") and isinstance(value, str)
        }
        return cls(
            backend,
            bos_id=ids["bos"],
            eos_ids=eos_ids,
            pad_id=ids["padding"],
            unk_id=ids["unknown"],
            chat_template=meta.get("tokenizer.chat_template"),
            chat_templates=templates,
            vocab_size=len(tokens),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """From a Hugging Face model directory: tokenizer.json, tokenizer_config.json, chat template files."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise StrataError(
                f"no tokenizer.json in {path}", "point at a Hugging Face model directory, or use the GGUF's tokenizer"
            )
        backend = Backend.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        special_map = _read_json(path / "special_tokens_map.json")

        def named(key: str) -> int | None:
            value = config.get(key, special_map.get(key))
            if isinstance(value, dict):
                value = value.get("content")
            return backend.token_to_id(value) if isinstance(value, str) else None

        ids = {k: named(f"{k}_token") for k in ("bos", "eos", "unk", "pad")}
        model_eos: list[int] = []
        for name in ("generation_config.json", "config.json"):
            cfg = _read_json(path / name)
            value = cfg.get("eos_token_id")
            model_eos += value if isinstance(value, list) else [value] if isinstance(value, int) else []
            if ids["bos"] is None and isinstance(cfg.get("bos_token_id"), int):
                ids["bos"] = cfg["bos_token_id"]
        if ids["eos"] is None and model_eos:
            ids["eos"] = model_eos[0]
        # transformers rebuilds the post-processor when the config sets these flags, or when there is none.
        if "add_bos_token" in config or "add_eos_token" in config or backend.post_processor is None:
            bos = _text(backend, ids["bos"]) if config.get("add_bos_token") else None
            eos = _text(backend, ids["eos"]) if config.get("add_eos_token") else None
            _set_post_processor(backend, bos, eos, {"bos": ids["bos"], "eos": ids["eos"]})
        vocab = backend.get_vocab(with_added_tokens=True)
        tokens = [None] * (max(vocab.values()) + 1)
        for text, i in vocab.items():
            tokens[i] = text
        default, templates = _dir_chat_templates(path, config)
        return cls(
            backend,
            bos_id=ids["bos"],
            eos_ids=_end_ids(ids["eos"], model_eos, tokens),
            pad_id=ids["pad"],
            unk_id=ids["unk"],
            chat_template=default,
            chat_templates=templates,
        )


class IncrementalDecoder:
    """Streaming detokenizer: `feed(id)` returns the new text, never half a UTF-8 character.

    Each step decodes a short window of recent ids twice (with and without the new one) and emits the
    difference, so context-dependent decoding (SentencePiece's leading space, byte-fallback pieces,
    multi-token emoji) comes out exactly as a full `decode` would. Text ending in U+FFFD is held back
    until the character completes, for at most `max_pending` tokens (after that the model really
    produced invalid bytes and they are emitted as U+FFFD). Call `flush()` at the end.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, max_pending: int = 6):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.max_pending = max_pending
        self.ids: list[int] = []
        self._prefix = 0  # window start: context for decoding, already emitted
        self._read = 0  # ids before this are emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def feed(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._step(force=False)

    def flush(self) -> str:
        """Whatever is still held back (an unfinished character decodes as U+FFFD)."""
        return self._step(force=True) if self._read < len(self.ids) else ""

    def _step(self, force: bool) -> str:
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        pending = len(self.ids) - self._read
        if not force and (len(after) <= len(before) or (after.endswith("\ufffd") and pending < self.max_pending)):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return after[len(before) :]


# -- GGUF pipelines ----------------------------------------------------------------------------------


def _byte_level_backend(meta: Mapping[str, Any], tokens: list[str], types: list[int]) -> tuple[Backend, bool]:
    """GPT-2 style byte-level BPE: vocabulary spelled in `bytes_to_unicode`, ranked merges, a regex split."""
    pre = meta.get("tokenizer.ggml.pre") or "default"
    if pre not in _BYTE_LEVEL_PRE:
        log.warning("unknown GGUF pre-tokenizer %r; splitting text like GPT-2, which may mis-tokenize", pre)
    splits, ignore_merges, nfc = _BYTE_LEVEL_PRE.get(pre, _BYTE_LEVEL_PRE["default"])
    spelling = bytes_to_unicode()
    # a character outside the byte alphabet, found by one regex search a token (a set per token was
    # 0.24 s of a 248k-token vocabulary's load)
    outside = re.compile("[^" + "".join(re.escape(c) for c in sorted(spelling.values())) + "]")
    vocab: dict[str, int] = {}
    for i, (token, kind) in enumerate(zip(tokens, types)):
        # Added tokens (control, user-defined) are stored as raw text; a normal token outside the byte
        # alphabet is a converter slip, respelled so BPE can still reach it.
        if kind not in (CONTROL, USER_DEFINED) and outside.search(token):
            token = "".join(spelling[b] for b in token.encode("utf-8", errors="surrogateescape"))
        vocab.setdefault(token, i)
    merges = _split_merges(meta.get("tokenizer.ggml.merges") or [])
    backend = Backend(models.BPE(vocab, merges, fuse_unk=False, ignore_merges=ignore_merges))
    if nfc:
        backend.normalizer = normalizers.NFC()
    steps = []
    for split in splits:
        if split == "digits":
            steps.append(pre_tokenizers.Digits(individual_digits=True))
        else:
            steps.append(pre_tokenizers.Split(Regex(split), behavior="isolated"))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    _add_special(backend, tokens, types, special_types=(CONTROL,))
    return backend, pre in _BOS_BY_DEFAULT


def _sentencepiece_backend(meta: Mapping[str, Any], tokens: list[str], types: list[int]) -> tuple[Backend, bool]:
    """SentencePiece BPE (llama/mistral/mixtral): "▁" for spaces, `<0xNN>` byte fallback, merges by score.

    The prefix "▁" goes before every text segment, including text right after a special token
    (`prepend_scheme="always"`), as llama.cpp does and as those models' own tokenizer.json
    (Prepend normalizer) does; transformers' GGUF loader only prepends at the start of the input.
    """
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    merges = meta.get("tokenizer.ggml.merges")
    if merges:
        merges = _split_merges(merges)
    else:
        scores = meta.get("tokenizer.ggml.scores") or [-float(i) for i in range(len(tokens))]
        merges = _merges_from_scores(vocab, scores)
    unk = _token_id(meta, "unknown", len(tokens), 0 if types and types[0] == UNKNOWN else None)
    unk_text = tokens[unk] if unk is not None else None
    model = models.BPE(vocab, merges, unk_token=unk_text, fuse_unk=True, byte_fallback=True)
    backend = Backend(model)
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    scheme = "always" if prefix else "never"
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    _add_special(backend, tokens, types, special_types=(CONTROL, UNKNOWN))
    return backend, True


def _split_merges(merges: Sequence[str]) -> list[tuple[str, str]]:
    # Split at the first space after position 0, as llama.cpp does, so a merge may start with " ".
    out = []
    for merge in merges:
        cut = merge.find(" ", 1)
        if cut > 0:
            out.append((merge[:cut], merge[cut + 1 :]))
    return out


def _merges_from_scores(vocab: Mapping[str, int], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece vocabulary: every split of a piece into two pieces, best score first.

    Ties go to the longer left piece, then the longer right piece, then token order -- the order
    SentencePiece-to-tokenizers conversions use, so the same vocabulary gives the same ids.
    """
    candidates = []
    for piece, index in vocab.items():
        score = scores[index]
        local = []
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            li, ri = vocab.get(left), vocab.get(right)
            if li is not None and ri is not None:
                local.append((li, ri, left, right))
        local.sort()
        candidates.extend((score, left, right) for _, _, left, right in local)
    candidates.sort(key=lambda c: (c[0], len(c[1]), len(c[2])), reverse=True)
    return [(left, right) for _, left, right in candidates]


def _add_special(backend: Backend, tokens: list[str], types: list[int], special_types: tuple[int, ...]) -> None:
    """Control tokens become special (matched whole, skippable in decode); user-defined ones are matched whole too."""
    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k in special_types and t]
    plain = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED and t]
    if special:
        backend.add_special_tokens(special)
    if plain:
        backend.add_tokens(plain)


def _token_id(meta: Mapping[str, Any], name: str, n: int, default: int | None = None) -> int | None:
    value = meta.get(f"tokenizer.ggml.{name}_token_id", default)
    return value if isinstance(value, int) and 0 <= value < n else default


def _end_ids(eos: int | None, extra: Sequence[int | None], tokens: Sequence[str | None]) -> list[int]:
    """EOS first, then the other ids that end a turn: named by the metadata, or by llama.cpp's list of texts."""
    out = [i for i in (eos, *extra) if i is not None]
    out += [i for i, t in enumerate(tokens) if t in _EOG_TEXTS]
    texts = {tokens[i] for i in out}
    if {"<|return|>", "<|call|>"} <= texts:  # harmony (gpt-oss): <|end|> closes a message, not the turn
        out = [i for i in out if tokens[i] != "<|end|>" or i == eos]
    return list(dict.fromkeys(out))


def _set_post_processor(backend: Backend, bos: str | None, eos: str | None, ids: Mapping[str, int | None]) -> None:
    single = " ".join(([f"{bos}:0"] if bos else []) + ["$A:0"] + ([f"{eos}:0"] if eos else []))
    pair = single + " " + " ".join(([f"{bos}:1"] if bos else []) + ["$B:1"] + ([f"{eos}:1"] if eos else []))
    specials = [(t, ids[k]) for t, k in ((bos, "bos"), (eos, "eos")) if t]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


# -- HF directory helpers ----------------------------------------------------------------------------


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        value = json.load(f)
    return value if isinstance(value, dict) else {}


def _text(backend: Backend, token_id: int | None) -> str | None:
    return backend.id_to_token(token_id) if token_id is not None else None


def _dir_chat_templates(path: Path, config: Mapping[str, Any]) -> tuple[str | None, dict[str, str]]:
    """The default and named chat templates, from wherever transformers (v4 or v5) saved them."""
    templates: dict[str, str] = {}
    raw = config.get("chat_template")
    if raw is None and (path / "chat_template.json").is_file():
        raw = _read_json(path / "chat_template.json").get("chat_template")
    if isinstance(raw, list):
        templates.update({t["name"]: t["template"] for t in raw if isinstance(t, dict) and "name" in t})
    elif isinstance(raw, str):
        templates["default"] = raw
    if (path / "chat_template.jinja").is_file():
        templates["default"] = (path / "chat_template.jinja").read_text(encoding="utf-8")
    extra = path / "additional_chat_templates"
    if extra.is_dir():
        templates.update({p.stem: p.read_text(encoding="utf-8") for p in sorted(extra.glob("*.jinja"))})
    return templates.pop("default", None), templates
