"""MTP speculative decoding on a tiny random qwen3next (tests/test_qwen3next.py's model) and a
tiny random qwen4exp (tests/test_qwen4exp.py's, with the n-gram table, QSA and hyper-connections).

transformers drops Qwen3-Next's `mtp.*` weights, so the checkpoint gets random ones here: the
block is layer 0 of a one-layer, full-attention Qwen3NextModel (`aux`), whose final norm is
`mtp.norm`, plus random `mtp.fc` and pre-fc norms. The same aux model is the head's reference.

The random head rarely agrees with the model, so rejections at every draft position and the
all-accepted path (with its bonus token) come from `Oracle`, a test double that drafts the
model's own greedy continuation, wrong exactly where a test says.
"""

from __future__ import annotations

import functools

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM, Qwen4ExpTextConfig, Qwen4ExpTextModel
from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextRMSNorm

import strata
from reference import hf_logits, prompt, randomise, save_hf
from strata.errors import BadOption
from strata.gguf.convert import convert_hf_to_gguf
from strata.gguf.reader import GGUFFile
from strata.formats import qwen3next
from strata.models.cache import LayerCache
from strata.models.cache import ModelCache
from strata.models.gated_deltanet import GDNCache
from strata.models.qsa import QSACache
from strata.runtime.generate import generate_step
from strata.runtime.sampling import SamplingParams
from strata.runtime.speculative import DraftStats, accept
from test_qwen3next import VOCAB, tiny_qwen3next
from test_qwen4exp import CONFIG as Q4_CONFIG
from test_qwen4exp import VOCAB as Q4_VOCAB
from test_qwen4exp import eos_prompt, tiny_qwen4exp

GREEDY = SamplingParams()
N_OUT = 20


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_mtp(model, tmp) -> tuple[Qwen3NextForCausalLM, dict]:
    """A random MTP layer for `model`: (aux reference model, the `mtp.*` tensors)."""
    cfg = model.config.to_dict()
    cfg.update(num_hidden_layers=1, layer_types=["full_attention"])
    cfg.pop("full_attention_interval", None)
    aux = randomise(Qwen3NextForCausalLM(Qwen3NextConfig(**cfg)).eval(), seed=5)
    save_hf(aux, tmp)  # transformers' own checkpoint names (one tensor per expert)
    saved = {}
    for f in tmp.glob("*.safetensors"):
        saved.update(load_file(str(f)))
    tensors = {"mtp." + k[len("model."):]: v for k, v in saved.items()
               if k.startswith(("model.layers.", "model.norm."))}
    hidden = model.config.hidden_size
    g = torch.Generator().manual_seed(6)
    tensors["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=g) / (2 * hidden) ** 0.5
    tensors["mtp.pre_fc_norm_embedding.weight"] = 0.5 * torch.randn(hidden, generator=g)
    tensors["mtp.pre_fc_norm_hidden.weight"] = 0.5 * torch.randn(hidden, generator=g)
    return aux, tensors


@torch.inference_mode()
def reference_mtp(model, aux, tensors, ids: list[int]) -> torch.Tensor:
    """The head's logits at positions 0..n-2 of `ids` (pairs (h_p, x_{p+1})), from transformers."""
    def norm(x, w):  # Qwen3-Next's zero-centred RMS norm
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w)

    x = torch.tensor([ids])
    h = model.model(x).last_hidden_state[:, :-1]  # after the final norm
    e = model.model.embed_tokens(x[:, 1:])
    u = torch.cat([norm(e, tensors["mtp.pre_fc_norm_embedding.weight"]),
                   norm(h, tensors["mtp.pre_fc_norm_hidden.weight"])], dim=-1) @ tensors["mtp.fc.weight"].T
    g = aux.model(inputs_embeds=u).last_hidden_state  # block, then mtp.norm
    return model.lm_head(g)[0].float()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = tiny_qwen3next()
    d = tmp_path_factory.mktemp("qwen3next_mtp")
    aux, tensors = tiny_mtp(model, d / "aux")
    save_hf(model, d / "hf")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "hf" / "mtp.safetensors"))
    convert_hf_to_gguf(d / "hf", d / "model.gguf")
    plain = d / "plain"
    save_hf(model, plain)
    return model, aux, tensors, {"safetensors": d / "hf", "gguf": d / "model.gguf", "plain": plain}


