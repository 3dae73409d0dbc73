"""A compressor's step for every sequence of a ragged step in one launch, or two where a sequence may close several
windows (`ref.compress`'s contract).

Inputs (N tokens of B sequences; m = ratio, hd = head_dim, width = 2 hd for CSA's overlapping windows, else hd):
    kv, score        [N, width]             the step's projected rows (score: the gate logits, ape not added)
    ape              [m, width] fp32        added to the score of position p's row: ape[p mod m]
    cos, sin         [N, rope / 2]          the rope at each token's window start
    state            open_kv / open_score [slots, m, width] (position p at row p mod m), prev_kv / prev_score
                     [slots, m, hd] (CSA: the Ca half of the last complete window), entries [pages, E, hd]
    steps            `StepTokens`: per sequence its slot, start, first token and page table

Scores are fp32 from their load on: the step's rows become score + ape[p mod m] as they are read, as the open state
holds them. `_emit`, program (sequence b, window w): window j = start // m + w closes in this step iff
(j + 1) m <= start + n (a condition on the device: the grid is the host's bound on windows per sequence). It pools
the window's rows (those before `start` from the open state, the rest from the step) and, for CSA, the Ca half of
window j - 1 (from prev when that window closed before the step) with one online softmax per channel in fp32, then
RMSNorm and the rope at j m on the trailing channels, and writes entry j to row j mod E of page pages[j // E].
`_keep`, program b, then keeps the Ca half of the last window that closed and the rows of the window left open; it
runs after every entry is pooled, since both read the rows it overwrites: in a second launch, or in the same program
after a barrier where the grid has one window a sequence (`_compress_kernel`). A second compressor of the same step,
ratio and rope (a CSA layer's indexer compressor, `second`) runs in the same launches on a third grid axis: one launch
a decode step for both, which then run side by side.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .attention import sequence_tokens
from .norm_rope import bf16_bits, e4m3_codes, fp8_kv_blocks, norm_rope_row
from .ref import SecondCompressor, kv_row_bytes
from .steps import StepTokens


class Tensors(NamedTuple):
    kv: torch.Tensor
    score: torch.Tensor
    ape: torch.Tensor          # [m, width] fp32
    cos: torch.Tensor
    sin: torch.Tensor
    weight: torch.Tensor       # the norm's fp32 weight [hd]
    open_kv: torch.Tensor
    open_score: torch.Tensor
    prev_kv: torch.Tensor      # (open_kv where there is none: never read)
    prev_score: torch.Tensor
    entries: torch.Tensor
    entry_scales: torch.Tensor  # [pages, E] fp32 with FP8 entries (else a one-element dummy: never touched)


class Strides(NamedTuple):
    kv_t: int
    score_t: int
    rope_t: int
    open_slot: int
    prev_slot: int
    pages_seq: int
    entry_row: int             # elements of an entries row (bytes of a packed row: 584, no multiple of 16, so the
                               # compiler assumes no more alignment of a row than it has)


class Shape(NamedTuple):
    """The launch's compile-time values (one constexpr)."""
    M: int                     # ratio
    HD: int                    # head_dim
    WIDTH: int                 # channels of a row: 2 hd (overlap) or hd
    OVERLAP: bool
    E: int                     # entries per page
    HALF_ROPE: int             # rotated pairs (trailing channels)
    RB: int                    # rows per block
    WB: int                    # channels per block of `_keep`
    FP8: bool                  # entries are fp8 e4m3 codes of entry / scale, the scale in entry_scales
    PACKED_NOPE: int           # entries are packed fp8 K = V rows (`ref.fp8_kv_pack`) with this many fp8 channels


@triton.jit
def _step_scores(T, S, tok, pos, ch, rows, WIDTH: tl.constexpr, M: tl.constexpr):
    """The step's score rows `tok` (positions `pos`) at channels ch, where `rows`, with ape[pos mod M] added (fp32);
    0 elsewhere."""
    s = tl.load(T.score + tok[:, None] * S.score_t + ch[None, :], mask=rows[:, None], other=0.0).to(tl.float32)
    return s + tl.load(T.ape + (pos % M)[:, None] * WIDTH + ch[None, :], mask=rows[:, None], other=0.0)


