"""FP8 (E4M3, "fn" variant: no infinities, 0x7F/0xFF are NaN) weights from safetensors checkpoints.

GGUF 0.19 has no FP8 tensor type, but DeepSeek-V3/R1 and Qwen3 FP8 checkpoints store weights as
float8_e4m3fn with a float32 `weight_scale_inv` per 128x128 tile (despite the name, the stored
value is *multiplied* in). Decoding goes through a 256-entry table built from the bit layout, so
it does not depend on the device supporting float8 arithmetic.
"""

from __future__ import annotations

import torch

from strata.errors import StrataError
from strata.quant.base import table


def _e4m3_table() -> torch.Tensor:
    """float32 [256]: the value of every E4M3FN byte."""
    x = torch.arange(256, dtype=torch.int32)
    sign = torch.where((x & 0x80) != 0, -1.0, 1.0)
    exp = (x >> 3) & 0xF
    man = (x & 0x7).to(torch.float32)
    pow2 = ((exp - 7 + 127).clamp(min=1) << 23).view(torch.float32)  # 2^(exp-7), exp >= 1
    mag = torch.where(exp == 0, man * 2.0**-9, (1.0 + man / 8.0) * pow2)
    val = sign * mag
    return torch.where((x & 0x7F) == 0x7F, float("nan"), val).to(torch.float32)


def fp8_e4m3_to_float32(
    raw: torch.Tensor,
    scale: torch.Tensor | float | None = None,
    block_size: tuple[int, int] = (128, 128),
) -> torch.Tensor:
    """Decode an FP8 E4M3FN weight and apply its block-wise scale.

    raw: uint8 (or float8_e4m3fn) tensor, typically [out_features, in_features].
    scale: None, a scalar / 0-d tensor (per-tensor scale), or for a 2-D weight a
        [ceil(rows / block_size[0]), ceil(cols / block_size[1])] tensor, one factor per tile
        (edge tiles may be partial), as `weight_scale_inv` is stored.
    Returns float32 of raw's shape: value * scale, one rounding, like the DeepSeek reference.
    """
    if raw.dtype == torch.float8_e4m3fn:
        raw = raw.view(torch.uint8)
    if raw.dtype != torch.uint8:
        raise StrataError(f"FP8 weight has dtype {raw.dtype}, expected uint8 or float8_e4m3fn")
    lut = table("e4m3fn", _e4m3_table, raw.device)
    out = lut[raw.long()]  # same shape as raw
    if scale is None:
        return out
    s = torch.as_tensor(scale, dtype=torch.float32, device=raw.device)
    if s.numel() == 1:
        return out * s.reshape(())
    if raw.dim() != 2 or s.dim() != 2:
        raise StrataError(
            f"FP8 block scale of shape {tuple(s.shape)} does not fit a weight of shape {tuple(raw.shape)}",
            "block-wise scales need a 2-D weight and a 2-D scale",
        )
    rows, cols = raw.shape
    br, bc = block_size
    want = (-(-rows // br), -(-cols // bc))
    if tuple(s.shape) != want:
        raise StrataError(
            f"FP8 block scale has shape {tuple(s.shape)}, expected {want} for a {rows}x{cols} weight "
            f"in {br}x{bc} tiles",
            "check weight_block_size in the model config",
        )
    # [R, C] tiles -> [R*br, C*bc] per-element factors, cropped to the weight
    full = s.repeat_interleave(br, dim=0)[:rows].repeat_interleave(bc, dim=1)[:, :cols]
    return out * full
