"""The PLE n-gram table on disk (`strata.tiers.ngram_table`): the hash equals transformers', only
the rows a token needs are read (counted by the reader and by the kernel's /proc/self/io), an EOS
resets the n-gram context, and a table that does not fit its metadata is refused before any read.

The table here is ~8 MB (8 hash heads of ~8k rows, 32 F32 values a row), written as a GGUF the way
our converter writes qwen4exp's `per_layer_token_embd`.
"""

from __future__ import annotations

import json
import struct

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from strata.errors import BadModelFile
from strata.gguf.reader import GGUFFile
from strata.gguf.writer import write_gguf
from strata.formats.ngram_hash import TABLE, NgramHash, head_vocab_sizes, layer_multipliers
from strata.tiers.ngram_table import NgramTable

ARCH = "qwen4exp"
VOCAB, EOS, NGRAM, PER_NGRAM, DIM = 1000, 7, 3, 4, 32
F32 = gguf.GGMLQuantizationType.F32


def make_hash(base: int = 8000) -> NgramHash:
    heads = (NGRAM - 1) * PER_NGRAM
    sizes = head_vocab_sizes(base, heads, 0)
    return NgramHash(NGRAM, PER_NGRAM, tuple(layer_multipliers(VOCAB, NGRAM, 0, 1234)), tuple(sizes),
                     tuple(sum(sizes[:h]) for h in range(heads)), EOS)


def ple_metadata(h: NgramHash) -> dict:
    a = ARCH
    return {f"{a}.ple.layers": [1], f"{a}.ple.ngram_size": h.ngram_size,
            f"{a}.ple.heads_per_ngram": h.heads_per_ngram, f"{a}.ple.conv_kernel": 4,
            f"{a}.ple.eos_token_id": h.eos, f"{a}.embedding_length_per_layer_input": DIM,
            f"{a}.ple.layer_multipliers": np.array(h.multipliers, dtype=np.uint64),
            f"{a}.ple.head_offsets": np.array(h.offsets, dtype=np.uint64),
            f"{a}.ple.head_vocab_sizes": np.array(h.vocab_sizes, dtype=np.uint64)}


@pytest.fixture(scope="module")
def table_file(tmp_path_factory):
    h = make_hash()
    rows = -(-h.min_rows // 128) * 128
    table = torch.randn(rows, DIM, generator=torch.Generator().manual_seed(0))
    path = write_gguf(tmp_path_factory.mktemp("ngram") / "table.gguf", ARCH, ple_metadata(h), [(TABLE, table, F32)])
    return path, h, table


def rchar() -> int:
    """Bytes this process has asked read()/pread() for, as the kernel counts them."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def tokens(n: int, seed: int = 0) -> list[int]:
    ids = torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return [t if t != EOS else EOS + 1 for t in ids]


def test_hash_equals_transformers():
    """Row ids from our uint64 hash equal those transformers' embedding looks up (EOS resets included)."""
    from transformers import Qwen4ExpTextConfig
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextNGramEmbedding

    cfg = Qwen4ExpTextConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, ngram_size=NGRAM,
                             heads_per_ngram=PER_NGRAM, ngram_vocab_size_base=8000, ple_layer_ids=[2],
                             eos_token_id=EOS, seed=99, linear_num_key_heads=2, linear_num_value_heads=4,
                             num_experts=4, num_experts_per_tok=2)
    heads = (NGRAM - 1) * PER_NGRAM
    for ple_index in (0, 1):
        emb = Qwen4ExpTextNGramEmbedding(cfg, embedding_dim=heads, layer_idx=1, ple_layer_index=ple_index)
        with torch.no_grad():  # row r holds the number r: the embedding returns the row ids themselves
            emb.ngram_embedding.weight.copy_(torch.arange(emb.ngram_embedding.weight.shape[0])[:, None].float())
        h = NgramHash.from_config(cfg.to_dict(), ple_index)
        assert list(h.vocab_sizes) == emb.ngram_heads_vocab_sizes.tolist()
        assert list(h.offsets) == emb.ngram_heads_offsets.tolist()
        assert list(h.multipliers) == emb.layer_multipliers.tolist()
        ids = torch.tensor([tokens(40, seed=1), tokens(40, seed=2)])
        ids[0, [5, 6, 20]] = EOS
        ids[1, 39] = EOS
        with torch.no_grad():
            expected = emb(ids, None).long()
        assert torch.equal(h.rows(ids, h.initial_context(2)), expected)


