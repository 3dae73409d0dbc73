"""A row's RMS normalisation and rope in one launch (`ref.norm_rope`'s contract): the norms and rotations around
attention's projections, each of which is otherwise 6-12 small PyTorch kernels.

    x        [..., D] rows (the last axis normalised and rotated), tokens first: x viewed [T, HEADS, D]
    cos, sin [T, R]   the rope of each token (None: no rotation); the trailing 2R channels rotate as pairs (2i, 2i+1)
    weight   [D] fp32 (a weighted RMSNorm) or None (the unweighted per-head RMS); eps None: no normalisation

One program per row, the row in registers in fp32. The roundings follow the reference's: the weighted norm casts
weight * x / rms once to x's dtype; the unweighted one multiplies x by the factor rounded to x's dtype; the rotation
starts from the normalised values in x's dtype and rounds once.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .policy import next_pow2


class Shape(NamedTuple):
    """The launch's compile-time values (one constexpr)."""
    D: int
    BD: int                    # D rounded up to a power of two
    NORM: int                  # 0 none, 1 unweighted RMS, 2 weighted RMSNorm
    HALF_ROPE: int             # rotated pairs (0: none)
    INVERSE: bool


@triton.jit
def norm_rope_row(v, d, dmask, weight, cos, sin, eps, dtype, D: tl.constexpr, BD: tl.constexpr, NORM: tl.constexpr,
                  HALF_ROPE: tl.constexpr, INVERSE: tl.constexpr):
    """One row v fp32 [BD] (channels d, the first D real) normalised and rotated as the module docstring says, with
    the reference's roundings to `dtype`; cos / sin point at the row's token's HALF_ROPE angles. -> fp32 [BD]."""
    if NORM == 1:
        f = tl.rsqrt(tl.sum(v * v, axis=0) / D + eps).to(dtype).to(tl.float32)
        v = (v * f).to(dtype).to(tl.float32)
    if NORM == 2:
        v = v * tl.rsqrt(tl.sum(v * v, axis=0) / D + eps)
        v = (tl.load(weight + d, mask=dmask, other=0.0) * v).to(dtype).to(tl.float32)
    if HALF_ROPE > 0:
        a, b = tl.split(tl.reshape(v, [BD // 2, 2]))
        i = tl.arange(0, BD // 2) - (D // 2 - HALF_ROPE)
        rot = (i >= 0) & (i < HALF_ROPE)
        c = tl.load(cos + i, mask=rot, other=1.0)
        s = tl.load(sin + i, mask=rot, other=0.0)
        if INVERSE:
            s = -s
        v = tl.reshape(tl.join(a * c - b * s, b * c + a * s), [BD])
    return v


@triton.jit
def _norm_rope_kernel(x, out, weight, cos, sin, x_r, out_r, rope_r, heads, eps, L: tl.constexpr):
    D: tl.constexpr = L.D
    BD: tl.constexpr = L.BD
    r = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BD)
    dmask = d < D
    dtype = out.dtype.element_ty
    v = tl.load(x + r * x_r + d, mask=dmask, other=0.0).to(tl.float32)
    t = r // heads
    v = norm_rope_row(v, d, dmask, weight, cos + t * rope_r, sin + t * rope_r, eps, dtype, D, BD, L.NORM,
                      L.HALF_ROPE, L.INVERSE)
    tl.store(out + r * out_r + d, v.to(dtype), mask=dmask)


def norm_rope(x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, weight: torch.Tensor | None = None,
              eps: float | None = None, inverse: bool = False) -> torch.Tensor:
    """x normalised (eps given: by `weight`'s RMSNorm, or the unweighted RMS without one) and rotated (cos / sin
    given: [..., R] for x [..., D] or [..., H, D]); module docstring."""
    D = x.shape[-1]
    if D % 2:
        raise ValueError(f"norm_rope needs an even last axis, got {tuple(x.shape)}")
    rows = x.reshape(-1, D)
    out = torch.empty_like(rows)
    if rows.shape[0] == 0:
        return out.view(x.shape)
    half = 0 if cos is None else cos.shape[-1]
    tokens = 1 if cos is None else cos.reshape(-1, half).shape[0]
    heads = rows.shape[0] // tokens
    if cos is not None and heads * tokens != rows.shape[0]:
        raise ValueError(f"norm_rope: cos {tuple(cos.shape)} does not match x {tuple(x.shape)}")
    cos_r = rows if cos is None else cos.reshape(-1, half).contiguous()
    sin_r = rows if sin is None else sin.reshape(-1, half).contiguous()
    rows = rows.contiguous()
    norm = 0 if eps is None else (1 if weight is None else 2)
    bd = next_pow2(D)
    shape = Shape(D, bd, norm, half, inverse)
    _norm_rope_kernel[(rows.shape[0],)](rows, out, weight if weight is not None else rows, cos_r, sin_r,
                                        rows.stride(0), out.stride(0), cos_r.stride(0), heads,
                                        eps if eps is not None else 0.0, shape, num_warps=8 if bd >= 4096 else 4)
    return out.view(x.shape)
