"""A row's RMS normalisation and rope in one launch (`ref.norm_rope`'s contract): the norms and rotations around
attention's projections, each of which is otherwise 6-12 small PyTorch kernels.

    x        [..., D] rows (the last axis normalised and rotated), tokens first: x viewed [T, HEADS, D], any token
             and head strides (a slice of a wider product's rows is read in place)
    cos, sin [T, R]   the rope of each token (None: no rotation); the trailing 2R channels rotate as pairs (2i, 2i+1)
    weight   [D] fp32 (a weighted RMSNorm) or None (the unweighted per-head RMS); eps None: no normalisation

A program takes one row, or a few where a launch has many (`rows_per_program`), in registers in fp32. The roundings
follow the reference's: the weighted norm casts weight * x / rms once to x's dtype; the unweighted one multiplies x
by the factor rounded to x's dtype; the rotation starts from the normalised values in x's dtype and rounds once.
fp8_nope > 0 (the attention's fp8 cache) then rounds the row's first fp8_nope channels through e4m3 codes in blocks
of 64 as `ref.fp8_kv_round` does (`fp8_kv_blocks`, which the compressor's packed entries and the attention's reads
of them share). `norm_ropes` takes the rows of two calls in one launch (q_norm's and kv_norm's: one product's two
slices), each call with its own compile-time shape.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from .host import has_pdl, num_sms
from .policy import next_pow2

NORM_ROPE_ROWS = 8             # the most rows a program takes (`rows_per_program`; docs/tuning.md#norm-rope-rows)
ROWS_PROGRAMS_PER_SM = 4       # ... while at least this many programs an SM remain


class Shape(NamedTuple):
    """The launch's compile-time values (one constexpr)."""
    D: int
    BD: int                    # D rounded up to a power of two
    NORM: int                  # 0 none, 1 unweighted RMS, 2 weighted RMSNorm
    HALF_ROPE: int             # rotated pairs (0: none)
    INVERSE: bool
    FP8_NOPE: int              # leading channels rounded through fp8 codes (0: none)
    PDL: bool                  # let the next launch start now (`host.has_pdl`): a decode GEMV under PDL waits for
                               # this one before it reads anything, and meanwhile L2-prefetches its weights
    ROWS: int                  # rows a program (`rows_per_program`)


@triton.jit
def e4m3_codes(v):
    """fp32 values with |v| <= 448 -> their fp8 e4m3 codes (uint8), rounded to nearest even as torch's conversion and
    the hardware's round, by integer ops (Triton's interpreter converts some powers of two wrongly)."""
    b = v.to(tl.int32, bitcast=True)
    sign = (b >> 24) & 0x80
    a = b & 0x7FFFFFFF
    r = a + 0x7FFFF + ((a >> 20) & 1)                    # the fp32 mantissa rounded to 3 bits, nearest even
    normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)  # e4m3's exponent bias 7 against fp32's 127
    f = a.to(tl.float32, bitcast=True) * 512.0           # below 2^-6: the code is |v| / 2^-9 rounded, nearest even
    small = ((f + 8388608.0) - 8388608.0).to(tl.int32)
    return (tl.where(a < 0x3C800000, small, normal) | sign).to(tl.uint8)


@triton.jit
def bf16_bits(v):
    """fp32 values -> the bits of their bf16 rounding (nearest even) in the high half of an int32, by integer ops
    (Triton's interpreter truncates instead)."""
    b = v.to(tl.int32, bitcast=True)
    return (b + 0x7FFF + ((b >> 16) & 1)) & -65536