def test_eos_resets_the_context():
    h = make_hash()
    seq = tokens(12, seed=3)
    seq[5] = EOS
    rows = h.rows(torch.tensor([seq]), h.initial_context(1))[0]
    fresh = h.rows(torch.tensor([seq[6:]]), h.initial_context(1))[0]
    assert torch.equal(rows[6:], fresh)  # after an EOS, as at the start of a sequence
    assert not torch.equal(rows[3:5], h.rows(torch.tensor([seq[3:5]]), h.initial_context(1))[0])
    # the EOS itself still hashes with the tokens before it
    assert torch.equal(rows[5], h.rows(torch.tensor([seq[:6]]), h.initial_context(1))[0, 5])
    # one token at a time, carrying the context as decode does, gives the same rows
    ctx, steps = h.initial_context(1), []
    for t in seq:
        tok = torch.tensor([[t]])
        steps.append(h.rows(tok, ctx)[0, 0])
        ctx = h.next_context(ctx, tok, torch.tensor([1]))
    assert torch.equal(torch.stack(steps), rows)


def test_reads_only_the_rows_of_each_token(table_file):
    path, h, table = table_file
    t = NgramTable.from_gguf(GGUFFile(path), h, DIM, cache_bytes=0)
    assert t.stats()["bytes_read"] == 0  # opening reads nothing of the table
    seq = tokens(300, seed=4)
    seq[100] = EOS
    ctx = h.initial_context(1)
    per_token = h.n_heads * t.row_bytes
    before = rchar()
    for tok in seq:  # decode: one token per step
        x = torch.tensor([[tok]])
        rows = h.rows(x, ctx)
        ctx = h.next_context(ctx, x, torch.tensor([1]))
        t.count_tokens(1)
        got = t.gather(rows)
        torch.testing.assert_close(got, table[rows], rtol=0, atol=0)
    kernel = rchar() - before
    s = t.stats()
    assert s["tokens"] == 300 and s["rows_requested"] == 300 * h.n_heads
    assert s["bytes_read"] <= 300 * per_token and s["bytes_read_per_token"] <= per_token
    assert kernel <= s["bytes_read"] + 64 * 1024  # what the kernel saw: these rows (and a little else)
    assert s["bytes_read"] < s["table_bytes"] / 10  # never the table
    t.close()


def test_prompt_rows_are_read_at_once_and_cached(table_file):
    path, h, table = table_file
    t = NgramTable.from_gguf(GGUFFile(path), h, DIM, cache_bytes=64 * 1024)
    prompt = torch.tensor([tokens(256, seed=5)])
    rows = h.rows(prompt, h.initial_context(1))
    pending = t.request(rows)  # returns at once; the reads run on the pool
    torch.testing.assert_close(pending.result(), table[rows], rtol=0, atol=0)
    s = t.stats()
    assert s["requests"] == 1 and s["rows_read"] == len(torch.unique(rows))
    assert s["cache_bytes"] <= 64 * 1024  # the LRU holds to its bound
    cached = s["cached_rows"]
    again = t.request(rows[:, -1:])  # the last token's rows were cached last: all hits
    again.result()
    assert t.stats()["cache_hits"] == h.n_heads and t.stats()["rows_read"] == s["rows_read"]
    assert cached == 64 * 1024 // t.row_bytes
    t.close()


def test_a_table_too_small_is_refused_before_any_read(table_file, tmp_path):
    path, h, table = table_file
    small = write_gguf(tmp_path / "small.gguf", ARCH, ple_metadata(h), [(TABLE, table[:1000], F32)])
    file = GGUFFile(small)
    before = rchar()
    with pytest.raises(BadModelFile, match=rf"has 1000 rows, but its 8 hash heads reach row {h.min_rows}"):
        NgramTable.from_gguf(file, h, DIM)
    assert rchar() - before < 4096  # refused from the header alone
    with pytest.raises(BadModelFile, match=r"must hold 16 values"):
        NgramTable.from_gguf(GGUFFile(path), h, 16)


