"""qwen4exp (hyper-connections, QSA, PLE n-gram table, Gated DeltaNet, MoE + shared expert) against
transformers' Qwen4ExpForCausalLM: a tiny random model, fp32, CPU, with the shared runner's conventions.

The model: 8 layers (GDN x3 + QSA, twice), 8 experts top-2, 4 residual streams, a PLE table on
layer index 1 (HF's `ple_layer_ids=[2]`) sharded in 3 parts, GQA in the DeltaNet (2 key heads,
4 value heads, so the tiled GGUF order matters) and an indexer budget of 16 tokens in blocks of 4,
so a 64-token prompt really is pruned. Every prompt carries EOS tokens, which reset the n-grams.
Two files hold the same weights: the safetensors checkpoint and our converter's GGUF.
"""

from __future__ import annotations

import json
import shutil

import gguf
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig
from transformers.models.qwen4_exp.modeling_qwen4_exp import (Qwen4ExpTextRMSNorm, _build_layer_multipliers,
                                                              _find_nth_prime_after)

import strata
from reference import (batch_and_verify_logits, cached_engine, cached_hf_greedy, check_merge_and_leave, hf_logits, prompt,
                       randomise, save_hf)
from strata.errors import BadModelFile
from strata.formats import qwen4exp
from strata.gguf.convert import convert_hf_to_gguf
from strata.gguf.reader import GGUFFile
from strata.gguf.source import GGUFSource
from strata.models.cache import LayerCache
from strata.models.gated_deltanet import GDNCache
from strata.models.qsa import QSACache, QSAIndexer
from strata.models.qwen4exp import Model as Qwen4ExpModel
from strata.models.seams import Seams
from strata.tiers.ngram_table import open_table

VOCAB, EOS = 256, 5
FORMATS = ["safetensors", "gguf"]
CONFIG = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
    linear_conv_kernel_dim=4, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
    num_experts_per_tok=2, hc_count=4, hc_lowrank=16, ple_layer_ids=[2], ngram_size=3, heads_per_ngram=2,
    ngram_vocab_size_base=50, split_ngram_parts=3, indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=16,
    indexer_budget=16, indexer_compress_ratio=4, eos_token_id=EOS, output_gate_type="sigmoid",
    max_position_embeddings=512, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})


def tiny_qwen4exp() -> Qwen4ExpForCausalLM:
    model = Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**CONFIG))
    randomise(model.eval())  # every parameter: norms, convs (PLE's starts at 0), A_log, dt_bias, the table
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:  # decay rates from fast to slow, so state carried across chunks matters
            if hasattr(layer, "linear_attn"):
                a_log = layer.linear_attn.A_log
                a_log.copy_(torch.empty(a_log.shape).uniform_(0.02, 2.0, generator=g).log())
        # Zero-centred norms (x * (1 + w)) random around their zero init, so gains stay near 1: with
        # `randomise`'s 1 + N(0, .5) every one of the ~40 norms doubles its input, and fp32 rounding
        # (1e-7) grows to 1e-4 over 8 layers (through the PLE gate's signed sqrt and the DeltaNet's
        # per-head norm), which would test rounding, not the model.
        for module in model.modules():
            if isinstance(module, Qwen4ExpTextRMSNorm):
                module.weight.copy_(0.5 * torch.randn(module.weight.shape, generator=g))
    return model


