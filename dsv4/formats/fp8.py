"""FP8 block weights: E4M3 elements with one scale per 128x128 tile.

scale has shape [ceil(N/128), ceil(K/128)] and is UE8M0 (float8_e8m0fnu, DeepSeek's releases) or float32
(the -Base checkpoints). It is stored as `.scale` (DeepSeek) or `.weight_scale_inv` (transformers); both
names mean the same multiplier: W = fp8 * scale[n // 128, k // 128].
"""

from __future__ import annotations

import torch

from .scales import E4M3_MAX, UE8M0_DTYPE, float_to_ue8m0, pow2_ceil, to_e4m3_saturating

FP8_BLOCK = 128


def _tiles(n: int, k: int, block: int) -> tuple[int, int]:
    return -(-n // block), -(-k // block)


def expand_block_scale(scale: torch.Tensor, n: int, k: int, block: int = FP8_BLOCK) -> torch.Tensor:
    """[..., ceil(N/b), ceil(K/b)] -> fp32 [..., N, K] (each tile's scale repeated over its elements)."""
    return scale.float().repeat_interleave(block, -2)[..., :n, :].repeat_interleave(block, -1)[..., :k]


def quantize_fp8_block(
    w: torch.Tensor, scale_dtype: torch.dtype = UE8M0_DTYPE, block: int = FP8_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] float -> (weight float8_e4m3fn [..., N, K], scale [..., ceil(N/b), ceil(K/b)]).

    UE8M0 scales are 2^ceil(log2(tileamax / 448)); float32 scales are tileamax / 448. Empty tiles get 1.0.
    """
    w = w.float()
    if not bool(torch.isfinite(w).all()):
        raise ValueError("quantize_fp8_block: input has NaN or Inf")
    n, k = w.shape[-2:]
    tn, tk = _tiles(n, k, block)
    padded = torch.nn.functional.pad(w, (0, tk * block - k, 0, tn * block - n))
    tiles = padded.reshape(*w.shape[:-2], tn, block, tk, block)
    amax = tiles.abs().amax(dim=(-3, -1))
    if scale_dtype == UE8M0_DTYPE:
        scale = torch.where(amax > 0, pow2_ceil(amax / E4M3_MAX), torch.ones_like(amax))
        stored = float_to_ue8m0(scale)
    elif scale_dtype == torch.float32:
        scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        stored = scale
    else:
        raise ValueError(f"FP8 block scales are float8_e8m0fnu or float32, not {scale_dtype}")
    q = to_e4m3_saturating(w / expand_block_scale(scale, n, k, block))
    return q, stored


def dequantize_fp8_block(
    weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32, block: int = FP8_BLOCK
) -> torch.Tensor:
    if weight.dtype != torch.float8_e4m3fn:
        raise TypeError(f"FP8 block weight must be float8_e4m3fn, got {weight.dtype}")
    n, k = weight.shape[-2:]
    if tuple(scale.shape[-2:]) != _tiles(n, k, block):
        raise ValueError(f"FP8 scale grid {tuple(scale.shape[-2:])} does not match weight {n}x{k} "
                         f"with {block}x{block} blocks (expected {_tiles(n, k, block)})")
    return (weight.float() * expand_block_scale(scale, n, k, block)).to(dtype)