@functools.cache
def _engine(path, **options):
    return strata.load(path, **options)


@functools.cache
def _plain(path, ids: tuple[int, ...], n: int) -> list[int]:
    return _engine(path, draft="off").generate(list(ids), n, stop_at_eos=False)


PROMPTS = [prompt(VOCAB, 24, seed=11), prompt(VOCAB, 5, seed=12), prompt(VOCAB, 1, seed=13)]


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_mtp_head_loads_and_matches_reference(checkpoint, fmt):
    model, aux, tensors, paths = checkpoint
    engine = _engine(paths[fmt])
    assert engine.drafting and engine.drafter is not None and engine.config.mtp_layers == 1
    head = engine.drafter
    ids = PROMPTS[0]
    with torch.inference_mode():
        cache = engine.model.new_cache(1)
        _, h = engine.model(torch.tensor([ids]), cache, hidden=True)
        whole, _ = head(torch.tensor([ids[1:]]), h[:, :-1], head.new_cache(1))
        # the same positions in two steps through the head's KV cache
        dcache = head.new_cache(1)
        first, _ = head(torch.tensor([ids[1:10]]), h[:, :9], dcache)
        rest, _ = head(torch.tensor([ids[10:]]), h[:, 9:-1], dcache)
    ref = reference_mtp(model, aux, tensors, ids)
    assert (whole[0] - ref).abs().max().item() < 1e-4
    assert (torch.cat([first, rest], 1)[0] - ref).abs().max().item() < 1e-4


def test_gguf_names_follow_llama_cpp(checkpoint):
    *_, paths = checkpoint
    file = GGUFFile(paths["gguf"])
    a = qwen3next.ARCH
    assert file.metadata[f"{a}.block_count"] == 5 and file.metadata[f"{a}.nextn_predict_layers"] == 1
    names = set(file.tensors)
    for n in ("nextn.eh_proj", "nextn.enorm", "nextn.hnorm", "nextn.shared_head_norm", "attn_q", "attn_norm",
              "post_attention_norm", "attn_q_norm", "ffn_gate_inp", "ffn_up_exps", "ffn_gate_inp_shexp"):
        assert f"blk.4.{n}.weight" in names, n
    assert not any(n.startswith("blk.4.ssm") for n in names)
    assert qwen3next.Config.from_gguf(file.metadata).n_layers == 4


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_draft_on_equals_draft_off(checkpoint, k):
    *_, paths = checkpoint
    engine = _engine(paths["gguf"])
    engine.options.draft_tokens = k
    for ids in PROMPTS:
        assert engine.generate(ids, N_OUT, stop_at_eos=False) == _plain(paths["gguf"], tuple(ids), N_OUT)
        d = engine.stats["draft"]
        assert d["draft_tokens"] == k and d["rounds"] > 0 and d["drafted"] >= d["accepted"]
    if k == 3:  # the repetition penalty applies to drafts and verification alike
        ids, kw = PROMPTS[0], dict(stop_at_eos=False, repetition_penalty=1.5)
        assert engine.generate(ids, 12, **kw) == _engine(paths["gguf"], draft="off").generate(ids, 12, **kw)


class Oracle:
    """A draft head that knows the model's greedy continuation `out` of `prompt_ids`: it drafts it
    (like an MTP head that copies the model), except the tokens at output indices `wrong`."""

    def __init__(self, prompt_ids, out, wrong=(), vocab=VOCAB):
        self.seq = list(prompt_ids) + list(out)
        self.n_prompt, self.wrong, self.vocab = len(prompt_ids), set(wrong), vocab

    def new_cache(self, batch=1):
        return ModelCache([], batch)

    def __call__(self, tokens, hidden, cache, n_new=None, last_only=False):
        step = cache.step(tokens.shape[1], n_new)
        cache.advance(step)
        targets = step.positions[0] + 2  # position p predicts x_{p+2}
        logits = torch.full((1, tokens.shape[1], self.vocab), -1e9)
        for i, s in enumerate(targets.tolist()):
            t = self.seq[s] if s < len(self.seq) else 0
            if s - self.n_prompt in self.wrong:
                t = (t + 1) % self.vocab
            logits[0, i, t] = 0.0
        return (logits[:, -1:] if last_only else logits), hidden