def eos_prompt(n: int = 64, seed: int = 1) -> list[int]:
    """A random prompt with EOS tokens inside it (the n-gram context resets after each)."""
    ids = prompt(VOCAB, n, seed=seed)
    ids = [t if t != EOS else EOS + 1 for t in ids]
    for at in (n // 3, n // 3 + 1, 2 * n // 3):
        if at < n:
            ids[at] = EOS
    return ids


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = tiny_qwen4exp()
    d = tmp_path_factory.mktemp("qwen4exp")
    save_hf(model, d / "hf")
    convert_hf_to_gguf(d / "hf", d / "model.gguf")
    return model, {"safetensors": d / "hf", "gguf": d / "model.gguf"}


_greedy = cached_hf_greedy
_engine = cached_engine


@pytest.mark.parametrize("fmt", FORMATS)
def test_logits_and_greedy_match_transformers(checkpoint, fmt):
    ref_model, paths = checkpoint
    engine = _engine(paths[fmt])
    ids = eos_prompt()
    diff = (engine.logits(ids) - hf_logits(ref_model, ids)).abs().max().item()
    assert diff < 1e-4, f"max abs logit difference {diff}"
    # 32 decode steps past a 64-token prompt: every QSA query prunes, the PLE reads each new token's rows
    assert engine.generate(ids, max_new_tokens=32, stop_at_eos=False) == _greedy(ref_model, tuple(ids), 32)


def _hf_selections(ref_model, ids):
    masks = {}
    for i, layer in enumerate(ref_model.model.layers):
        if hasattr(layer, "self_attn"):
            layer.self_attn.indexer.register_forward_hook(lambda m, a, out, i=i: masks.__setitem__(i, out))
    try:
        hf_logits(ref_model, ids)
    finally:
        for layer in ref_model.model.layers:
            if hasattr(layer, "self_attn"):
                layer.self_attn.indexer._forward_hooks.clear()
    return masks


def test_qsa_prunes_the_blocks_transformers_prunes(checkpoint):
    """The indexer's choice, query by query, equals transformers' (ties included), and it is a
    real choice: with a budget of 16 tokens over half of a 64-token prompt's (query, key) pairs go."""
    ref_model, paths = checkpoint
    model = _engine(paths["gguf"]).model
    ids = eos_prompt()
    expected = _hf_selections(ref_model, ids)
    mine = {}
    for i, block in enumerate(model.blocks):
        if isinstance(block.attn.indexer if hasattr(block.attn, "indexer") else None, QSAIndexer):
            block.attn.indexer.register_forward_hook(lambda m, a, out, i=i: mine.__setitem__(i, out))
    try:
        with torch.inference_mode():
            model(torch.tensor([ids]), model.new_cache(1))
    finally:
        for block in model.blocks:
            if hasattr(block.attn, "indexer") and block.attn.indexer is not None:
                block.attn.indexer._forward_hooks.clear()
    assert sorted(mine) == sorted(expected) == [3, 7]
    causal = torch.ones(64, 64, dtype=torch.bool).tril()
    for i in expected:
        got = mine[i][0, 0] & causal
        assert torch.equal(got, expected[i][0, 0]), f"layer {i}: selections differ"
        kept = got.sum(-1)
        assert int(kept.max()) <= 16 + 4 - 1  # budget + the incomplete tail
        assert int(kept.sum()) < int(causal.sum()) // 2  # over half the (query, key) pairs pruned
        assert torch.equal(got[:19], causal[:19])  # up to 4 complete blocks: exactly dense
        assert not torch.equal(got[19], causal[19])  # the fifth complete block: pruned


def test_pruning_changes_the_output(checkpoint):
    """Dense attention is not what transformers computes here: dropping the indexer moves the logits."""
    ref_model, paths = checkpoint
    model = Qwen4ExpModel(*_config_and_loader(paths["gguf"]), Seams(table_reader=open_table))
    for block in model.blocks:
        if hasattr(block.attn, "indexer"):
            block.attn.indexer = None
    ids = eos_prompt()
    with torch.inference_mode():
        dense = model(torch.tensor([ids]), model.new_cache(1))[0]
    assert (dense - hf_logits(ref_model, ids)).abs().max().item() > 1e-2


def _config_and_loader(path):
    from strata.formats.checkpoint import open_config
    from strata.models.weights import WeightLoader

    _, config, source, _ = open_config(path)
    return config, WeightLoader(source)


def test_gguf_layout_follows_llama_cpp(checkpoint):
    ref_model, paths = checkpoint
    file = GGUFFile(paths["gguf"])
    meta, source = file.metadata, GGUFSource(file)
    a = qwen4exp.ARCH
    assert file.arch == a
    assert (meta[f"{a}.hyper_connection.count"], meta[f"{a}.hyper_connection.low_rank"]) == (4, 16)
    assert (meta[f"{a}.attention.indexer.head_count"], meta[f"{a}.attention.indexer.key_length"],
            meta[f"{a}.attention.indexer.top_k"]) == (4, 16, 16)
    assert meta[f"{a}.attention.compress_ratios"] == [0, 0, 0, 4, 0, 0, 0, 4]
    assert (meta[f"{a}.full_attention_interval"], meta[f"{a}.rope.dimension_count"]) == (4, 8)
    assert meta[f"{a}.ple.layers"] == [1] and meta[f"{a}.ple.eos_token_id"] == EOS
    assert (meta[f"{a}.ple.ngram_size"], meta[f"{a}.ple.heads_per_ngram"], meta[f"{a}.ple.conv_kernel"],
            meta[f"{a}.embedding_length_per_layer_input"]) == (3, 2, 4, 16)
    emb = ref_model.model.layers[1].ple.ple_embedding
    assert meta[f"{a}.ple.layer_multipliers"] == emb.layer_multipliers.tolist()
    assert meta[f"{a}.ple.head_vocab_sizes"] == emb.ngram_heads_vocab_sizes.tolist()
    assert meta[f"{a}.ple.head_offsets"] == emb.ngram_heads_offsets.tolist()
    fields = gguf.GGUFReader(paths["gguf"]).fields  # llama.cpp reads the hash constants as uint64 arrays
    for key in ("layer_multipliers", "head_offsets", "head_vocab_sizes"):
        assert fields[f"{a}.ple.{key}"].types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT64]

    def get(name):
        return source.get(name).dequantize()

    hf = dict(ref_model.named_parameters())
    la = "model.layers.0.linear_attn."
    # (the value-head order of ssm_a, ssm_dt, ssm_beta, attn_gate, attn_qkv and ssm_out is llama.cpp's
    # tiling; logits equal transformers' only if load undoes it, and a restatement here checked nothing)
    torch.testing.assert_close(get("blk.0.attn_qkv.weight")[:64], hf[la + "in_proj_qkv.weight"][:64])  # q, k as is
    torch.testing.assert_close(get("blk.0.ssm_norm.weight"), hf[la + "norm.weight"])  # not zero-centred
    assert get("blk.0.ssm_conv1d.weight").shape == (96, 4)
    qk = hf["model.layers.3.self_attn.indexer.index_qk_proj.weight"]
    torch.testing.assert_close(get("blk.3.indexer.q_proj.weight"), qk[:64])
    torch.testing.assert_close(get("blk.3.indexer.k_proj.weight"), qk[64:])
    torch.testing.assert_close(get("blk.3.indexer.k_norm.weight"),
                               1 + hf["model.layers.3.self_attn.indexer.k_layernorm.weight"])
    torch.testing.assert_close(get("blk.1.ple_norm_key.weight"), 1 + hf["model.layers.1.ple.norm_key.weight"])
    torch.testing.assert_close(get("blk.1.ple_conv1d.weight"), hf["model.layers.1.ple.conv1d.weight"][:, 0])
    torch.testing.assert_close(get("blk.2.hc_attn_norm.weight"),
                               1 + hf["model.layers.2.attn_hyper_connection.hc_norm.weight"])
    torch.testing.assert_close(get("output_hc_norm.weight"), 1 + hf["model.hyper_connection_mixer.hc_norm.weight"])
    torch.testing.assert_close(get(qwen4exp.TABLE), emb.ngram_embedding.weight)  # 3 shards joined in order
    assert source.get("blk.0.ffn_gate_inp_shexp.weight").shape == (1, 64)
    assert source.get("blk.0.ffn_gate_exps.weight").shape == (8, 32, 64)
    assert "output_norm.weight" not in source.names() and "blk.0.attn_norm.weight" not in source.names()
    assert not any(n.startswith("blk.3.ssm") or n.startswith("blk.0.attn_q.") for n in source.names())