@triton.jit
def _pool_rows(acc, mx, den, T, S, slot, start, first, pos, r, prev_rows, ch, L: tl.constexpr):
    """Rows at positions `pos` [RB] (row r of their window), channels ch [HD] of the row layout, into the running
    per-channel softmax: from the step (pos >= start), else from prev (prev_rows: the window closed before the step),
    else from the open state."""
    HD: tl.constexpr = L.HD
    WIDTH: tl.constexpr = L.WIDTH
    M: tl.constexpr = L.M
    d = tl.arange(0, HD)
    step_row = pos >= start
    from_prev = (~step_row) & prev_rows
    from_open = (~step_row) & (~prev_rows)
    tok = (first + pos - start).to(tl.int64)
    orow = slot * S.open_slot + (pos % M).to(tl.int64) * WIDTH
    prow = slot * S.prev_slot + r.to(tl.int64) * HD
    k = tl.load(T.kv + tok[:, None] * S.kv_t + ch[None, :], mask=step_row[:, None], other=0.0).to(tl.float32)
    k += tl.load(T.open_kv + orow[:, None] + ch[None, :], mask=from_open[:, None], other=0.0).to(tl.float32)
    k += tl.load(T.prev_kv + prow[:, None] + d[None, :], mask=from_prev[:, None], other=0.0).to(tl.float32)
    s = _step_scores(T, S, tok, pos, ch, step_row, WIDTH, M)
    s += tl.load(T.open_score + orow[:, None] + ch[None, :], mask=from_open[:, None], other=0.0)
    s += tl.load(T.prev_score + prow[:, None] + d[None, :], mask=from_prev[:, None], other=0.0)
    m_new = tl.maximum(mx, tl.max(s, axis=0))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(mx - m_use)
    p = tl.exp(s - m_use[None, :])
    return acc * alpha + tl.sum(p * k, axis=0), m_new, den * alpha + tl.sum(p, axis=0)


@triton.jit
def _compress_kernel(T, steps, S, N, eps, L: tl.constexpr, EMIT: tl.constexpr, KEEP: tl.constexpr, T2, S2, eps2,
                     L2: tl.constexpr):
    """EMIT: program (b, w) pools window start // M + w of sequence b if it closes in the step (`_emit`). KEEP:
    program b keeps the state (`_keep`). Both in one launch where no sequence closes more than one window (grid
    (B, 1)): program b alone reads and writes sequence b's state, and the barrier orders its pooling's reads of the
    open rows before their overwrite. With a second compressor (L2 not None), programs (b, w, 1) step it as programs
    (b, w, 0) step the first: the two touch disjoint states."""
    if L2 is None:
        _compressor_step(T, steps, S, N, eps, L, EMIT, KEEP)
    elif tl.program_id(2) == 0:
        _compressor_step(T, steps, S, N, eps, L, EMIT, KEEP)
    else:
        _compressor_step(T2, steps, S2, N, eps2, L2, EMIT, KEEP)


@triton.jit
def _compressor_step(T, steps, S, N, eps, L: tl.constexpr, EMIT: tl.constexpr, KEEP: tl.constexpr):
    b = tl.program_id(0)
    if EMIT:
        _emit(T, steps, S, N, eps, b, tl.program_id(1), L)
    if EMIT and KEEP:
        tl.debug_barrier()
    if KEEP:
        _keep(T, steps, S, N, b, L)