def schedule(k: int, limit: int, errors) -> list[int]:
    """Output indices to draft wrong so that round r rejects at draft position errors[r]
    (k: none wrong, every draft and the bonus token kept), replaying the loop's arithmetic."""
    wrong, c, r = [], 1, 0  # the first token comes from the prefill
    while c < limit:
        kr = min(k, limit - c - 1)
        e = min(errors[r % len(errors)], kr)
        if e < kr:
            wrong.append(c + e)
        c, r = c + e + 1, r + 1
    return wrong


def _run(engine, ids, head, n, cache=None, k=3, params=GREEDY):
    stats = DraftStats(k)
    steps = generate_step(engine.model, [ids], params, cache, 8192, head, k, stats, limit=n)
    out = [int(next(steps)) for _ in range(n)]
    steps.close()
    return out, stats


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_rejection_at_every_position_and_full_acceptance(checkpoint, k):
    *_, paths = checkpoint
    engine = _engine(paths["gguf"])
    ids = PROMPTS[0]
    plain = _plain(paths["gguf"], tuple(ids), N_OUT)
    errors = list(range(k + 1))  # round r rejects d_{r mod (k+1)}; k: all accepted + the bonus
    out, stats = _run(engine, ids, Oracle(ids, plain, schedule(k, N_OUT, errors)), N_OUT, k=k)
    assert out == plain
    assert all(stats.drafted_at[i] > stats.accepted_at[i] for i in range(k)), stats  # a rejection at each i
    assert stats.accepted_at[k - 1] > 0  # and whole rounds kept
    # a head that copies the model: every draft kept, k+1 tokens per verify pass
    out, stats = _run(engine, ids, Oracle(ids, plain), N_OUT, k=k)
    assert out == plain and stats.acceptance_rate == 1.0
    assert stats.rounds == -(-(N_OUT - 1) // (k + 1))


def test_eos_and_max_tokens_mid_draft(checkpoint):
    *_, paths = checkpoint
    ids = PROMPTS[0]
    plain = _plain(paths["gguf"], tuple(ids), N_OUT)
    engine = strata.load(paths["gguf"], draft_tokens=4)
    engine.drafter = Oracle(ids, plain)  # all kept: rounds yield tokens 1..5, 6..10, ...
    for n in (1, 2, 3, 7, 9):  # limits inside rounds
        assert engine.generate(ids, n, stop_at_eos=False) == plain[:n]
        assert engine.stats["draft"]["drafted"] <= n  # nothing drafted past the limit
    eos = next(t for t in plain[2:] if t not in plain[:2])  # first seen mid-round
    engine.tokenizer = FakeTokenizer([eos])
    stop = plain.index(eos)
    assert engine.generate(ids, N_OUT) == plain[:stop]
    streamed = list(engine.stream(ids, N_OUT))
    assert [r.token for r in streamed[:-1]] == plain[:stop] and streamed[-1].finish_reason == "stop"
    assert "".join(r.text for r in streamed) == "".join(f"<{t}>" for t in plain[:stop])
    streamed = list(engine.stream(ids, 7, stop_at_eos=False))
    assert [r.token for r in streamed] == plain[:7] and streamed[-1].finish_reason == "length"


class FakeTokenizer:
    def __init__(self, eos_ids):
        self.eos_ids = eos_ids

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{t}>" for t in ids)


class OracleOnRealHead(Oracle):
    """Runs the real MTP head (its KV cache, its chained hidden states) but drafts like `Oracle`."""

    def __init__(self, head, prompt_ids, out, wrong=()):
        super().__init__(prompt_ids, out, wrong)
        self.head, self.caches = head, []

    def new_cache(self, batch=1):
        self.caches.append(self.head.new_cache(batch))
        return self.caches[-1]

    def __call__(self, tokens, hidden, cache, n_new=None, last_only=False):
        start = cache.lengths.clone()
        _, g = self.head(tokens, hidden, cache, n_new, last_only)
        logits, _ = super().__call__(tokens, hidden, _at(start), n_new, last_only)
        return logits, g


def _at(lengths):
    """A throwaway bookkeeping cache at `lengths`, for `Oracle` to read positions from."""
    c = ModelCache([], 1)
    c.lengths = lengths
    return c


def test_mtp_cache_holds_the_model_pairs_after_rollbacks(checkpoint):
    """The head's KV cache after a speculative run: position p holds (h_p, x_{p+1}) from the
    model, as a fresh pass of the head over the final sequence writes it (chained drafts and
    rejected positions rolled back, accepted ones re-read with the model's hidden states)."""
    *_, paths = checkpoint
    engine = _engine(paths["gguf"])
    ids = PROMPTS[0]
    plain = _plain(paths["gguf"], tuple(ids), N_OUT)
    head = OracleOnRealHead(engine.drafter, ids, plain, schedule(3, N_OUT, [3, 0, 2, 1]))
    out, stats = _run(engine, ids, head, N_OUT, k=3)
    assert out == plain and 0 < stats.accepted < stats.drafted
    kv = head.caches[0]
    n = int(kv.lengths[0])
    assert len(ids) <= n < len(ids) + N_OUT - 1  # the prompt's pairs and the committed ones read back
    seq = torch.tensor([ids + plain])
    with torch.inference_mode():
        _, h = engine.model(seq, engine.model.new_cache(1), hidden=True)
        fresh = engine.drafter.new_cache(1)
        engine.drafter(seq[:, 1:n + 1], h[:, :n], fresh)
    got, want = kv.layers[0], fresh.layers[0]
    for a, b in ((got.k, want.k), (got.v, want.v)):
        a, b = a[:, :, :n], b[:, :, :n]
        assert (a - b).abs().max().item() <= 1e-4 * b.abs().max().item()


def _states(cache):
    return [(c.conv.clone(), c.state.clone()) for c in cache.layers if isinstance(c, GDNCache)]


def test_recurrent_state_after_speculation_equals_plain_run(checkpoint):
    *_, paths = checkpoint
    engine = _engine(paths["gguf"])
    ids = PROMPTS[0]
    plain = _plain(paths["gguf"], tuple(ids), N_OUT)
    head = Oracle(ids, plain, schedule(3, N_OUT, [0, 2, 1, 3]))
    cache = engine.model.new_cache(1)
    out, stats = _run(engine, ids, head, N_OUT, cache=cache, k=3)
    assert out == plain and stats.accepted < stats.drafted
    ref = engine.model.new_cache(1)  # plain: the prompt, then one token at a time
    steps = generate_step(engine.model, [ids], GREEDY, ref)
    assert [int(next(steps)) for _ in range(N_OUT)] == plain
    # the plain run has fed all but the last token; so has the speculative one
    assert cache.lengths.tolist() == ref.lengths.tolist() == [len(ids) + N_OUT - 1]
    # equal up to fp32 rounding, which the verify pass's (k+1)-token matmuls do in another order
    # than one-token steps (~3e-6 of the scale here by the second DeltaNet layer; a wrong
    # rollback is off by O(1))
    for (conv, state), (conv_ref, state_ref) in zip(_states(cache), _states(ref)):
        assert (conv - conv_ref).abs().max().item() <= 1e-5 * conv_ref.abs().max().item()
        assert (state - state_ref).abs().max().item() <= 1e-5 * state_ref.abs().max().item()


def test_quantized_verify_passes_in_c_keep_the_greedy_output(checkpoint, tmp_path, monkeypatch):
    """A Q8_0 file: the verify passes' DeltaNet layers run in one C call each (the state after
    each position kept, then rolled back to the kept prefix), and with rejections at every draft
    position the output equals plain one-token decoding's, token for token, as do the DeltaNet
    states after it (up to rounding)."""
    import gguf

    from strata.kernels import decode_ops

    *_, paths = checkpoint
    path = convert_hf_to_gguf(paths["safetensors"], tmp_path / "q8.gguf", dense_type=gguf.GGMLQuantizationType.Q8_0)
    engine = strata.load(path)
    ids = PROMPTS[0]
    plain_cache = engine.model.new_cache(1)
    steps = generate_step(engine.model, [ids], GREEDY, plain_cache)
    plain = [int(next(steps)) for _ in range(N_OUT)]
    verify = [0]

    def counted(x, *a, _fn=decode_ops.try_gdn_block):
        y = _fn(x, *a)
        verify[0] += y is not None and x.shape[1] > 1
        return y

    monkeypatch.setattr(decode_ops, "try_gdn_block", counted)
    cache = engine.model.new_cache(1)
    out, stats = _run(engine, ids, Oracle(ids, plain, schedule(3, N_OUT, [0, 2, 1, 3])), N_OUT, cache=cache, k=3)
    assert out == plain and 0 < stats.accepted < stats.drafted
    assert verify[0] == 2 * stats.passes  # 2 DeltaNet layers, every pass drafting
    # the 8-bit activations round x to their grid, where the verify pass's other order of
    # rounding can move a value one step: 2e-5 of the scale here; a wrong rollback is off by O(1)
    for (conv, state), (conv_ref, state_ref) in zip(_states(cache), _states(plain_cache)):
        assert (conv - conv_ref).abs().max().item() <= 1e-4 * conv_ref.abs().max().item()
        assert (state - state_ref).abs().max().item() <= 1e-4 * state_ref.abs().max().item()


@pytest.mark.parametrize("kept_states", [True, False])  # the states kept while verifying, or the replay
def test_gdn_rollback_restores_the_state_after_the_kept_tokens(checkpoint, kept_states, monkeypatch):
    if not kept_states:
        monkeypatch.setattr(GDNCache, "STEP_BYTES", -1)
    *_, paths = checkpoint
    model = _engine(paths["gguf"]).model
    ids = PROMPTS[0]
    with torch.inference_mode():
        a, b, c = (model.new_cache(1) for _ in range(3))
        for cache in (a, b, c):
            model(torch.tensor([ids[:20]]), cache)
        a.track()
        b.track()
        model(torch.tensor([ids[20:24]]), a)  # 4 tokens, then keep 2 of them
        a.rollback(2)
        model(torch.tensor([ids[20:22]]), b)
        assert a.lengths.tolist() == b.lengths.tolist() == [22]
        for (conv, state), (conv_ref, state_ref) in zip(_states(a), _states(b)):  # up to rounding
            assert (conv - conv_ref).abs().max().item() <= 1e-5 * conv_ref.abs().max().item()
            assert (state - state_ref).abs().max().item() <= 1e-5 * state_ref.abs().max().item()
        a.rollback(2)  # and the other two: back to the prefix's state, exactly
        assert a.lengths.tolist() == [20]
        for (conv, state), (conv_ref, state_ref) in zip(_states(a), _states(c)):
            assert torch.equal(conv, conv_ref) and torch.equal(state, state_ref)
        with pytest.raises(ValueError):
            a.rollback(1)  # more than that forward wrote


def test_sampling_keeps_the_model_distribution():
    """Speculative sampling's accept / resample rule: tokens come out distributed as p."""
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0)
    p_logits, q_logits = torch.randn(1, 6, generator=g) * 2, torch.randn(6, generator=g) * 2
    logits = torch.cat([p_logits, torch.zeros(1, 6)])  # position 0 is judged; 1 would be the bonus
    q = torch.softmax(q_logits, -1)
    n = 2000
    counts = torch.zeros(6)
    for _ in range(n):
        d = int(torch.multinomial(q, 1, generator=g))
        counts[accept(logits, [d], [q], [], params, g)[0]] += 1
    p = torch.softmax(p_logits[0], -1)
    assert (counts / n - p).abs().max().item() < 0.04, (counts / n, p)