@torch.inference_mode()
def hf_prefill_then_decode(model, ids: torch.Tensor, n_prefill: int) -> torch.Tensor:
    out = model(ids[:, :n_prefill], use_cache=True)
    logits, cache = [out.logits[0]], out.cache
    for i in range(n_prefill, ids.shape[1]):
        out = model(ids[:, i:i + 1], cache=cache, use_cache=True)
        logits.append(out.logits[0])
        cache = out.cache
    return torch.cat(logits).float()


@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_then_decode_equals_one_forward(checkpoint, fmt):
    """Decode steps (KV + indexer keys, the GDN recurrence, the PLE's n-gram context and conv window)
    continue the prefill: against transformers' own prefill-then-decode within 1e-4, and against one
    full forward within the fp32 noise of chunked vs token-by-token delta rule (see qwen3next)."""
    ref_model, paths = checkpoint
    model = _engine(paths[fmt]).model
    ids = torch.tensor([eos_prompt() + eos_prompt(16, seed=7)])
    with torch.inference_mode():
        whole = model(ids, model.new_cache(1))[0]
        cache = model.new_cache(1)
        steps = [model(ids[:, :64], cache)[0]]
        steps += [model(ids[:, i:i + 1], cache)[0] for i in range(64, ids.shape[1])]
    steps = torch.cat(steps)
    assert (steps - hf_prefill_then_decode(ref_model, ids, 64)).abs().max().item() < 1e-4
    assert (steps - whole).abs().max().item() < 5e-5 * whole.abs().max().item()
    assert torch.equal(steps.argmax(-1), whole.argmax(-1))


