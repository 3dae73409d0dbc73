"""FP8 block weights: E4M3 elements with one scale per 128x128 tile.

scale has shape [ceil(N/128), ceil(K/128)] and is UE8M0 (float8_e8m0fnu, DeepSeek's releases) or float32
(the -Base checkpoints). It is stored as `.scale` (DeepSeek) or `.weight_scale_inv` (transformers); both
names mean the same multiplier: W = fp8 * scale[n // 128, k // 128].
"""

from __future__ import annotations

import torch

from ._checks import require_dtype, require_finite, require_float
from .scales import E4M3_MAX, UE8M0_DTYPE, float_to_ue8m0, pow2_ceil, to_e4m3_saturating, ue8m0_to_float

FP8_BLOCK = 128
FP8_SCALE_DTYPES = (UE8M0_DTYPE, torch.float32)


def _tiles(n: int, k: int, block: int) -> tuple[int, int]:
    return -(-n // block), -(-k // block)


def _check_2d(x: torch.Tensor, what: str) -> tuple[int, int]:
    if x.dim() < 2:
        raise ValueError(f"{what}: expected [..., N, K], got shape {tuple(x.shape)}")
    return x.shape[-2], x.shape[-1]


def expand_block_scale(scale: torch.Tensor, n: int, k: int, block: int = FP8_BLOCK) -> torch.Tensor:
    """[..., ceil(N/b), ceil(K/b)] UE8M0 or fp32 -> fp32 [..., N, K] (each tile's scale over its elements)."""
    require_dtype(scale, FP8_SCALE_DTYPES, "FP8 block scale")
    if scale.dim() < 2 or tuple(scale.shape[-2:]) != _tiles(n, k, block):
        raise ValueError(f"FP8 block scale grid {tuple(scale.shape)} does not match a {n}x{k} weight with "
                         f"{block}x{block} blocks (expected [..., {_tiles(n, k, block)[0]}, {_tiles(n, k, block)[1]}])")
    s = ue8m0_to_float(scale) if scale.dtype == UE8M0_DTYPE else scale
    if not bool((torch.isfinite(s) & (s > 0)).all()):
        raise ValueError("FP8 block scale must be positive and finite")
    return s.repeat_interleave(block, -2)[..., :n, :].repeat_interleave(block, -1)[..., :k]


def quantize_fp8_block(
    w: torch.Tensor, scale_dtype: torch.dtype = UE8M0_DTYPE, block: int = FP8_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] float -> (weight float8_e4m3fn [..., N, K], scale [..., ceil(N/b), ceil(K/b)]).

    UE8M0 scales are 2^ceil(log2(tileamax / 448)); float32 scales are tileamax / 448. All-zero tiles get 1.0.
    Elements are w / scale rounded to nearest even (|w / scale| <= 448 up to fp32 rounding, saturated).
    """
    require_float(w, "quantize_fp8_block")
    n, k = _check_2d(w, "quantize_fp8_block")
    require_finite(w, "quantize_fp8_block")
    if scale_dtype not in FP8_SCALE_DTYPES:
        raise ValueError(f"quantize_fp8_block: FP8 block scales are {FP8_SCALE_DTYPES}, not {scale_dtype}")
    w = w.float()
    tn, tk = _tiles(n, k, block)
    padded = torch.nn.functional.pad(w, (0, tk * block - k, 0, tn * block - n))
    amax = padded.reshape(*w.shape[:-2], tn, block, tk, block).abs().amax(dim=(-3, -1))
    # Both rules floor the scale at 2^-126 so that a tile of denormal values cannot get a zero scale.
    scale = (amax / E4M3_MAX).clamp(min=2.0 ** -126) if scale_dtype == torch.float32 else pow2_ceil(amax / E4M3_MAX)
    scale = torch.where(amax > 0, scale, torch.ones_like(scale))
    stored = scale if scale_dtype == torch.float32 else float_to_ue8m0(scale)
    return to_e4m3_saturating(w / expand_block_scale(stored, n, k, block)), stored


def dequantize_fp8_block(
    weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32, block: int = FP8_BLOCK
) -> torch.Tensor:
    """E4M3 [..., N, K] times its tile scale -> [..., N, K] (exact in fp32 for UE8M0 scales)."""
    require_dtype(weight, (torch.float8_e4m3fn,), "dequantize_fp8_block: weight")
    n, k = _check_2d(weight, "dequantize_fp8_block")
    values = weight.float()
    if bool(torch.isnan(values).any()):
        raise ValueError("dequantize_fp8_block: weight holds E4M3 NaN bytes (0x7F/0xFF)")
    return (values * expand_block_scale(scale, n, k, block)).to(dtype)