def test_sampling_runs_with_the_real_head(checkpoint):
    *_, paths = checkpoint
    engine = _engine(paths["safetensors"])
    engine.options.draft_tokens = 3
    out = engine.generate(PROMPTS[1], 12, temperature=0.8, top_k=20, seed=3, stop_at_eos=False)
    assert len(out) == 12 and all(0 <= t < VOCAB for t in out)
    assert engine.generate(PROMPTS[1], 12, temperature=0.8, top_k=20, seed=3, stop_at_eos=False) == out


def test_draft_options(checkpoint):
    *_, paths = checkpoint
    with pytest.raises(BadOption):
        strata.load(paths["plain"], draft="on")
    assert not strata.load(paths["plain"]).drafting  # auto: no MTP layer, no drafts
    assert not _engine(paths["gguf"], draft="off").drafting
    with pytest.raises(BadOption):
        strata.load(paths["gguf"], draft="maybe")
    with pytest.raises(BadOption):
        strata.load(paths["gguf"], draft_tokens=0)
    from strata.runtime.run_cli import engine_options, parser

    args = parser().parse_args(["-m", "x", "--draft", "off", "--draft-tokens", "3"])
    assert engine_options(args)["draft"] == "off" and engine_options(args)["draft_tokens"] == 3


def test_demo_model_drafts_like_it_decodes():
    """The bundled demo model, once it has an MTP layer (it has none yet)."""
    from pathlib import Path

    from strata.demo import train

    demo = Path(train.__file__).with_name("strata-demo.gguf")
    if not demo.exists():
        pytest.skip("run `make demo-model` to build the demo model")
    if not any(k.endswith(".nextn_predict_layers") and v for k, v in GGUFFile(demo).metadata.items()):
        pytest.skip("the demo model has no MTP layer yet")
    engine = strata.load(demo, draft="on")
    ids = engine.tokenizer.encode("def read_config(path):\n")
    out = engine.generate(ids, 48, stop_at_eos=False)
    assert engine.stats["draft"]["rounds"] > 0
    engine.drafting = False
    assert engine.generate(ids, 48, stop_at_eos=False) == out