def test_quantized_deltanet_decode_in_c_matches_transformers(checkpoint, tmp_path, monkeypatch):
    """The tiled DeltaNet layers of a file whose DeltaNet projections are Q8_0 decode through the
    one-call C mixer (`decode_ops.try_gdn_mixer`: no input norm or residual, the hyper-connections
    around it; ssm_out's columns in the file's tiled order), float32 activations: one sequence,
    then two as a batch with a speculative verify pass and a rollback, against transformers'
    prefill-then-decode given the same weights through gguf-py's quantize and dequantize."""
    import copy

    import gguf.quants

    from strata import kernels
    from strata.gguf.writer import write_gguf
    from strata.kernels import decode_ops

    ref_model, paths = checkpoint
    f32, q8 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0
    file = GGUFFile(paths["gguf"])
    source = GGUFSource(file)
    mixer = (".attn_qkv.", ".attn_gate.", ".ssm_alpha.", ".ssm_beta.", ".ssm_out.")
    write_gguf(tmp_path / "q8.gguf", qwen4exp.ARCH, file.metadata,
               [(n, source.get(n).dequantize(), q8 if any(m in n for m in mixer) else f32) for n in source.names()])
    ref = copy.deepcopy(ref_model)  # Q8_0 blocks run along rows, so the file's row and column tiling commutes
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if ".linear_attn." in name and name.split(".")[-2] in ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b",
                                                                     "out_proj"):
                p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), q8), q8)))
    calls = [0]

    def counted(*a, _fn=decode_ops.try_gdn_mixer):
        y = _fn(*a)
        calls[0] += y is not None
        return y

    monkeypatch.setattr(decode_ops, "try_gdn_mixer", counted)
    before = kernels.activations()
    kernels.set_activations("float32")
    try:
        model = strata.load(tmp_path / "q8.gguf", draft="off").model
        ids = torch.tensor([eos_prompt() + eos_prompt(16, seed=7)])
        with torch.inference_mode():
            cache = model.new_cache(1)
            model(ids[:, :64], cache)
            steps = torch.cat([model(ids[:, i:i + 1], cache)[0] for i in range(64, ids.shape[1])])
        assert calls[0] == 6 * 16  # 6 DeltaNet layers, 16 steps
        assert (steps - hf_prefill_then_decode(ref, ids, 64)[64:]).abs().max().item() < 1e-4
        seqs = [eos_prompt(24, seed=2) + eos_prompt(6, seed=8), eos_prompt(17, seed=3) + eos_prompt(6, seed=9)]
        got = batch_and_verify_logits(model, seqs, [24, 17])
    finally:
        kernels.set_activations(before)
    assert calls[0] == 6 * 16 + 6 * 5  # and 5 passes of the batch (the prompt: the chunked form)
    for r in range(2):
        want = hf_prefill_then_decode(ref, torch.tensor([seqs[r]]), [24, 17][r])
        diff = max((logits - want[p]).abs().max().item() for p, logits in got[r])
        assert diff < 1e-4, (r, diff)


