"""CUDA graphs for a decode step's dense segments (strata/kernels/gpu/graphs.py), checked on the CPU.

The split is torch.compile's, the capture mode="reduce-overhead"'s; here dynamo runs with its
"eager" backend (the same graphs, no capture), which shows where the step is cut and that the
compiled step computes what the eager one does. Tiny random models with every MoE layer tiered,
as on a GPU, where the resident experts' op would also sit inside a segment.
"""

from __future__ import annotations

import pytest
import torch

import strata
from strata.errors import BadOption
from strata.kernels.gpu import graphs
from test_dtypes import tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")
# bf16, as on a GPU: the CPU's fused float32 decode ops (kernels/decode_ops.py, ctypes calls dynamo
# breaks at) never run on the device, so they are kept out of these steps too
TIERED = dict(pin_experts="ram", experts_cache="0", cpu_threads=1, dtype="bfloat16")
BOUNDARY = "torch.compiler.disable()"  # dynamo's reason for a break at a `graphs.boundary` function


@pytest.fixture(scope="module", params=["mixtral", "qwen3moe", "qwen4exp"])
def model_file(request, tmp_path_factory):
    """(architecture, GGUF path)."""
    return request.param, tiny_checkpoint(request.param, tmp_path_factory)[1]


def test_decode_step_breaks_only_at_its_host_boundaries(model_file):
    """Every graph break of a decode step is a marked boundary (routing read, attention, the tiers'
    bookkeeping) or dynamo resuming right after one: no other host read inside a dense segment."""
    arch, model_file = model_file
    if arch == "qwen4exp":
        pytest.skip("QSA indexer host bookkeeping (its key cache length, which blocks exist) splits further; output checked below")
    engine = strata.load(model_file, **TIERED)
    m = engine.model
    cache = m.new_cache(1)
    with torch.no_grad():
        m(torch.tensor([[3, 4, 5]]), cache, last_only=True)
        graphs.disable_boundaries()  # what DecodeGraphs does before it compiles
        ex = torch._dynamo.explain(m.forward)(torch.tensor([[7]]), cache, last_only=True)
    reasons = [r.reason.splitlines()[0] for r in ex.break_reasons]
    assert reasons and all(BOUNDARY in r or r == "step_unsupported" for r in reasons), reasons
    assert any(BOUNDARY in r for r in reasons)
    n = engine.config.n_layers
    assert ex.graph_count >= n + 1  # at least one dense segment between consecutive layers' boundaries
    engine.close()


def test_compiled_decode_equals_eager_and_prefill_stays_eager(model_file):
    _, model_file = model_file
    ids = [5, 17, 99, 3, 42]
    eager = strata.load(model_file, **TIERED)
    ref_logits, ref_tokens = eager.logits(ids), eager.generate(ids, 4, stop_at_eos=False)
    eager.close()
    engine = strata.load(model_file, **TIERED)
    assert graphs.enable(engine.model, torch.device("cpu"), backend="eager")
    compiled = engine.model.forward
    tokens = engine.generate(ids, 4, stop_at_eos=False)
    assert tokens == ref_tokens
    assert compiled.calls >= 3  # the decode steps after the prompt went through the compiled forward
    assert torch.equal(engine.logits(ids), ref_logits)  # a prompt: eager, the same
    engine.close()


def test_enable_follows_the_setting(model_file):
    _, model_file = model_file
    engine = strata.load(model_file)
    assert not graphs.enable(engine.model, torch.device("cpu"))  # auto: no CUDA here, nothing changes
    assert not graphs.enable(engine.model, torch.device("cpu"), "off")
    with pytest.raises(BadOption, match="--cuda-graphs on needs"):
        graphs.enable(engine.model, torch.device("cpu"), "on")
    with pytest.raises(BadOption, match="--cuda-graphs"):
        strata.load(model_file, cuda_graphs="sometimes")
    assert not isinstance(engine.model.forward, graphs.DecodeGraphs)
    engine.close()


def test_resident_moe_decode_step_reads_no_scalar(tmp_path_factory):
    """A resident MoE model's compiled decode step (bf16, as on a GPU): the CPU's one-call MoE half
    is not considered there, so no host scalar read (`int(step.n_new[0])`) splits each MoE layer."""
    engine = strata.load(tiny_checkpoint("qwen3moe", tmp_path_factory)[1], cpu_threads=1, dtype="bfloat16")
    m = engine.model
    cache = m.new_cache(1)
    with torch.no_grad():
        m(torch.tensor([[3, 4, 5]]), cache, last_only=True)
        graphs.disable_boundaries()
        ex = torch._dynamo.explain(m.forward)(torch.tensor([[7]]), cache, last_only=True)
    reasons = [r.reason.splitlines()[0] for r in ex.break_reasons]
    assert not any("item()" in r for r in reasons), reasons
    engine.close()