# -- qwen4exp: hyper-connected MTP block, n-gram table and QSA caches rolled back ------------------


def tiny_qwen4exp_mtp(model, seed: int = 5, copy: bool = False):
    """An MTP layer for a tiny qwen4exp: (aux, mtp.* tensors). `aux`, a one-layer qwen4exp text
    model, is both its source and its reference: its layer is the MTP block (QSA, pruning past the
    budget as the trunk's does), its final mixer the head's hc_head (`strata.models.qwen4exp_mtp`).

    `copy`: a head that predicts what the trunk predicted one position earlier (its block and its
    embedding half add nothing; hc_head is the trunk's own mixer): its drafts repeat the last
    token, which `echo_trunk` keeps only sometimes, so rounds both accept and reject."""
    cfg = dict(Q4_CONFIG, num_hidden_layers=1, layer_types=["indexed_attention"], ple_layer_ids=[])
    aux = randomise(Qwen4ExpTextModel(Qwen4ExpTextConfig(**cfg)).eval(), seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    hidden = model.config.hidden_size
    with torch.no_grad():
        for module in aux.modules():  # zero-centred norms near their init, as tiny_qwen4exp's
            if isinstance(module, Qwen4ExpTextRMSNorm):
                module.weight.copy_(0.5 * torch.randn(module.weight.shape, generator=g))
        if copy:
            layer = aux.layers[0]
            for weight in (layer.self_attn.o_proj.weight, layer.mlp.experts.down_proj,
                           layer.mlp.shared_expert.down_proj.weight):
                weight.zero_()
            aux.hyper_connection_mixer.load_state_dict(model.model.hyper_connection_mixer.state_dict())
    tensors = {"mtp." + k: v.clone() for k, v in aux.state_dict().items()
               if k.startswith(("layers.", "hyper_connection_mixer."))}
    if copy:
        tensors |= {"mtp.fc_embedding.weight": torch.zeros(hidden, hidden), "mtp.fc_hidden.weight": torch.eye(hidden),
                    "mtp.pre_fc_norm_embedding.weight": torch.zeros(hidden),
                    "mtp.pre_fc_norm_hidden.weight": torch.zeros(hidden)}
    else:
        tensors |= {"mtp.fc_embedding.weight": torch.randn(hidden, hidden, generator=g) / hidden ** 0.5,
                    "mtp.fc_hidden.weight": torch.randn(hidden, hidden, generator=g) / hidden ** 0.5,
                    "mtp.pre_fc_norm_embedding.weight": 0.5 * torch.randn(hidden, generator=g),
                    "mtp.pre_fc_norm_hidden.weight": 0.5 * torch.randn(hidden, generator=g)}
    return aux, tensors


def echo_trunk(alpha: float = 0.3):
    """tiny_qwen4exp with the LM head tied to the embedding and every block's output scaled by
    `alpha`: it often, not always, predicts the token it just read (greedy runs repeat tokens)."""
    torch.manual_seed(0)
    model = tiny_qwen4exp()
    with torch.no_grad():
        model.lm_head.weight.copy_(model.model.embed_tokens.weight)
        for layer in model.model.layers:
            mixer = layer.linear_attn.out_proj if hasattr(layer, "linear_attn") else layer.self_attn.o_proj
            for w in (mixer.weight, layer.mlp.experts.down_proj, layer.mlp.shared_expert.down_proj.weight):
                w.mul_(alpha)
    return model


@torch.inference_mode()
def reference_qwen4exp_mtp(model, aux, tensors, ids: list[int]) -> torch.Tensor:
    """The head's logits at positions 0..n-2 of `ids`, from transformers' modules."""
    def norm(x, w):  # zero-centred RMS norm
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w)

    x = torch.tensor([ids])
    h = model.model(x).last_hidden_state[:, :-1]  # the streams after the output mixer
    e = model.model.embed_tokens(x[:, 1:])
    u = (norm(e, tensors["mtp.pre_fc_norm_embedding.weight"]) @ tensors["mtp.fc_embedding.weight"].T
         + norm(h, tensors["mtp.pre_fc_norm_hidden.weight"]) @ tensors["mtp.fc_hidden.weight"].T)
    g = aux(inputs_embeds=u).last_hidden_state  # u in every stream, the block, hc_head
    return model.lm_head(g)[0].float()