@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_in_chunks_equals_one_pass(checkpoint, fmt):
    _, paths = checkpoint
    ids = eos_prompt()
    model = _engine(paths[fmt]).model
    with torch.inference_mode():
        whole = model(torch.tensor([ids]), model.new_cache(1))[0]
        cache = model.new_cache(1)
        parts = [model(torch.tensor([ids[s:s + 7]]), cache)[0] for s in range(0, len(ids), 7)]
    assert (torch.cat(parts) - whole).abs().max().item() < 1e-4
    once = _engine(paths[fmt]).generate(ids, 8, stop_at_eos=False)
    assert _engine(paths[fmt], prefill_chunk=7).generate(ids, 8, stop_at_eos=False) == once


@pytest.mark.parametrize("fmt", FORMATS)
def test_batch_of_prompts_matches_one_by_one(checkpoint, fmt):
    ref_model, paths = checkpoint
    engine = _engine(paths[fmt])
    prompts = [eos_prompt(n, seed=n) for n in (64, 17, 40)]
    batched = engine.logits(prompts)
    for ids, got in zip(prompts, batched):
        assert (got - hf_logits(ref_model, ids)).abs().max().item() < 1e-4
    expected = [_greedy(ref_model, tuple(ids), 12) for ids in prompts]
    assert engine.generate(prompts, max_new_tokens=12, stop_at_eos=False) == expected
    # chunked prefill of rows of different lengths: later chunks hold no real token for short rows
    assert _engine(paths[fmt], prefill_chunk=7).generate(prompts, 12, stop_at_eos=False) == expected


def test_padding_never_reaches_a_cache(checkpoint):
    """Right padding leaves every per-row state as the row alone would have it."""
    _, paths = checkpoint
    model = _engine(paths["gguf"]).model
    prompts = [eos_prompt(64, seed=3), eos_prompt(5, seed=4), eos_prompt(30, seed=5)]
    tokens = torch.zeros(3, 64, dtype=torch.long)
    for row, p in enumerate(prompts):
        tokens[row, :len(p)] = torch.tensor(p)
    with torch.inference_mode():
        batch = model.new_cache(3)
        model(tokens, batch, n_new=torch.tensor([len(p) for p in prompts]))
        for row, p in enumerate(prompts):
            alone = model.new_cache(1)
            model(torch.tensor([p]), alone)
            for b, a in zip(batch.layers, alone.layers):
                if isinstance(b, LayerCache):  # the PLE layer: n-gram context, conv window
                    assert torch.equal(b.ple.context[row], a.ple.context[0])
                    torch.testing.assert_close(b.ple.conv[row], a.ple.conv[0], atol=1e-5, rtol=1e-5)
                    b, a = b.mixer, a.mixer
                if isinstance(b, GDNCache):
                    torch.testing.assert_close(b.state[row], a.state[0], atol=1e-5, rtol=1e-5)
                    torch.testing.assert_close(b.conv[row], a.conv[0], atol=1e-5, rtol=1e-5)
                else:
                    assert isinstance(b, QSACache)
                    n = len(p)
                    torch.testing.assert_close(b.ik[row, :n], a.ik[0, :n], atol=1e-5, rtol=1e-5)
                    torch.testing.assert_close(b.k[row, :, :n], a.k[0, :, :n], atol=1e-5, rtol=1e-5)


