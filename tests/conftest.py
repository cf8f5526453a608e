import os
import sys
from pathlib import Path

# int16 activations for the suite (error ~3e-5; models are checked against transformers); the
# 8-bit ones (the engine's default where ggml is installed) have their own tests in test_kernels.py.
os.environ.setdefault("STRATA_ACTIVATIONS", "int16")

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models on a shared two-core machine: two threads spin against each other, one is
    several times faster. Modules opt in with `pytestmark = pytest.mark.usefixtures(...)`."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