@triton.jit
def _emit(T, steps, S, N, eps, b, w, L: tl.constexpr):
    M: tl.constexpr = L.M
    HD: tl.constexpr = L.HD
    RB: tl.constexpr = L.RB
    E: tl.constexpr = L.E
    HALF_ROPE: tl.constexpr = L.HALF_ROPE
    slot, start, first, n = sequence_tokens(steps, N, tl.num_programs(0), b)
    j = start // M + w
    if (j + 1) * M <= start + n:
        d = tl.arange(0, HD)
        acc = tl.zeros([HD], tl.float32)
        mx = tl.full([HD], float("-inf"), tl.float32)
        den = tl.zeros([HD], tl.float32)
        if L.OVERLAP:       # the Ca half (channels 0..hd) of window j - 1; the sequence's first window has none
            if j > 0:
                for r0 in range(0, M, RB):
                    r = r0 + tl.arange(0, RB)
                    acc, mx, den = _pool_rows(acc, mx, den, T, S, slot, start, first, (j - 1) * M + r, r,
                                              (r * 0 + j) * M <= start, d, L)
            off = HD
        else:
            off = 0
        for r0 in range(0, M, RB):      # window j (CSA: its Cb half, channels hd..2 hd)
            r = r0 + tl.arange(0, RB)
            acc, mx, den = _pool_rows(acc, mx, den, T, S, slot, start, first, j * M + r, r, r < 0, off + d, L)
        dtype = T.kv.dtype.element_ty
        h = (acc / den).to(dtype).to(tl.float32)                 # the pooled entry, rounded as the reference's
        # RMSNorm, then the rope at position j m (the angles of the step token that closes window j)
        tok = (first + (j + 1) * M - 1 - start).to(tl.int64)
        out = norm_rope_row(h, d, d < HD, T.weight, T.cos + tok * S.rope_t, T.sin + tok * S.rope_t, eps, dtype,
                            HD, HD, 2, HALF_ROPE, False)
        page = tl.load(steps.pages + b * S.pages_seq + j // E).to(tl.int64)
        entry = page * E + j % E                                 # its row of the pool
        if L.PACKED_NOPE > 0:
            _store_packed(T.entries + entry * S.entry_row, out.to(dtype).to(tl.float32), d, L.PACKED_NOPE, HD,
                          S.entry_row)
        elif L.FP8:           # `ref.fp8_key_codes`: the least power of two >= max |x| / 448 as the scale
            x = out.to(dtype).to(tl.float32)
            bits = tl.math.div_rn(tl.max(tl.abs(x), axis=0), 448.0).to(tl.int32, bitcast=True)
            exponent = tl.maximum((bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.int32), 1)
            inverse = ((254 - exponent) << 23).to(tl.float32, bitcast=True)     # 1 / scale, exactly
            codes = e4m3_codes(x * inverse).to(tl.float8e4nv, bitcast=True)
            tl.store(T.entries + entry * S.entry_row + d, codes)
            tl.store(T.entry_scales + entry, (exponent << 23).to(tl.float32, bitcast=True))
        else:
            tl.store(T.entries + entry * S.entry_row + d, out.to(dtype))


@triton.jit
def _store_packed(row, x, d, NOPE: tl.constexpr, HD: tl.constexpr, ROW):
    """Entry x fp32 [HD] as a packed fp8 row at `row` (uint8), `ref.fp8_kv_pack`'s bytes: NOPE e4m3 codes, the rope
    channels' bf16 (low byte first), one exponent byte per 64-channel block, zeros to ROW."""
    codes, _, exponent = fp8_kv_blocks(x, NOPE, HD)
    tl.store(row + d, codes, mask=d < NOPE)
    half = bf16_bits(x) >> 16
    rope = d >= NOPE
    tl.store(row + NOPE + 2 * (d - NOPE), (half & 0xFF).to(tl.uint8), mask=rope)
    tl.store(row + NOPE + 2 * (d - NOPE) + 1, ((half >> 8) & 0xFF).to(tl.uint8), mask=rope)
    end: tl.constexpr = 2 * HD - NOPE
    blocks: tl.constexpr = (NOPE + 63) // 64
    blk = tl.arange(0, HD // 64)
    tl.store(row + end + blk, exponent.to(tl.uint8), mask=blk < blocks)
    pad = tl.arange(0, 8)
    tl.store(row + end + blocks + pad, tl.zeros([8], tl.uint8), mask=end + blocks + pad < ROW)


@triton.jit
def _keep(T, steps, S, N, b, L: tl.constexpr):
    M: tl.constexpr = L.M
    HD: tl.constexpr = L.HD
    WIDTH: tl.constexpr = L.WIDTH
    RB: tl.constexpr = L.RB
    WB: tl.constexpr = L.WB
    slot, start, first, n = sequence_tokens(steps, N, tl.num_programs(0), b)
    end = start + n
    if L.OVERLAP:       # the Ca half of the last window that closed feeds the next entry
        jc = end // M - 1
        if jc >= start // M:
            d = tl.arange(0, HD)
            for r0 in range(0, M, RB):
                r = r0 + tl.arange(0, RB)
                pos = jc * M + r
                step_row = pos >= start
                tok = (first + pos - start).to(tl.int64)
                orow = slot * S.open_slot + (pos % M).to(tl.int64) * WIDTH
                k = tl.load(T.kv + tok[:, None] * S.kv_t + d[None, :], mask=step_row[:, None], other=0.0)
                k += tl.load(T.open_kv + orow[:, None] + d[None, :], mask=(~step_row)[:, None], other=0.0)
                s = _step_scores(T, S, tok, pos, d, step_row, WIDTH, M)
                s += tl.load(T.open_score + orow[:, None] + d[None, :], mask=(~step_row)[:, None], other=0.0)
                prow = slot * S.prev_slot + r.to(tl.int64) * HD
                tl.store(T.prev_kv + prow[:, None] + d[None, :], k)
                tl.store(T.prev_score + prow[:, None] + d[None, :], s)
        tl.debug_barrier()              # those open rows are read before the new open rows overwrite them
    for p0 in range(tl.maximum(start, (end // M) * M), end, RB):    # the rows of the window left open
        pos = p0 + tl.arange(0, RB)
        valid = pos < end
        tok = (first + pos - start).to(tl.int64)
        orow = slot * S.open_slot + (pos % M).to(tl.int64) * WIDTH
        for c0 in range(0, WIDTH, WB):
            c = c0 + tl.arange(0, WB)
            k = tl.load(T.kv + tok[:, None] * S.kv_t + c[None, :], mask=valid[:, None], other=0.0)
            s = _step_scores(T, S, tok, pos, c, valid, WIDTH, M)
            tl.store(T.open_kv + orow[:, None] + c[None, :], k, mask=valid[:, None])
            tl.store(T.open_score + orow[:, None] + c[None, :], s, mask=valid[:, None])


def compress(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, steps: StepTokens, state, ratio: int,
             cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor, eps: float,
             max_windows: int | None = None, second: SecondCompressor | None = None) -> None:
    """`ref.compress` in one launch, or two when max_windows > 1 (module docstring). max_windows: a bound on the
    windows any sequence closes in the step (the emit grid's second axis); by default the step's token count bounds
    it. second: another compressor of the same step, ratio and rope, stepped in the same launches (a third grid
    axis of 2)."""
    N = kv.shape[0]
    B = steps.slot.shape[0]
    if N == 0:
        return
    cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (cos, sin))      # row strides
    tensors, strides, shape = _launch_args(kv, score, ape, state, ratio, cos, sin, weight, steps.pages.stride(0))
    tensors2 = strides2 = shape2 = None                 # no second compressor: the kernel's L2 None
    if second is not None:
        if second.kv.shape[0] != N:
            raise ValueError(f"compress: the second compressor has {second.kv.shape[0]} rows, the first {N}")
        tensors2, strides2, shape2 = _launch_args(second.kv, second.score, second.ape, second.state, ratio, cos, sin,
                                                  second.weight, steps.pages.stride(0))
    eps2 = eps if second is None else second.eps
    if max_windows is None:
        max_windows = (N - 1) // ratio + 1
    jobs = 1 if second is None else 2
    launches = ([((B, 1, jobs), True, True)] if max_windows == 1 else          # decode: one launch
                [((B, max_windows, jobs), True, False), ((B, 1, jobs), False, True)])
    for grid, emit, keep in launches:
        _compress_kernel[grid](tensors, steps, strides, N, eps, shape, emit, keep, tensors2, strides2, eps2, shape2,
                               num_warps=4)


def _launch_args(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, state, ratio: int, cos: torch.Tensor,
                 sin: torch.Tensor, weight: torch.Tensor, pages_seq: int) -> tuple[Tensors, Strides, Shape]:
    """One compressor's kernel arguments, its shapes checked."""
    m, (_, E, row) = ratio, state.entries.shape
    overlap = state.prev_kv is not None
    width = kv.shape[1]
    hd = width // 2 if overlap else width
    if hd & (hd - 1) or width % (2 if overlap else 1) or (row != hd and not state.packed_nope):
        raise ValueError(f"compress: kv {tuple(kv.shape)} must be [N, {'2 ' if overlap else ''}head_dim] with a "
                         f"power-of-two head_dim, the width of the entries' rows ({row})")
    if state.packed_nope and (hd < 64 or row != kv_row_bytes(hd, state.packed_nope)):
        raise ValueError(f"compress: packed fp8 entries need head_dim >= 64 and rows of "
                         f"{kv_row_bytes(hd, state.packed_nope)} bytes; got head_dim {hd}, rows of {row}")
    if ape.shape != (m, width) or ape.dtype != torch.float32:
        raise ValueError(f"compress: ape must be fp32 [{m}, {width}], got {ape.dtype} {tuple(ape.shape)}")
    prev_kv = state.prev_kv if overlap else state.open_kv
    prev_score = state.prev_score if overlap else state.open_score
    kv, score = (t if t.stride(-1) == 1 else t.contiguous() for t in (kv, score))   # row strides
    fp8 = state.entry_scales is not None
    scales = state.entry_scales if fp8 else torch.empty(1, dtype=torch.float32, device=kv.device)
    tensors = Tensors(kv, score, ape.contiguous(), cos, sin, weight, state.open_kv, state.open_score, prev_kv,
                      prev_score, state.entries, scales)
    strides = Strides(kv.stride(0), score.stride(0), cos.stride(0), state.open_kv.stride(0), prev_kv.stride(0),
                      pages_seq, row)
    rb = min(m, 16 if hd <= 256 else 8)
    shape = Shape(m, hd, width, overlap, E, cos.shape[1], rb, min(width, 4096 // rb), fp8, state.packed_nope)
    return tensors, strides, shape