def test_cache_select_extend_and_size(checkpoint):
    """Continuous batching: requests prefilled alone, merged, decoded together, then one leaves."""
    _, paths = checkpoint
    model = _engine(paths["gguf"]).model
    prompts = [eos_prompt(20, seed=8), eos_prompt(33, seed=9)]

    def inspect(merged):
        ple = merged.layers[1]
        assert ple.ple.nbytes == 2 * (2 * 8 + 9 * 256 * 4)  # n-gram context (int64) + conv window, per row
        qsa = merged.layers[3]
        assert qsa.nbytes == qsa.k.nbytes + qsa.v.nbytes + qsa.ik.nbytes and qsa.ik.shape[0] == 2

    check_merge_and_leave(model, prompts, inspect)


def test_ngram_rows_are_read_from_disk_per_token(checkpoint):
    """The table is not loaded with the weights; a decode step reads (at most) its token's rows."""
    _, paths = checkpoint
    for fmt in FORMATS:
        engine = strata.load(paths[fmt])
        table = engine.model.ple_table
        assert table.stats()["bytes_read"] == 0
        table.cache_bytes = 0  # no row cache: every lookup goes to the file
        engine.generate(eos_prompt(), max_new_tokens=4, stop_at_eos=False)
        s = table.stats()
        heads = 4
        assert s["tokens"] == 64 + 3 and s["rows_requested"] == heads * s["tokens"]
        assert s["bytes_read"] <= s["rows_requested"] * s["row_bytes"]
        table.close()


def test_mtp_block_is_converted_with_llama_cpp_names(checkpoint, tmp_path):
    """An MTP head (`mtp.*`) becomes block n_layers with llama.cpp's NextN names; it loads as the
    draft head and leaves the model's logits alone (tests/test_speculative.py runs it)."""
    ref_model, paths = checkpoint
    hf_dir = tmp_path / "hf"
    shutil.copytree(paths["safetensors"], hf_dir)
    extra = {}
    with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
        for key in f.keys():
            if key.startswith("model.layers.3."):
                extra[key.replace("model.layers.3.", "mtp.layers.0.")] = f.get_tensor(key)
    g = torch.Generator().manual_seed(3)
    extra.update({"mtp.fc_embedding.weight": torch.randn(64, 64, generator=g),
                  "mtp.fc_hidden.weight": torch.randn(64, 64, generator=g),
                  "mtp.pre_fc_norm_embedding.weight": torch.randn(64, generator=g),
                  "mtp.pre_fc_norm_hidden.weight": torch.randn(64, generator=g),
                  "mtp.hyper_connection_mixer.hc_norm.weight": torch.randn(256, generator=g),
                  "mtp.hyper_connection_mixer.input_mix_weight_down.weight": torch.randn(16, 256, generator=g),
                  "mtp.hyper_connection_mixer.input_mix_weight_up.weight": torch.randn(256, 16, generator=g)})
    save_file(extra, str(hf_dir / "mtp.safetensors"))
    cfg = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": 1}))
    ids = eos_prompt(24)
    expected = hf_logits(ref_model, ids)
    assert (strata.load(hf_dir).logits(ids) - expected).abs().max().item() < 1e-4
    out = convert_hf_to_gguf(hf_dir, tmp_path / "mtp.gguf")
    file = GGUFFile(out)
    a = qwen4exp.ARCH
    assert file.metadata[f"{a}.block_count"] == 9 and file.metadata[f"{a}.nextn_predict_layers"] == 1
    assert file.metadata[f"{a}.attention.compress_ratios"] == [0, 0, 0, 4, 0, 0, 0, 4, 0]
    source = GGUFSource(file)
    eh = source.get("blk.8.nextn.eh_proj.weight").dequantize()
    torch.testing.assert_close(eh, torch.cat([extra["mtp.fc_embedding.weight"], extra["mtp.fc_hidden.weight"]], 1))
    torch.testing.assert_close(source.get("blk.8.nextn.hnorm.weight").dequantize(),
                               1 + extra["mtp.pre_fc_norm_hidden.weight"])
    for name in ("nextn.enorm", "nextn.hc_head_norm", "nextn.hc_head_down", "nextn.hc_head_up", "hc_attn_inject",
                 "attn_q", "indexer.k_proj", "ffn_gate_exps"):
        assert f"blk.8.{name}.weight" in file.tensors, name
    engine = strata.load(out)
    assert engine.config.n_layers == 8 and engine.config.nextn_layers == 1 and engine.drafting
    assert (engine.logits(ids) - expected).abs().max().item() < 1e-4


