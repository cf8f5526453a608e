"""Convert a Hugging Face checkpoint to GGUF in llama.cpp's layout, through the same name
table and layout fixes the HF loader uses.
"""

from __future__ import annotations

from pathlib import Path

import gguf

from strata.formats.checkpoint import open_config
from strata.gguf.writer import write_gguf

F32 = gguf.GGMLQuantizationType.F32


def convert_hf_to_gguf(hf_dir: str | Path, out: str | Path,
                       dense_type: gguf.GGMLQuantizationType = F32,
                       expert_type: gguf.GGMLQuantizationType = F32) -> Path:
    """Norms, routers and 1-D tensors stay F32 as llama.cpp keeps them."""
    arch, config, source, _ = open_config(hf_dir)
    meta = arch.gguf_metadata(config)

    def tensors():
        for name in source.names():
            t = source.get(name).dequantize()
            qtype = expert_type if "_exps" in name else dense_type
            whole_blocks = t.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0
            if t.ndim == 1 or "ffn_gate_inp" in name or "norm" in name or not whole_blocks:
                qtype = F32  # llama.cpp keeps these in F32 too (e.g. ssm_conv1d rows of 4)
            yield name, t, qtype

    rope_factors = arch.rope_factors(config) if hasattr(arch, "rope_factors") else None
    extra = [("rope_freqs.weight", rope_factors, F32)] if rope_factors is not None else []
    return write_gguf(out, arch.ARCH, meta, list(tensors()) + extra)
