"""The lightning indexer's picks for every token of a ragged step (`ref.index_picks`'s contract): one scoring launch
over the keys each token's sequence has emitted, read through its page table, then one top-k launch.

    q        [N, H, hd]     rotated index queries
    weights  [N, H]         weights_proj(x); the head weights are these in fp32 times weight_scale (H^-1/2)
    entries  [pages, E, hd] the indexer compressor's keys
    scores   [N, max_keys]  fp32: scale * sum_h weights[h] relu(q[h] . key_j) for j < (pos + 1) // ratio,
                            -inf beyond

Program (token t, block of BT keys): the token's H x hd queries (H padded to a power of two >= 16) against BT keys
in one dot (all heads share each key row). max_keys, the width of the score rows, is a host bound on any sequence's
keys, so the launch has no data-dependent shape.

`_topk_kernel`, program (token t): the ids of the row's topk largest finite scores, in ascending id order, then -1 to
topk columns (every finite score where there are at most topk). A radix select: scores map to integer keys of the
same order (sign-magnitude to two's complement), four passes over the row histogram one byte of the keys among those
that share the bytes found so far, which gives the topk-th largest key T and how many keys equal to T to take; a last
pass writes every id with a key above T and the lowest ids with key T (ties go to the lower id; `torch.topk` leaves
them unspecified). No sort: the attention reading the picks is a sum over them. A row is read only up to the token's
visible entries (its position, when given: a row as wide as a long length bucket costs what the context holds).

A row's program reads TOPK_ROW_BLOCK scores an iteration on TOPK_ROW_WARPS warps; with TOPK_ROW_TAIL, a remainder
past the whole blocks of at most that many scores is read in one block of that size (a decode row at 8K context
holds 2,049-2,050 visible scores: one block of 2048 and one of the tail, not two of 2048). A row of one block (and
its tail) is read once and its passes run over the registers; longer rows are read again each pass (from L2). Rows
wider than TOPK_CHUNKED_KEYS take the radix select over (token, chunk) programs (`topk_chunks`), six launches: the
four byte passes (`_topk_radix_kernel`, `radix.radix_state`), a count of each chunk's keys above T and equal to T
(`_topk_count_kernel`), and the write (`_topk_write_kernel`), where a chunk's picks start after those of the chunks
before it and its ties after theirs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .attention import dot_in
from .host import num_sms
from .policy import next_pow2
from .radix import (byte_of, chunks_for, load_state, next_byte, pass_prefix, radix_state, shares_prefix, store_hist,
                    store_state, summed_hist)
from .steps import StepTokens

TOPK_BLOCK = 1024                       # scores per iteration of the chunked select's passes
TOPK_WARPS = 4                          # of a chunked select's program (docs/tuning.md#indexer-topk)
TOPK_ROW_BLOCK = 2048                   # scores per iteration of the one-program select's passes
TOPK_ROW_WARPS = 8                      # of a one-program select (docs/tuning.md#indexer-topk)
TOPK_ROW_TAIL = 256                     # a remainder of at most this many scores takes a block of its own (0: none;
                                        # docs/tuning.md#indexer-topk)
TOPK_CHUNKED_KEYS = 8192                # wider rows take the chunked select: five passes over a row in one program
                                        # outlast six launches over its chunks (32K tokens of context and up)


class Shape(NamedTuple):
    """The launch's compile-time values (one constexpr)."""
    HP: int                    # index heads, padded to a power of two >= 16
    HD: int                    # index head_dim
    E: int                     # keys per page
    RATIO: int
    BT: int                    # keys per program
    DOT: object                # operand dtype of the products
    FP8: bool                  # keys are fp8 e4m3 codes whose scale per key is in the scales tensor