def test_a_gguf_missing_a_key_or_the_table_names_it(table_file, tmp_path):
    path, h, table = table_file
    meta = ple_metadata(h)
    del meta[f"{ARCH}.ple.head_vocab_sizes"]
    with pytest.raises(BadModelFile, match=r"qwen4exp\.ple\.head_vocab_sizes"):
        NgramHash.from_gguf(meta, ARCH)
    assert NgramHash.from_gguf(GGUFFile(path).metadata, ARCH) == h
    other = write_gguf(tmp_path / "other.gguf", ARCH, ple_metadata(h), [("token_embd.weight", table[:8], F32)])
    with pytest.raises(BadModelFile, match="per_layer_token_embd.weight"):
        NgramTable.from_gguf(GGUFFile(other), h, DIM)


def test_safetensors_shards_are_joined_and_checked(table_file, tmp_path):
    """An HF checkpoint's shards are read in place, in shard order; a missing shard or a short file is
    refused before any read, naming the numbers."""
    _, h, table = table_file
    shards = table.split(3000)
    names = [f"model.layers.1.ple.ple_embedding.ngram_embedding.shard_{i}.weight" for i in range(len(shards))]
    save_file(dict(zip(names[:2], shards[:2])), str(tmp_path / "a.safetensors"))
    save_file(dict(zip(names[2:], shards[2:])), str(tmp_path / "b.safetensors"))
    parts = [(str(tmp_path / "a.safetensors"), n) for n in names[:2]] + \
            [(str(tmp_path / "b.safetensors"), n) for n in names[2:]]
    t = NgramTable.from_safetensors(parts, h, DIM, expected_rows=table.shape[0])
    rows = torch.tensor([0, 2999, 3000, 6001, table.shape[0] - 1])
    torch.testing.assert_close(t.gather(rows), table[rows], rtol=0, atol=0)
    t.close()
    with pytest.raises(BadModelFile, match=rf"has {table.shape[0] - shards[-1].shape[0]} rows in "
                                           rf"{len(parts) - 1} shards, but the config makes it {table.shape[0]}"):
        NgramTable.from_safetensors(parts[:-1], h, DIM, expected_rows=table.shape[0])
    data = (tmp_path / "b.safetensors").read_bytes()
    (tmp_path / "b.safetensors").write_bytes(data[:-1000])  # cut short
    (n,) = struct.unpack("<Q", data[:8])
    assert json.loads(data[8:8 + n])  # the header is intact, the rows are not
    with pytest.raises(BadModelFile, match=r"the file has \d+ bytes"):
        NgramTable.from_safetensors(parts, h, DIM, expected_rows=table.shape[0])


def test_a_prefetch_is_not_read_twice(table_file):
    """Rows requested early (a prompt, or a draft token, before its forward) are read once: a later
    request of the same rows waits on the reads under way or finds them cached."""
    path, h, table = table_file
    t = NgramTable.from_gguf(GGUFFile(path), h, DIM)
    rows = h.rows(torch.tensor([tokens(64, seed=6)]), h.initial_context(1))
    t.request(rows)  # a prefetch nobody waits for
    torch.testing.assert_close(t.gather(rows), table[rows], rtol=0, atol=0)
    s = t.stats()
    assert s["requests"] == 2 and s["rows_read"] == len(torch.unique(rows))
    t.close()


def test_quantized_rows_are_dequantized_row_by_row(table_file, tmp_path):
    """A table stored quantized (whole blocks per row, e.g. Q8_0) is read and decoded per row."""
    from strata.gguf.source import GGUFSource

    _, h, table = table_file
    path = write_gguf(tmp_path / "q8.gguf", ARCH, ple_metadata(h), [(TABLE, table, gguf.GGMLQuantizationType.Q8_0)])
    file = GGUFFile(path)
    t = NgramTable.from_gguf(file, h, DIM)
    rows = torch.tensor([[0, 17, 40000], [h.min_rows - 1, 5, 5]])
    expected = GGUFSource(file).get(TABLE).dequantize()[rows]
    torch.testing.assert_close(t.gather(rows), expected, rtol=0, atol=0)
    assert t.stats()["bytes_read"] == 5 * t.row_bytes and t.row_bytes == 34  # 32 int8 + an f16 scale
    t.close()
