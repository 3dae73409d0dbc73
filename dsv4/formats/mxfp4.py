"""MXFP4 as DeepSeek ships its routed experts: E2M1 elements with one UE8M0 scale (2^(byte-127)) per 32 along K.

Packed bytes are stored as I8 in DeepSeek's safetensors (low nibble = even element, like NVFP4).
"""

from __future__ import annotations

import torch

from .e2m1 import E2M1_MAX, as_packed_u8, dequantize_e2m1_blocks, encode_e2m1, pack_e2m1
from .scales import UE8M0_DTYPE, float_to_ue8m0, pow2_ceil, ue8m0_to_float

MXFP4_BLOCK = 32


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] float -> (weight uint8 [..., N, K/2], scale float8_e8m0fnu [..., N, K/32]).

    scale = 2^ceil(log2(blockamax / 6)) (DeepSeek's rule; the amax floor keeps all-zero blocks finite),
    so every element fits in ±6 before rounding.
    """
    if w.shape[-1] % MXFP4_BLOCK:
        raise ValueError(f"quantize_mxfp4: K={w.shape[-1]} is not a multiple of {MXFP4_BLOCK}")
    w = w.float()
    if not bool(torch.isfinite(w).all()):
        raise ValueError("quantize_mxfp4: input has NaN or Inf")
    blocks = w.reshape(*w.shape[:-1], -1, MXFP4_BLOCK)
    scale = pow2_ceil(blocks.abs().amax(-1) / E2M1_MAX, floor=2.0 ** -127)
    codes = encode_e2m1((blocks / scale.unsqueeze(-1)).reshape(w.shape))
    return pack_e2m1(codes), float_to_ue8m0(scale)


def dequantize_mxfp4(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return dequantize_e2m1_blocks(weight, ue8m0_to_float(scale), MXFP4_BLOCK).to(dtype)


def mxfp4_to_nvfp4(
    weight: torch.Tensor, scale: torch.Tensor, k_max: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Re-block MXFP4 as NVFP4 without changing a single nibble, or refuse.

    With exponents k_j of the 32-blocks and k_max their maximum (or a larger one shared with a sibling
    tensor, e.g. w1/w3), weight_scale_2 = 2^(k_max-8) and each 16-block's E4M3 scale = 2^(k_j-k_max+8).
    E4M3 holds powers of two from 2^-9 to 2^8, so this is exact iff k_max - k_j <= 17 for every block.
    """
    if scale.dtype not in (UE8M0_DTYPE, torch.uint8):
        raise TypeError(f"MXFP4 scale must be float8_e8m0fnu or uint8, got {scale.dtype}")
    exps = scale.view(torch.uint8).to(torch.int32) - 127
    top = int(exps.max()) if k_max is None else int(k_max)
    if k_max is not None and int(exps.max()) > top:
        raise ValueError(f"mxfp4_to_nvfp4: k_max={top} is below the largest block exponent {int(exps.max())}")
    span = top - int(exps.min())
    if span > 17:
        raise ValueError(f"mxfp4_to_nvfp4: block exponents span {span} > 17 binades; E4M3 block scales "
                         "cannot represent them exactly (refusing a lossy conversion)")
    rel = (exps - (top - 8)).float()
    weight_scale = torch.exp2(rel).repeat_interleave(2, dim=-1).to(torch.float8_e4m3fn)
    weight_scale_2 = torch.tensor(2.0 ** (top - 8), dtype=torch.float32, device=weight.device)
    return as_packed_u8(weight).clone(), weight_scale, weight_scale_2