@triton.jit
def _scores_kernel(q, w, entries, scales, out, steps, H, q_t, w_t, out_t, pages_seq, max_keys, scale, w_scale,
                   L: tl.constexpr):
    HP: tl.constexpr = L.HP
    HD: tl.constexpr = L.HD
    E: tl.constexpr = L.E
    BT: tl.constexpr = L.BT
    DOT: tl.constexpr = L.DOT
    t = tl.program_id(0)
    j = tl.program_id(1) * BT + tl.arange(0, BT)
    b = tl.load(steps.seq + t)
    visible = (tl.load(steps.pos + t) + 1) // L.RATIO
    valid = j < visible
    score = tl.full([BT], float("-inf"), tl.float32)
    if tl.program_id(1) * BT < visible:
        h = tl.arange(0, HP)
        d = tl.arange(0, HD)
        qt = tl.load(q + t.to(tl.int64) * q_t + h[:, None] * HD + d[None, :], mask=(h < H)[:, None], other=0.0)
        page = tl.load(steps.pages + b * pages_seq + j // E, mask=valid, other=0).to(tl.int64)
        k = tl.load(entries + (page * E + j % E)[:, None] * HD + d[None, :], mask=valid[:, None], other=0.0)
        s = dot_in(qt, tl.trans(k), DOT)                                                   # [H, BT]
        s = tl.maximum(s, 0.0)
        if L.FP8:           # relu(q . code) * its power-of-two scale = relu(q . key)
            s = s * tl.load(scales + page * E + j % E, mask=valid, other=0.0)[None, :]
        wt = tl.load(w + t.to(tl.int64) * w_t + h, mask=h < H, other=0.0).to(tl.float32) * w_scale
        score = tl.where(valid, tl.sum(s * scale * wt[:, None], axis=0), float("-inf"))
    tl.store(out + t.to(tl.int64) * out_t + j, score, mask=j < max_keys)


@triton.jit
def _ordered_keys(scores_row, j, n):
    """Scores at ids j (< n) -> (keys as int64 in [0, 2^32) ordered as the scores, finite mask)."""
    s = tl.load(scores_row + j, mask=j < n, other=float("-inf"))
    u = s.to(tl.int32, bitcast=True)
    key = tl.where(u < 0, u ^ 0x7FFFFFFF, u)          # negative floats: larger magnitude, smaller key
    return key.to(tl.int64) + 2147483648, s > float("-inf")


@triton.jit
def _topk_kernel(scores, out, n, scores_t, out_t, pos, RATIO: tl.constexpr, TOPK: tl.constexpr,
                 BLOCK: tl.constexpr, TAIL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    row = scores + t * scores_t
    out_row = out + t * out_t
    n = _visible(n, pos, t, RATIO)
    prefix = tl.zeros([], tl.int64)        # the bytes of T found so far
    need = tl.zeros([], tl.int32) + TOPK   # keys equal to the prefix still to take
    zero = tl.zeros([], tl.int32)
    # blocks of BLOCK, but a remainder of at most TAIL scores in one block of TAIL: 2,049 scores cost a block of 2048
    # and one of TAIL, not two of 2048
    split = n
    if TAIL > 0:
        split = tl.where(n % BLOCK <= TAIL, n - n % BLOCK, n)
    if split <= BLOCK:                      # one block (and the tail): read once, the passes over registers
        ja = tl.arange(0, BLOCK)
        key_a, valid_a = _ordered_keys(row, ja, split)
        jb = split + tl.arange(0, TAIL if TAIL > 0 else 16)
        key_b, valid_b = _ordered_keys(row, jb, n if TAIL > 0 else split)
        finite = zero
        for p in tl.static_range(1, 5):
            hist = _block_hist(key_a, valid_a, prefix, p) + _block_hist(key_b, valid_b, prefix, p)
            prefix, need, finite = _row_byte(hist, prefix, need, finite, p)
        prefix, need = _threshold(prefix, need, finite, TOPK)
        written, ties = _write_block(out_row, ja, key_a, valid_a, prefix, need, zero, zero)
        written, ties = _write_block(out_row, jb, key_b, valid_b, prefix, need, written, ties)
    else:
        finite = zero
        for p in tl.static_range(1, 5):
            hist = _pass_hist(row, 0, split, prefix, p, BLOCK)
            if TAIL > 0:
                hist += _pass_hist(row, split, n, prefix, p, TAIL)
            prefix, need, finite = _row_byte(hist, prefix, need, finite, p)
        prefix, need = _threshold(prefix, need, finite, TOPK)
        written, ties = _write_picks(row, out_row, 0, split, prefix, need, zero, zero, BLOCK)
        if TAIL > 0:
            written, ties = _write_picks(row, out_row, split, n, prefix, need, written, ties, TAIL)
    _fill_after(out_row, written, TOPK)


@triton.jit
def _row_byte(hist, prefix, need, finite, p: tl.constexpr):
    """`next_byte` of a row's select from byte p's histogram -> (prefix, need, the row's finite keys: the first
    histogram's total)."""
    if p == 1:
        finite = tl.sum(hist, axis=0)
    prefix, need = next_byte(hist, prefix, need, p)
    return prefix, need, finite


@triton.jit
def _threshold(prefix, need, finite, TOPK: tl.constexpr):
    """(T, the ties to take) after the four bytes: 0 and 0 where the row has at most TOPK finite keys, every one a
    pick."""
    every = finite <= TOPK
    return tl.where(every, 0, prefix), tl.where(every, 0, need)


@triton.jit
def _block_hist(key, valid, prefix, p: tl.constexpr):
    """The histogram [256] of byte p of the finite keys of a block that share the prefix's bytes before it."""
    return tl.histogram(byte_of(key, p), 256, mask=valid & shares_prefix(key, prefix, p))


@triton.jit
def _pass_hist(row, start, end, prefix, p: tl.constexpr, BLOCK: tl.constexpr):
    """The histogram [256] of byte p of the finite keys at ids [start, end) that share the prefix's bytes before
    it, read BLOCK at a time."""
    hist = tl.zeros([256], tl.int32)
    for j0 in range(start, end, BLOCK):
        key, valid = _ordered_keys(row, j0 + tl.arange(0, BLOCK), end)
        hist += _block_hist(key, valid, prefix, p)
    return hist


@triton.jit
def _write_block(out_row, j, key, valid, prefix, need, written, ties):
    """Of a block's ids j, those with a key above prefix, and those with key prefix while the ties taken (`ties`
    before the block) stay within need, stored in id order from out_row[written] -> (the picks written, the ties
    seen) then."""
    tie = valid & (key == prefix)
    take = (valid & (key > prefix)) | (tie & (ties + tl.cumsum(tie.to(tl.int32), axis=0) <= need))
    at = written + tl.cumsum(take.to(tl.int32), axis=0) - 1
    tl.store(out_row + at, j.to(tl.int64), mask=take)
    return written + tl.sum(take.to(tl.int32), axis=0), ties + tl.sum(tie.to(tl.int32), axis=0)


@triton.jit
def _write_picks(row, out_row, start, end, prefix, need, written, ties, BLOCK: tl.constexpr):
    """`_write_block` over the ids [start, end), read BLOCK at a time."""
    for j0 in range(start, end, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        key, valid = _ordered_keys(row, j, end)
        written, ties = _write_block(out_row, j, key, valid, prefix, need, written, ties)
    return written, ties


@triton.jit
def _fill_after(out_row, written, TOPK: tl.constexpr):
    """-1 in out_row[written:TOPK]."""
    FILL: tl.constexpr = 1024
    for i0 in range(0, TOPK, FILL):
        i = i0 + tl.arange(0, FILL)
        tl.store(out_row + i, tl.full([FILL], -1, tl.int64), mask=(i >= written) & (i < TOPK))


def topk_chunks(rows: int, width: int, sms: int) -> int:
    """Programs a row's select runs over: one for rows up to TOPK_CHUNKED_KEYS wide, else chunks of whole blocks,
    enough for two programs an SM."""
    return 1 if width <= TOPK_CHUNKED_KEYS else chunks_for(rows, width, TOPK_BLOCK, sms)


@triton.jit
def _visible(n, pos, t, RATIO: tl.constexpr):
    """Token t's visible scores of a row of n: past them the scores are -inf, and not read."""
    if RATIO > 0:
        n = tl.minimum(n, (tl.load(pos + t) + 1) // RATIO)
    return n


@triton.jit
def _chunk_span(n, pos, t, chunk, RATIO: tl.constexpr):
    """Token t's chunk of the program: [start, end) within its visible scores."""
    start = tl.program_id(1) * chunk
    return start, tl.minimum(start + chunk, _visible(n, pos, t, RATIO))


@triton.jit
def _topk_radix_kernel(scores, hist, state, n, scores_t, pos, chunk, RATIO: tl.constexpr, TOPK: tl.constexpr,
                       PASS: tl.constexpr, CHUNKS_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """Pass PASS of program (token t, chunk s): the histogram of byte PASS of the chunk's finite keys that share the
    bytes found so far (`radix`'s layout; chunk 0 stores those bytes for the later passes)."""
    t = tl.program_id(0).to(tl.int64)
    chunks = tl.num_programs(1)
    row = scores + t * scores_t
    prefix = tl.zeros([], tl.int64)
    if PASS > 1:
        prefix, shared = pass_prefix(hist, state, t, chunks, tl.full([], TOPK, tl.int32), PASS, CHUNKS_PAD)
    start, end = _chunk_span(n, pos, t, chunk, RATIO)
    store_hist(hist, t, _pass_hist(row, start, end, prefix, PASS, BLOCK), PASS)


@triton.jit
def _topk_count_kernel(scores, hist, state, counts, n, scores_t, pos, chunk, RATIO: tl.constexpr,
                       TOPK: tl.constexpr, CHUNKS_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """Program (token t, chunk s): T and the ties to take (chunk 0 stores them as state 4: 0 and 0 where the row has
    at most TOPK finite scores, every one a pick), then the chunk's keys above T and equal to T (counts int32
    [N, S, 2])."""
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    chunks = tl.num_programs(1)
    row = scores + t * scores_t
    prefix, need = radix_state(hist, state, t, chunks, tl.full([], TOPK, tl.int32), 4, CHUNKS_PAD)
    finite = tl.sum(summed_hist(hist, t, chunks, 1, CHUNKS_PAD), axis=0)
    if finite <= TOPK:
        prefix = tl.zeros([], tl.int64)
        need = tl.zeros([], tl.int64)
    if s == 0:
        store_state(state, t, prefix, need, 4)
    start, end = _chunk_span(n, pos, t, chunk, RATIO)
    above = tl.zeros([BLOCK], tl.int32)
    ties = tl.zeros([BLOCK], tl.int32)
    for j0 in range(start, end, BLOCK):
        key, valid = _ordered_keys(row, j0 + tl.arange(0, BLOCK), end)
        above += (valid & (key > prefix)).to(tl.int32)
        ties += (valid & (key == prefix)).to(tl.int32)
    tl.store(counts + (t * chunks + s) * 2, tl.sum(above, axis=0))
    tl.store(counts + (t * chunks + s) * 2 + 1, tl.sum(ties, axis=0))


@triton.jit
def _topk_write_kernel(scores, out, state, counts, n, scores_t, out_t, pos, chunk, RATIO: tl.constexpr,
                       TOPK: tl.constexpr, CHUNKS_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """Program (token t, chunk s): the chunk's picks in ascending id order after those of the chunks before it (every
    key above T, and keys equal to T while the row's ties taken stay within the count); chunk 0 also writes -1 after
    the row's last pick."""
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    chunks = tl.num_programs(1)
    row = scores + t * scores_t
    prefix, need = load_state(state, t, 4)
    need = need.to(tl.int32)
    c = tl.arange(0, CHUNKS_PAD)
    above_c = tl.load(counts + (t * chunks + c) * 2, mask=c < chunks, other=0)
    ties_c = tl.load(counts + (t * chunks + c) * 2 + 1, mask=c < chunks, other=0)
    ties = tl.sum(tl.where(c < s, ties_c, 0), axis=0)
    written = tl.sum(tl.where(c < s, above_c, 0), axis=0) + tl.minimum(ties, need)
    start, end = _chunk_span(n, pos, t, chunk, RATIO)
    _write_picks(row, out + t * out_t, start, end, prefix, need, written, ties, BLOCK)
    if s == 0:
        _fill_after(out + t * out_t, tl.sum(above_c, axis=0) + tl.minimum(tl.sum(ties_c, axis=0), need), TOPK)


def index_scores(q: torch.Tensor, weights: torch.Tensor, entries: torch.Tensor, steps: StepTokens, ratio: int,
                 scale: float, max_keys: int, weight_scale: float = 1.0,
                 entry_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Score rows fp32 [N, max_keys] (module docstring; entry_scales [pages, E] fp32: the keys are fp8 codes)."""
    N, H, hd = q.shape
    if hd & (hd - 1) or hd < 16:
        raise ValueError(f"index_scores needs a power-of-two head_dim >= 16, got q {tuple(q.shape)}")
    out = torch.empty(N, max_keys, dtype=torch.float32, device=q.device)
    if N == 0 or max_keys == 0:
        return out
    interp = q.device.type != "cuda"
    dot = tl.float32 if interp or q.dtype == torch.float32 else tl.bfloat16
    bt = max(16, min(64, next_pow2(max_keys)))
    q, weights = q.contiguous(), weights if weights.stride(-1) == 1 else weights.contiguous()   # weights: row stride
    shape = Shape(max(16, next_pow2(H)), hd, entries.shape[1], ratio, bt, dot, entry_scales is not None)
    scales = entry_scales if entry_scales is not None else out     # (not read without FP8)
    _scores_kernel[(N, triton.cdiv(max_keys, bt))](q, weights, entries, scales, out, steps, H, q.stride(0),
                                                  weights.stride(0), out.stride(0), steps.pages.stride(0), max_keys,
                                                  scale, weight_scale, shape, num_warps=4)
    return out


def index_picks(q: torch.Tensor, weights: torch.Tensor, entries: torch.Tensor, steps: StepTokens, topk: int,
                ratio: int, scale: float, max_keys: int | None = None, weight_scale: float = 1.0,
                entry_scales: torch.Tensor | None = None) -> torch.Tensor:
    """[N, topk] int64 entry ids, -1 past each token's picks (module docstring). max_keys: a bound on any sequence's
    keys after the step (by default every key the pages could hold)."""
    if max_keys is None:
        max_keys = steps.pages.shape[1] * entries.shape[1]
    scores = index_scores(q, weights, entries, steps, ratio, scale, max_keys, weight_scale, entry_scales)
    return index_picks_of_scores(scores, topk, steps.pos, ratio)


def index_picks_of_scores(scores: torch.Tensor, topk: int, positions: torch.Tensor | None = None,
                          ratio: int = 0, chunks: int | None = None, block: int | None = None,
                          warps: int | None = None, tail: int | None = None) -> torch.Tensor:
    """Score rows fp32 [N, n] -> [N, topk] int64: each row's ids of its topk largest finite scores in ascending
    order (ties to the lower id), then -1 (`_topk_kernel`, module docstring). positions int32 [N] and ratio: row t
    reads only its first (positions[t] + 1) // ratio scores, every later one being -inf (`index_scores`' rows),
    so the select costs the token's context, not the row width. chunks: programs a row's select runs over (by
    default `topk_chunks`'); block, warps: scores per pass iteration (at most) and warps of a program (by default
    TOPK_ROW_BLOCK / TOPK_ROW_WARPS for one program a row, TOPK_BLOCK / TOPK_WARPS for chunks; bench/lab/topk.py
    times others); tail: one program a row reads a remainder of at most this many scores past its whole blocks in
    one block of this size (a power of two; by default TOPK_ROW_TAIL; 0: none)."""
    N, n = scores.shape
    picks = torch.empty(N, topk, dtype=torch.long, device=scores.device)
    if not N:
        return picks
    pos = positions if positions is not None else picks
    ratio = ratio if positions is not None else 0
    if chunks is None:
        chunks = topk_chunks(N, n, num_sms(scores.device))
    if block is None:
        block = TOPK_ROW_BLOCK if chunks <= 1 else TOPK_BLOCK
    if warps is None:
        warps = TOPK_ROW_WARPS if chunks <= 1 else TOPK_WARPS
    block = min(block, max(16, next_pow2(n)))
    tail = TOPK_ROW_TAIL if tail is None else tail
    if tail & (tail - 1) or tail < 0:
        raise ValueError(f"index_picks_of_scores: tail must be 0 or a power of two, got {tail}")
    if chunks <= 1:
        _topk_kernel[(N,)](scores, picks, n, scores.stride(0), picks.stride(0), pos, ratio, topk, block,
                           tail if 16 <= tail < block else 0, num_warps=warps)
        return picks
    chunk = block * triton.cdiv(triton.cdiv(n, block), chunks)      # whole blocks; the last chunk may be shorter
    chunks = triton.cdiv(n, chunk)
    hist = torch.empty(N, 4, chunks, 256, dtype=torch.int32, device=scores.device)
    state = torch.empty(N, 4, 2, dtype=torch.int64, device=scores.device)
    counts = torch.empty(N, chunks, 2, dtype=torch.int32, device=scores.device)
    pad = next_pow2(chunks)
    for p in (1, 2, 3, 4):
        _topk_radix_kernel[(N, chunks)](scores, hist, state, n, scores.stride(0), pos, chunk, ratio, topk, p, pad,
                                        block, num_warps=warps)
    _topk_count_kernel[(N, chunks)](scores, hist, state, counts, n, scores.stride(0), pos, chunk, ratio, topk, pad,
                                    block, num_warps=warps)
    _topk_write_kernel[(N, chunks)](scores, picks, state, counts, n, scores.stride(0), picks.stride(0), pos, chunk,
                                    ratio, topk, pad, block, num_warps=warps)
    return picks