def _with_mtp(model, tensors, d):
    import json

    save_hf(model, d)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "mtp.safetensors"))
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": 1}))
    convert_hf_to_gguf(d, d.with_suffix(".gguf"))
    return {"safetensors": d, "gguf": d.with_suffix(".gguf")}


@pytest.fixture(scope="module")
def q4(tmp_path_factory):
    torch.manual_seed(0)
    model = tiny_qwen4exp()
    d = tmp_path_factory.mktemp("qwen4exp_mtp")
    aux, tensors = tiny_qwen4exp_mtp(model)
    echo = echo_trunk()
    _, copying = tiny_qwen4exp_mtp(echo, copy=True)
    return model, aux, tensors, _with_mtp(model, tensors, d / "random"), _with_mtp(echo, copying, d / "copy")


def q4_prompts():
    return [eos_prompt(40, seed=21), eos_prompt(7, seed=22)]  # 40 > the 16-token QSA budget


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_qwen4exp_mtp_head_matches_reference(q4, fmt):
    model, aux, tensors, paths, _ = q4
    engine = _engine(paths[fmt])
    head = engine.model.mtp
    assert head is not None and engine.drafting
    ids = q4_prompts()[0]
    with torch.inference_mode():
        _, h = engine.model(torch.tensor([ids]), engine.model.new_cache(1), hidden=True)
        got, _ = head(torch.tensor([ids[1:]]), h[:, :-1], head.new_cache(1))
    diff = (got[0] - reference_qwen4exp_mtp(model, aux, tensors, ids)).abs().max().item()
    assert diff < 1e-4, diff
    # the trunk's logits are those of the file without the head
    assert (engine.logits(ids) - hf_logits(model, ids)).abs().max().item() < 1e-4


