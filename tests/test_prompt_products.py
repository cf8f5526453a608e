"""A prompt's quantized products take the prefill (AMX) kernels from their fewest rows; a verify
pass or a decode batch of the same size keeps the decode kernels (each row equal to a one-token step)."""

import pytest
import torch

from strata import kernels
from strata.kernels import _build, prompt
from strata.models.linear import Linear
from strata.runtime import generate
from test_kernels import random_qtensor


@pytest.fixture
def q8x2():
    before = kernels._activations
    kernels.set_activations("q8x2")
    yield
    kernels.set_activations(before)


@pytest.mark.skipif(_build.load() is None, reason="no C kernels on this machine")
def test_a_prompt_of_a_few_rows_takes_the_prefill_product_and_a_verify_pass_does_not(q8x2):
    w = random_qtensor("IQ2_XS", (64, 512), seed=3)
    if not prompt.has_type(w.qtype, own_only=True):
        pytest.skip("no AMX prefill product for IQ2_XS on this CPU")
    lin = Linear(w)
    x = torch.randn(kernels._prompt_min_rows(w.qtype) + 2, 512)  # this CPU's crossover
    decode = kernels.try_qmatmul(x, w)
    assert kernels.try_qmatmul_prompt(x, w) is None  # not a prompt: every path keeps the decode kernels
    assert torch.equal(kernels.qmatmul(x, w), decode)
    with kernels.prompt_batches():
        amx = kernels.try_qmatmul_prompt(x, w)
    assert not torch.equal(decode, amx)  # the two products round differently: which one ran shows
    assert torch.equal(lin(x), decode)  # outside a prompt (a verify pass): the decode kernels
    assert torch.equal(lin(x[:1]), decode[:1])
    with kernels.prompt_batches():
        assert torch.equal(lin(x), amx)
        assert torch.equal(lin(x[:1]), decode[:1])  # one row: no prefill product
    assert not kernels.in_prompt()


def test_prefill_runs_inside_prompt_batches():
    seen = []

    class Model:
        def __call__(self, tokens, cache, n_new=None, last_only=False):
            seen.append(kernels.in_prompt())
            return torch.zeros(tokens.shape[0], 1, 5)

    generate.prefill(Model(), [[1, 2, 3]], cache=None)
    assert seen == [True] and not kernels.in_prompt()
