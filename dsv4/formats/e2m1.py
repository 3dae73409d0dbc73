"""E2M1 (FP4) element codes: encode, decode, and packing two codes per byte.

Code layout: bit 3 = sign, bits 2..0 index the magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}; there is no Inf/NaN.
Packing is along K (the last, contiguous axis): byte j holds element 2j in its low nibble and 2j+1 in its
high nibble. Checkpoints store packed bytes as U8 (ModelOpt), I8 (DeepSeek) or F4 (float4_e2m1fn_x2); all
three are the same bytes: `as_packed_u8` and `view_packed` convert between them without copying.
"""

from __future__ import annotations

import torch

from ._checks import require_dtype, require_float

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
    """Round to nearest E2M1 (ties to even code), saturating at ±6 (±Inf too). Returns uint8 codes 0..15.

    A negative input that rounds to zero keeps its sign bit (code 8), as ModelOpt does; -0.0 gives code 0.
    """
    require_float(x, "encode_e2m1")
    if bool(torch.isnan(x).any()):
        raise ValueError("encode_e2m1: input has NaN (E2M1 has no NaN code)")
    a = x.abs().float()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for bound, tie_up in zip(_BOUNDS, _TIE_UP):
        code += (a >= bound if tie_up else a > bound).to(torch.uint8)
    return code | ((x < 0).to(torch.uint8) << 3)


def _require_codes(codes: torch.Tensor, what: str) -> None:
    require_dtype(codes, (torch.uint8,), what)
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"{what}: E2M1 codes are 0..15, got {int(codes.max())}")


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 -> float32 values."""
    _require_codes(codes, "decode_e2m1")
    return e2m1_lut(codes.device)[codes.long()]


def as_packed_u8(packed: torch.Tensor) -> torch.Tensor:
    """View packed FP4 bytes stored as uint8, int8 or float4_e2m1fn_x2 as uint8 (no copy)."""
    require_dtype(packed, PACKED_DTYPES, "packed FP4")
    return packed if packed.dtype == torch.uint8 else packed.view(torch.uint8)


def view_packed(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """View packed FP4 bytes as `dtype` (uint8, int8 = DeepSeek's I8, float4_e2m1fn_x2 = safetensors F4)."""
    if dtype not in PACKED_DTYPES:
        raise TypeError(f"view_packed: target dtype must be one of {PACKED_DTYPES}, got {dtype}")
    return as_packed_u8(packed).view(dtype)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] uint8 codes -> [..., K/2] uint8 bytes, lower K index in the low nibble."""
    _require_codes(codes, "pack_e2m1")
    if codes.dim() == 0 or codes.shape[-1] % 2:
        raise ValueError(f"pack_e2m1: cannot pack an odd number of FP4 codes along K (shape {tuple(codes.shape)})")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] packed bytes (uint8 / int8 / float4_e2m1fn_x2) -> [..., K] uint8 codes."""
    b = as_packed_u8(packed)
    if b.dim() == 0:
        raise ValueError("unpack_e2m1: packed FP4 needs at least one dimension (K/2)")
    return torch.stack((b & 0x0F, b >> 4), dim=-1).flatten(-2)


def dequantize_e2m1_blocks(packed: torch.Tensor, block_scale: torch.Tensor, block: int) -> torch.Tensor:
    """Packed [..., N, K/2] codes times a float per-`block` scale [..., N, K/block] -> fp32 [..., N, K].

    Exact in fp32 for E4M3 and power-of-two scales: E2M1 values have at most 2 significant bits.
    """
    values = decode_e2m1(unpack_e2m1(packed))
    require_float(block_scale, "block scale")
    want = (*values.shape[:-1], values.shape[-1] // block)
    if values.shape[-1] % block or tuple(block_scale.shape) != want:
        raise ValueError(f"block scale has shape {tuple(block_scale.shape)}; a packed weight of shape "
                         f"{tuple(packed.shape)} (K={values.shape[-1]}) with blocks of {block} needs {want}")
    scale = block_scale.float()
    if not bool(torch.isfinite(scale).all()):
        raise ValueError("block scale has NaN or Inf")
    return (values.reshape(*want, block) * scale.unsqueeze(-1)).reshape(values.shape)
