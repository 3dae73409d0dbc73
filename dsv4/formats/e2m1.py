"""E2M1 (FP4) element codes: encode, decode, and packing two codes per byte.

Code layout: bit 3 = sign, bits 2..0 index the magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}; there is no Inf/NaN.
Packing is along K (the last, contiguous axis): byte j holds element 2j in its low nibble and 2j+1 in its
high nibble. Checkpoints store packed bytes as U8 (ModelOpt), I8 (DeepSeek) or F4 (float4_e2m1fn_x2); all
three are the same bytes and are handled here as uint8 views.
"""

from __future__ import annotations

import torch

E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Midpoints between consecutive magnitudes. A tie rounds to the neighbour with the even code: down at
# 0.25, 1.25, 2.5, 5 (lower code even), up at 0.75, 1.75, 3.5 (lower code odd).
_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_UP = (False, True, False, True, False, True, False)
PACKED_DTYPES = (torch.uint8, torch.int8, torch.float4_e2m1fn_x2)


def e2m1_lut(device: torch.device | str | None = None) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest E2M1 (ties to even code), saturating at ±6. Returns uint8 codes 0..15.

    A negative input that rounds to zero keeps its sign bit (code 8), as ModelOpt does; -0.0 gives code 0.
    NaN has no E2M1 code: callers must reject non-finite input before encoding.
    """
    a = x.abs().float()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for bound, tie_up in zip(_BOUNDS, _TIE_UP):
        code += (a >= bound if tie_up else a > bound).to(torch.uint8)
    return code | ((x < 0).to(torch.uint8) << 3)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 -> float32 values."""
    return e2m1_lut(codes.device)[codes.long()]


def as_packed_u8(packed: torch.Tensor) -> torch.Tensor:
    """View packed FP4 bytes stored as uint8, int8 or float4_e2m1fn_x2 as uint8 (no copy)."""
    if packed.dtype not in PACKED_DTYPES:
        raise TypeError(f"packed FP4 must be one of {PACKED_DTYPES}, got {packed.dtype}")
    return packed if packed.dtype == torch.uint8 else packed.view(torch.uint8)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] uint8 codes -> [..., K/2] uint8 bytes, lower K index in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number of FP4 codes along K ({codes.shape[-1]})")
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] packed bytes (uint8 / int8 / float4_e2m1fn_x2) -> [..., K] uint8 codes."""
    b = as_packed_u8(packed)
    return torch.stack((b & 0x0F, b >> 4), dim=-1).flatten(-2)


def dequantize_e2m1_blocks(packed: torch.Tensor, block_scale: torch.Tensor, block: int) -> torch.Tensor:
    """Packed [..., N, K/2] codes times a per-`block` scale [..., N, K/block] (any float dtype) -> fp32 [..., N, K]."""
    values = decode_e2m1(unpack_e2m1(packed))
    k = values.shape[-1]
    if block_scale.shape[-1] * block != k:
        raise ValueError(f"scale has {block_scale.shape[-1]} blocks of {block} along K, weight has K={k}")
    scale = block_scale.float().repeat_interleave(block, dim=-1)
    return values * scale