@pytest.mark.parametrize("head", ["random", "copy"])
def test_qwen4exp_greedy_draft_on_equals_draft_off(q4, head):
    *_, random_paths, copy_paths = q4
    path = (random_paths if head == "random" else copy_paths)["gguf"]
    engine = _engine(path)
    accepted = rejected = 0
    for k in (1, 2, 3):
        engine.options.draft_tokens = k
        for ids in q4_prompts():
            assert engine.generate(ids, N_OUT, stop_at_eos=False) == _plain(path, tuple(ids), N_OUT)
            d = engine.stats["draft"]
            assert d["draft_tokens"] == k and d["rounds"] > 0
            accepted += d["accepted"]
            rejected += d["drafted"] - d["accepted"]
    assert rejected > 0
    if head == "copy":
        assert accepted > 0  # both paths ran with the real head


def test_qwen4exp_batch_drafts_equal_each_prompt_alone(q4):
    """Every row of a batch drafts (the copying head keeps some drafts): the per-row rollback of
    the n-gram context, PLE conv window, DeltaNet states and QSA caches keeps each row exact."""
    *_, copy_paths = q4
    path = copy_paths["gguf"]
    engine = _engine(path)
    engine.options.draft_tokens = 2
    prompts = q4_prompts() + [eos_prompt(13, seed=23)]
    assert engine.generate(prompts, N_OUT, stop_at_eos=False) == [_plain(path, tuple(p), N_OUT) for p in prompts]
    d = engine.stats["draft"]
    assert d["passes"] < d["rounds"] and 0 < d["accepted"] < d["drafted"]


