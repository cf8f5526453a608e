"""Dense weights stay in their stored blocks: after load no float copy of a quantized matrix is kept.

One synthetic file per architecture (`strata synth`, IQ2_XS mix, full widths, tiny vocabulary, few
experts): every float tensor the loaded model holds is collected, and none may look like a
dequantized copy of a quantized matrix of the file or of a row group of it: as many values, or the
same row width and at least a quarter of its values.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from strata import kernels, synth
from strata.loader import load_model
from strata.models.linear import Embedding, Linear
from strata.formats.weights import FLOAT_TYPES, QTensor

pytestmark = pytest.mark.skipif(not kernels.available(), reason="CPU kernels unavailable: quantized types widen")


def float_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every float tensor reachable from the model's modules: parameters, buffers, attributes,
    `Linear`/`Embedding` weights, and tensors in lists, tuples and dicts."""
    found: dict[int, torch.Tensor] = {}

    def visit(value, depth=0):
        if isinstance(value, torch.Tensor):
            if value.is_floating_point():
                found[id(value)] = value
        elif isinstance(value, (Linear, Embedding)):
            visit(value.weight)
        elif isinstance(value, QTensor) or depth > 2:
            return
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v, depth + 1)
        elif isinstance(value, dict):
            for v in value.values():
                visit(v, depth + 1)

    for m in model.modules():
        for v in vars(m).values():
            visit(v)
        for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)):
            visit(t)
    return list(found.values())


@pytest.mark.parametrize("like,layers", [("qwen3-30b-a3b", 1), ("qwen3-next-80b", 1), ("qwen4exp", 2)])
def test_no_float_copy_of_a_quantized_matrix(tmp_path, like, layers):
    path = synth.write(tmp_path / f"{like}.gguf", like, layers, "IQ2_XS", vocab=512, experts=4)
    loaded = load_model(path)
    file = loaded.source.file
    quantized = {name: t.shape for name, t in file.tensors.items()
                 if t.qtype not in FLOAT_TYPES and len(t.shape) >= 2 and "_exps" not in name
                 and not name.startswith("per_layer_token_embd")}
    assert quantized, "the file should hold quantized dense matrices"
    held = [t for t in float_tensors(loaded.model) if t.numel() >= 1024]

    def copied(shape) -> bool:
        n = math.prod(shape)
        return any(t.numel() == n or (t.ndim >= 2 and t.shape[-1] == shape[-1] and 4 * t.numel() >= n)
                   for t in held)

    copies = sorted(name for name, shape in quantized.items() if copied(shape))
    assert not copies, f"float copies of quantized matrices kept after load: {copies}"