@triton.jit
def fp8_kv_blocks(x, NOPE: tl.constexpr, BD: tl.constexpr):
    """A row x fp32 [BD] (BD a multiple of 64) -> (its e4m3 codes uint8 [BD], each channel's scale fp32 [BD], each
    64-channel block's biased exponent int32 [BD // 64]) as `ref.fp8_kv_pack`: a block's scale is
    2^ceil(log2(max(amax, 1e-4) / 448)) over its channels below NOPE; channels from NOPE on get codes of no use."""
    xs = tl.reshape(x, [BD // 64, 64])
    nope = tl.reshape(tl.arange(0, BD), [BD // 64, 64]) < NOPE
    amax = tl.maximum(tl.max(tl.where(nope, tl.abs(xs), 0.0), axis=1), 1e-4)
    bits = (amax * (1.0 / 448.0)).to(tl.int32, bitcast=True)
    exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    inverse = ((254 - exponent) << 23).to(tl.float32, bitcast=True)             # 1 / scale, exactly
    codes = e4m3_codes(tl.minimum(tl.maximum(xs * inverse[:, None], -448.0), 448.0))
    scale = tl.broadcast_to(((exponent << 23).to(tl.float32, bitcast=True))[:, None], [BD // 64, 64])
    return tl.reshape(codes, [BD]), tl.reshape(scale, [BD]), exponent


@triton.jit
def norm_rope_row(v, d, dmask, weight, cos, sin, eps, dtype, D: tl.constexpr, BD: tl.constexpr, NORM: tl.constexpr,
                  HALF_ROPE: tl.constexpr, INVERSE: tl.constexpr):
    """One row v fp32 [BD] (channels d, the first D real) normalised and rotated as the module docstring says, with
    the reference's roundings to `dtype`; cos / sin point at the row's token's HALF_ROPE angles. -> fp32 [BD]."""
    return tl.reshape(norm_rope_rows(tl.reshape(v, [1, BD]), d, dmask, weight, cos, sin, eps, dtype, D, BD, NORM,
                                     HALF_ROPE, INVERSE), [BD])


@triton.jit
def norm_rope_rows(v, d, dmask, weight, cos, sin, eps, dtype, D: tl.constexpr, BD: tl.constexpr, NORM: tl.constexpr,
                   HALF_ROPE: tl.constexpr, INVERSE: tl.constexpr):
    """`norm_rope_row` of each row of v fp32 [R, BD]; cos / sin point at each row's token's angles ([R, 1]) or at
    one token's (a scalar). -> fp32 [R, BD]."""
    R: tl.constexpr = v.shape[0]
    if NORM == 1:
        f = tl.rsqrt(tl.sum(v * v, axis=1) / D + eps).to(dtype).to(tl.float32)
        v = (v * f[:, None]).to(dtype).to(tl.float32)
    if NORM == 2:
        v = v * tl.rsqrt(tl.sum(v * v, axis=1) / D + eps)[:, None]
        v = (tl.load(weight + d, mask=dmask, other=0.0)[None, :] * v).to(dtype).to(tl.float32)
    if HALF_ROPE > 0:
        a, b = tl.split(tl.reshape(v, [R, BD // 2, 2]))
        i = tl.arange(0, BD // 2) - (D // 2 - HALF_ROPE)
        rot = (i >= 0) & (i < HALF_ROPE)
        c = tl.load(cos + i, mask=rot, other=1.0)
        s = tl.load(sin + i, mask=rot, other=0.0)
        if INVERSE:
            s = -s
        v = tl.reshape(tl.join(a * c - b * s, b * c + a * s), [R, BD])
    return v


class Rows(NamedTuple):
    """One set of rows of a launch (a kernel argument): rows r = token * heads + head of x, read at x + token * x_t +
    head * x_r and written at out + r * out_r; cos / sin rows rope_r apart; weight (an fp32 [D], or any tensor
    where NORM is not 2) and eps for the norm."""
    x: torch.Tensor
    out: torch.Tensor
    weight: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    n: int
    x_t: int
    x_r: int
    out_r: int
    rope_r: int
    heads: int
    eps: float


@triton.jit
def _norm_rope_program(J, pid, L: tl.constexpr):
    """Program pid of rows J (`Rows`) with compile-time values L (`Shape`)."""
    D: tl.constexpr = L.D
    BD: tl.constexpr = L.BD
    r = pid.to(tl.int64) * L.ROWS + tl.arange(0, L.ROWS)
    d = tl.arange(0, BD)
    dmask = d < D
    mask = (r < J.n)[:, None] & dmask[None, :]
    dtype = J.out.dtype.element_ty
    t = tl.minimum(r, J.n - 1) // J.heads               # (a row past the last reads its token's angles, unused)
    v = tl.load(J.x + (t * J.x_t + (r - t * J.heads) * J.x_r)[:, None] + d[None, :], mask=mask,
                other=0.0).to(tl.float32)
    v = norm_rope_rows(v, d, dmask, J.weight, (J.cos + t * J.rope_r)[:, None], (J.sin + t * J.rope_r)[:, None], J.eps,
                       dtype, D, BD, L.NORM, L.HALF_ROPE, L.INVERSE)
    if L.FP8_NOPE > 0:        # (one row a program)
        v = tl.reshape(v, [BD]).to(dtype).to(tl.float32)
        codes, scale, _ = fp8_kv_blocks(v, L.FP8_NOPE, BD)
        rope = bf16_bits(v).to(tl.float32, bitcast=True)
        v = tl.reshape(tl.where(d < L.FP8_NOPE, codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale, rope),
                       [1, BD])
    tl.store(J.out + r[:, None] * J.out_r + d[None, :], v.to(dtype), mask=mask)


@triton.jit
def _norm_rope_kernel(A, B, first_b, LA: tl.constexpr, LB: tl.constexpr):
    """Programs below first_b take rows A (`Rows`, compile-time values LA), the rest rows B (LB); LB None: A only.
    With PDL (LA's) the next launch may start first thing."""
    if LA.PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    if LB is None:
        _norm_rope_program(A, pid, LA)
    elif pid < first_b:
        _norm_rope_program(A, pid, LA)
    else:
        _norm_rope_program(B, pid - first_b, LB)


def rows_per_program(rows: int, fp8_nope: int, sms: int) -> int:
    """Rows a program of a launch over `rows` rows takes: the most of 1, 2, 4, 8 that leave at least four programs
    an SM (a program of one short row is mostly launch and latency); one where rows round through fp8."""
    per = 1
    while not fp8_nope and per < NORM_ROPE_ROWS and rows >= 2 * per * ROWS_PROGRAMS_PER_SM * sms:
        per *= 2
    return per


def _rows(x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, weight: torch.Tensor | None = None,
          eps: float | None = None, inverse: bool = False, fp8_nope: int = 0):
    """-> (Rows, Shape, programs, warps, out) of one `norm_rope` call; programs 0 (Rows and Shape None): no rows."""
    D = x.shape[-1]
    if D % 2:
        raise ValueError(f"norm_rope needs an even last axis, got {tuple(x.shape)}")
    if fp8_nope and (D % 64 or D & (D - 1) or not 0 < fp8_nope <= D):
        raise ValueError(f"norm_rope: fp8 rounding needs a power-of-two last axis of at least 64 channels and "
                         f"0 < fp8_nope <= it; got {tuple(x.shape)}, fp8_nope={fp8_nope}")
    n = x.numel() // D
    out = torch.empty(n, D, dtype=x.dtype, device=x.device)
    if n == 0:
        return None, None, 0, 0, out.view(x.shape)
    half = 0 if cos is None else cos.shape[-1]
    tokens = 1 if cos is None else cos.reshape(-1, half).shape[0]
    heads = n // tokens
    if cos is not None and heads * tokens != n:
        raise ValueError(f"norm_rope: cos {tuple(cos.shape)} does not match x {tuple(x.shape)}")
    rows = x.reshape(tokens, heads, D)          # a view where x's strides allow (a token's heads one slice of a row)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    cos_r = rows if cos is None else cos.reshape(-1, half).contiguous()
    sin_r = rows if sin is None else sin.reshape(-1, half).contiguous()
    norm = 0 if eps is None else (1 if weight is None else 2)
    bd = next_pow2(D)
    per = rows_per_program(n, fp8_nope, num_sms(x.device))
    job = Rows(rows, out, weight if weight is not None else rows, cos_r, sin_r, n, rows.stride(0), rows.stride(1),
               out.stride(0), cos_r.stride(0), heads, eps if eps is not None else 0.0)
    shape = Shape(D, bd, norm, half, inverse, fp8_nope, has_pdl(x.device), per)
    return job, shape, triton.cdiv(n, per), 8 if bd >= 4096 else 4, out.view(x.shape)


def norm_rope(x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, weight: torch.Tensor | None = None,
              eps: float | None = None, inverse: bool = False, fp8_nope: int = 0) -> torch.Tensor:
    """x normalised (eps given: by `weight`'s RMSNorm, or the unweighted RMS without one) and rotated (cos / sin
    given: [..., R] for x [..., D] or [..., H, D]), its first fp8_nope channels rounded through fp8; module
    docstring."""
    job, shape, programs, warps, out = _rows(x, cos, sin, weight, eps, inverse, fp8_nope)
    if programs:
        _norm_rope_kernel[(programs,)](job, job, programs, shape, None, num_warps=warps)
    return out


def norm_ropes(*calls: tuple) -> tuple[torch.Tensor, ...]:
    """`norm_rope(*call)` of each call (its arguments as a tuple), two calls a launch: the rows of two tensors that
    one product made (wq_a's and wkv's) in one launch instead of two."""
    outs = []
    for i in range(0, len(calls), 2):
        pair = [_rows(*call) for call in calls[i:i + 2]]
        live = [p for p in pair if p[2]]
        if len(live) == 2:
            (a, la, pa, wa, _), (b, lb, pb, wb, _) = live
            _norm_rope_kernel[(pa + pb,)](a, b, pa, la, lb, num_warps=max(wa, wb))
        elif live:
            a, la, pa, wa, _ = live[0]
            _norm_rope_kernel[(pa,)](a, a, pa, la, None, num_warps=wa)
        outs += [p[4] for p in pair]
    return tuple(outs)