QWEN4_EXP_TEXT_CONFIG = {  # the shape of the released text config (num_hidden_layers cut to keep primes cheap)
    "model_type": "qwen4_exp_text", "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 8,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "hc_count": 4, "hc_lowrank": 320, "ple_layer_ids": [2],
    "ngram_size": 3, "heads_per_ngram": 8, "ngram_vocab_size_base": 20000000, "indexer_n_heads": 8,
    "indexer_kv_heads": 1, "indexer_head_dim": 128, "indexer_budget": 2048, "indexer_compress_ratio": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
    "eos_token_id": [248046, 248044], "output_gate_type": "sigmoid", "max_position_embeddings": 262144,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10]}}


def test_config_round_trips_through_gguf_metadata():
    c = qwen4exp.Config.from_hf(QWEN4_EXP_TEXT_CONFIG)
    assert c.recurrent == tuple((i + 1) % 4 != 0 for i in range(8)) and c.rope.dim == 64
    assert c.compress_ratios == (0, 0, 0, 4, 0, 0, 0, 4) and c.ple_layers == (1,)
    assert c.ple_hash.eos == 248046 and c.ple_row_dim == 128  # transformers resets on the first eos id
    primes = [_find_nth_prime_after(20_000_000 - 1, h + 1) for h in range(16)]
    assert list(c.ple_hash.vocab_sizes) == primes and c.ple_hash.offsets[-1] == sum(primes[:-1])
    assert list(c.ple_hash.multipliers) == _build_layer_multipliers(248320, 3, 0, 1234).tolist()
    assert c.ple_rows == -(-sum(primes) // 128) * 128
    assert qwen4exp.Config.from_gguf(qwen4exp.gguf_metadata(c)) == c


def test_bad_gguf_names_what_is_missing(checkpoint, tmp_path):
    """A GGUF missing a required key, or the n-gram table, names it."""
    _, paths = checkpoint
    from strata.gguf.writer import write_gguf

    file = GGUFFile(paths["gguf"])
    source = GGUFSource(file)
    tensors = [(n, source.get(n).dequantize(), gguf.GGMLQuantizationType.F32) for n in source.names()]
    meta = {k: v for k, v in file.metadata.items() if k != "qwen4exp.ple.head_offsets"}
    write_gguf(tmp_path / "nokey.gguf", qwen4exp.ARCH, meta, tensors)
    with pytest.raises(BadModelFile, match="qwen4exp.ple.head_offsets"):
        strata.load(tmp_path / "nokey.gguf")
    write_gguf(tmp_path / "notable.gguf", qwen4exp.ARCH, file.metadata,
               [t for t in tensors if t[0] != qwen4exp.TABLE])
    with pytest.raises(BadModelFile, match="per_layer_token_embd"):
        strata.load(tmp_path / "notable.gguf")