def test_qwen4exp_caches_after_speculation_equal_plain_run(q4):
    """Rejections at every draft position, then the n-gram context, the PLE conv window, the GDN
    states and the QSA caches are those of plain decoding."""
    *_, paths, _ = q4
    engine = _engine(paths["gguf"])
    ids = q4_prompts()[0]
    plain = _plain(paths["gguf"], tuple(ids), N_OUT)
    k = 3
    head = Oracle(ids, plain, schedule(k, N_OUT, [0, 2, 1, 3]), vocab=Q4_VOCAB)
    cache = engine.model.new_cache(1)
    out, stats = _run(engine, ids, head, N_OUT, cache=cache, k=k)
    assert out == plain and 0 < stats.accepted < stats.drafted
    assert all(stats.drafted_at[i] > stats.accepted_at[i] for i in range(k))
    ref = engine.model.new_cache(1)
    steps = generate_step(engine.model, [ids], GREEDY, ref)
    assert [int(next(steps)) for _ in range(N_OUT)] == plain
    n = len(ids) + N_OUT - 1
    assert cache.lengths.tolist() == ref.lengths.tolist() == [n]
    seen = set()
    for c, r in zip(cache.layers, ref.layers):
        if isinstance(c, LayerCache):
            assert torch.equal(c.ple.context, r.ple.context)
            assert (c.ple.conv - r.ple.conv).abs().max().item() <= 1e-5 * r.ple.conv.abs().max().item()
            c, r = c.mixer, r.mixer
            seen.add("ple")
        if isinstance(c, GDNCache):
            for a, b in ((c.conv, r.conv), (c.state, r.state)):
                assert (a - b).abs().max().item() <= 1e-5 * b.abs().max().item()
            seen.add("gdn")
        else:
            assert isinstance(c, QSACache)
            torch.testing.assert_close(c.k[:, :, :n], r.k[:, :, :n], atol=1e-4, rtol=1e-4)  # fp32 rounding
            torch.testing.assert_close(c.ik[:, :n], r.ik[:, :n], atol=1e-4, rtol=1e-4)
            seen.add("qsa")
    assert seen == {"ple", "gdn", "qsa"}
