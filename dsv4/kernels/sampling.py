"""One token per row of a batch of logits in two launches (`ref.sample_tokens`'s contract): the first pass over
chunks of every row, then one program per row.

The rules (`ref.sample_kept`): with x = logits * inv_temperature, a row may draw the tokens that pass min-p
(exp(x - max x) >= min_p), top-k (x >= the top_k-th largest x, ties kept) and top-p (with integer masses
m = ceil(exp(x - max x) 2^SAMPLE_MASS_BITS) on what is left and T their sum, a token stays iff the tokens with a
larger x weigh less than T - floor(T * drop_share), drop_share = 1 - top_p). Each filter keeps an upper set of x,
and so do all three. The token is the Gumbel-max over that set, argmax(x + g) with `ref.gumbel`'s noise g of (row
key, token id), which draws from softmax(x) restricted to the set; greedy rows take argmax(logits). Ties go to the
lowest id.

Passes over a row run in blocks of BLOCK logits; each lane keeps its own sums and maxima, reduced after the pass.
1. `_chunk_kernel`, one program per (row, chunk of whole blocks; `plan_chunks`): argmax of the logits, max x, and
   the Gumbel winner over every token, the first candidate; a top-k row also histograms the top byte of the ordered
   keys of x. `_sample_kernel` (one program per row) combines the chunks; a greedy row stops here.
2. A top-k row: three more passes finish the radix select of the top_k-th largest key (the indexer's top-k way).
3. Rejection (FlashInfer's sampling design): a candidate in the kept set is the answer, because the winner over a
   set that holds the kept set is, when it lies in the kept set, the winner over the kept set. A rejected candidate
   takes every token with an x at most its own out (the kept set is an upper set), and the next candidate is the
   winner over the tokens above it. A pass sums T and the candidate's mass above it, finds the next candidate, and
   weighs three pivot keys between lo (nothing at or below it can be drawn) and hi (everything above it is kept):
   the bracket narrows fourfold a pass, so a row ends within about 18 passes whatever its logits, and a candidate
   above hi is taken without a pass. No token with x <= max x - G_SPAN can win (g lies in [-2.86, 17.33]), which is
   where lo starts. Without top-p a candidate that passes min-p and top-k is the answer.
A row reads its logits once without filters, twice with top-p (the candidate is usually kept), four or five times
with top-k. Nothing is read back to the host; the launches are the same for any rows, as a CUDA graph needs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .host import num_sms
from .ref import LOWBIAS32, SAMPLE_MASS_BITS, SPLITMIX64

BLOCK = 2048                  # logits per iteration of a pass
G_SPAN = 21.0                 # x + g of a token with x <= max x - G_SPAN is below the top token's: it never wins
G_MAX = tl.constexpr(17.5)    # above every Gumbel value (`ref.gumbel`: at most 17.33)
MAX_PASSES = 48               # rejection passes: a safety bound, above the ~18 the bracket needs
_HASH_1 = tl.constexpr(LOWBIAS32[0])
_HASH_2 = tl.constexpr(LOWBIAS32[1])
_MASS_SCALE = tl.constexpr(2.0**SAMPLE_MASS_BITS)
_GOLDEN = tl.constexpr(SPLITMIX64[0])
_MIX_1 = tl.constexpr(SPLITMIX64[1])
_MIX_2 = tl.constexpr(SPLITMIX64[2])


@triton.jit
def _lowbias32(h):
    h = h ^ (h >> 16)
    h = h * tl.full([], _HASH_1, tl.uint32)
    h = h ^ (h >> 15)
    h = h * tl.full([], _HASH_2, tl.uint32)
    return h ^ (h >> 16)


@triton.jit
def _gumbel(j, low, high):
    """`ref.gumbel` at token ids j (int32) of the row whose key halves are low, high (uint32)."""
    h = _lowbias32(_lowbias32(j.to(tl.uint32) + low) ^ high)
    u = ((h >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08
    return -tl.log(-tl.log(u))


@triton.jit
def _key(x):
    """fp32 -> int64 keys in [0, 2^32) ordered as the values (-0.0 and 0.0 equal)."""
    u = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return tl.where(u < 0, u ^ 0x7FFFFFFF, u).to(tl.int64) + 2147483648


@triton.jit
def _mix64(z):
    """splitmix64's mixer on uint64."""
    z = (z ^ (z >> 30)) * tl.full([], _MIX_1, tl.uint64)
    z = (z ^ (z >> 27)) * tl.full([], _MIX_2, tl.uint64)
    return z ^ (z >> 31)


@triton.jit
def _row_key(seed, counter):
    """`ref.row_keys` of one row -> its low and high halves (uint32)."""
    z = _mix64(_mix64(seed.to(tl.uint64, bitcast=True))
               + counter.to(tl.uint64, bitcast=True) * tl.full([], _GOLDEN, tl.uint64))
    return (z & 0xFFFFFFFF).to(tl.uint32), (z >> 32).to(tl.uint32)


def plan_chunks(rows: int, vocab: int, sms: int) -> int:
    """Chunks each row's first pass splits into: enough (row, chunk) programs for two a streaming multiprocessor,
    each chunk at least one BLOCK of logits."""
    return max(1, min(triton.cdiv(vocab, BLOCK), triton.cdiv(2 * sms, rows)))


@triton.jit
def _chunk_kernel(logits, stat_x, stat_i, hist, V, stride, chunk, inv_temperature, greedy, top_k, seeds, counters,
                  HAS_TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """Step 1 for program (row b, chunk s), the tokens [s chunk, (s + 1) chunk): the largest logit and its lowest id,
    and (a sampled row) the Gumbel winner over every token (score, lowest id) and, for top-k, the histogram of the
    keys' top byte. stat_x fp32 / stat_i int32 [B, S, 2]: (max logit, winner's score) / their ids (V where the
    chunk holds only -inf); hist int32 [B, S, 256]. Each lane keeps its own running maxima (its first id of each:
    ids grow along a lane), reduced once at the end."""
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    row = logits + b * stride
    offs = tl.arange(0, BLOCK)
    r = tl.load(inv_temperature + b)
    sampled = tl.load(greedy + b) == 0
    low, high = _row_key(tl.load(seeds + b), tl.load(counters + b))
    radix = sampled & False
    if HAS_TOP_K:
        radix = sampled & (tl.load(top_k + b) < V)
    top_l = tl.full([BLOCK], float("-inf"), tl.float32)
    top_j = tl.full([BLOCK], V, tl.int32)
    win_s = tl.full([BLOCK], float("-inf"), tl.float32)
    win_j = tl.full([BLOCK], V, tl.int32)
    h = tl.zeros([256], tl.int32)
    start = s * chunk
    end = tl.minimum(start + chunk, V)
    for j0 in range(start, end, BLOCK):
        j = j0 + offs
        valid = j < end
        lg = tl.load(row + j, mask=valid, other=float("-inf"))
        up = lg > top_l
        top_j = tl.where(up, j, top_j)
        top_l = tl.where(up, lg, top_l)
        if sampled:
            x = lg * r
            score = tl.where(valid, x + _gumbel(j, low, high), float("-inf"))
            up = score > win_s
            win_j = tl.where(up, j, win_j)
            win_s = tl.where(up, score, win_s)
            if radix:
                h += tl.histogram(((_key(x) >> 24) & 255).to(tl.int32), 256, mask=valid)
    m = tl.max(top_l, axis=0)
    w = tl.max(win_s, axis=0)
    at = (b * tl.num_programs(1) + s) * 2
    tl.store(stat_x + at, m)
    tl.store(stat_x + at + 1, w)
    tl.store(stat_i + at, tl.min(tl.where(top_l == m, top_j, V), axis=0))
    tl.store(stat_i + at + 1, tl.min(tl.where(win_s == w, win_j, V), axis=0))
    if HAS_TOP_K:
        tl.store(hist + (b * tl.num_programs(1) + s) * 256 + tl.arange(0, 256), h)


@triton.jit
def _sample_kernel(logits, out, stat_x, stat_i, hist, V, stride, chunks, inv_temperature, greedy, min_p, top_k,
                   drop_share, seeds, counters, HAS_MIN_P: tl.constexpr, HAS_TOP_K: tl.constexpr,
                   HAS_TOP_P: tl.constexpr, CHUNKS_PAD: tl.constexpr, BLOCK: tl.constexpr, G_SPAN: tl.constexpr,
                   MAX_PASSES: tl.constexpr):
    """Row b: step 1's chunks combined (the lowest id among the chunks' equal maxima), then steps 2 and 3."""
    b = tl.program_id(0).to(tl.int64)
    row = logits + b * stride
    c = tl.arange(0, CHUNKS_PAD)
    at = (b * chunks + c) * 2
    tops = tl.load(stat_x + at, mask=c < chunks, other=float("-inf"))
    max_l = tl.max(tops, axis=0)
    if tl.load(greedy + b):
        token = tl.min(tl.where(tops == max_l, tl.load(stat_i + at, mask=c < chunks, other=V), V), axis=0)
    else:
        wins = tl.load(stat_x + at + 1, mask=c < chunks, other=float("-inf"))
        best = tl.max(wins, axis=0)
        first = tl.min(tl.where(wins == best, tl.load(stat_i + at + 1, mask=c < chunks, other=V), V), axis=0)
        first = tl.where(first < V, first, 0)
        r = tl.load(inv_temperature + b)
        low, high = _row_key(tl.load(seeds + b), tl.load(counters + b))
        k = V
        if HAS_TOP_K:
            k = tl.minimum(tl.load(top_k + b), V).to(tl.int32)
        floor_e = tl.zeros([], tl.float32)
        if HAS_MIN_P:
            floor_e = tl.load(min_p + b)
        drop = tl.zeros([], tl.float64)
        if HAS_TOP_P:
            drop = tl.load(drop_share + b)
        kth = tl.zeros([], tl.int64)                    # keys >= kth pass top-k
        if k < V:
            bins = tl.arange(0, 256)
            top_bytes = tl.sum(tl.load(hist + (b * chunks + c)[:, None] * 256 + bins[None, :],
                                       mask=(c < chunks)[:, None], other=0), axis=0)
            kth = _kth_key(row, V, r, k, top_bytes, BLOCK)
        token = _reject(row, V, r, low, high, max_l * r, kth, floor_e, drop, first, BLOCK, G_SPAN, MAX_PASSES)
    tl.store(out + b, tl.where(token < V, token, 0).to(tl.int64))


@triton.jit
def _kth_key(row, V, r, k, hist, BLOCK: tl.constexpr):
    """Step 2: the k-th largest key of the row (ties counted), a byte a pass from the first pass's histogram."""
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)
    kth = tl.zeros([], tl.int64)
    need = k
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        if p > 0:
            hist = tl.zeros([256], tl.int32)
            for j0 in range(0, V, BLOCK):
                j = j0 + offs
                key = _key(tl.load(row + j, mask=j < V, other=float("-inf")) * r)
                hist += tl.histogram(((key >> shift) & 255).to(tl.int32), 256,
                                     mask=(j < V) & ((key >> (shift + 8)) == (kth >> (shift + 8))))
        above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0)            # keys with a larger byte here
        d = tl.maximum(tl.max(tl.where(above + hist >= need, bins, -1), axis=0), 0)
        need -= tl.sum(tl.where(bins == d, above, 0), axis=0)
        kth = kth | (d.to(tl.int64) << shift)
    return kth


@triton.jit
def _reject(row, V, r, low, high, m_x, kth, floor_e, drop, c, BLOCK: tl.constexpr, G_SPAN: tl.constexpr,
            MAX_PASSES: tl.constexpr):
    """Step 3: from the first candidate c to the token (module docstring)."""
    offs = tl.arange(0, BLOCK)
    topp = drop > 0.0
    c_x = tl.load(row + c) * r
    c_key = _key(c_x)
    c_ok = (c_key >= kth) & (tl.exp(c_x - m_x) >= floor_e)     # passes min-p and top-k
    done = c_ok & (topp == 0)
    lo = _key(m_x - G_SPAN)                             # keys <= lo: not drawn (out, or unable to win)
    hi = _key(m_x)                                      # keys > hi: kept
    passes = 0
    while (done == 0) & (passes < MAX_PASSES):
        floor_key = tl.where(c_ok, tl.maximum(lo, c_key), lo)
        p1 = lo + (hi - lo) // 4
        p2 = lo + (hi - lo) // 2
        p3 = hi - (hi - lo) // 4
        # each lane sums its own masses and keeps its own next-candidate score (its first id of the best), reduced
        # once after the pass
        lane_total = tl.zeros([BLOCK], tl.int64)
        lane_c = tl.zeros([BLOCK], tl.int64)
        lane_1 = tl.zeros([BLOCK], tl.int64)
        lane_2 = tl.zeros([BLOCK], tl.int64)
        lane_3 = tl.zeros([BLOCK], tl.int64)
        lane_s = tl.full([BLOCK], float("-inf"), tl.float32)
        lane_i = tl.full([BLOCK], V, tl.int32)
        for j0 in range(0, V, BLOCK):
            j = j0 + offs
            x = tl.load(row + j, mask=j < V, other=float("-inf")) * r
            key = _key(x)
            e = tl.exp(x - m_x)
            allowed = (j < V) & (key >= kth) & (e >= floor_e)
            if topp:
                m = tl.where(allowed, tl.math.ceil(e * _MASS_SCALE), 0.0).to(tl.int64)
                lane_total += m
                lane_c += tl.where(key > c_key, m, 0)
                lane_1 += tl.where(key > p1, m, 0)
                lane_2 += tl.where(key > p2, m, 0)
                lane_3 += tl.where(key > p3, m, 0)
            drawable = allowed & (key > floor_key)
            if tl.max(drawable.to(tl.int32), axis=0) > 0:
                s = tl.where(drawable, x + _gumbel(j, low, high), float("-inf"))
                up = s > lane_s
                lane_i = tl.where(up, j, lane_i)
                lane_s = tl.where(up, s, lane_s)
        total = tl.sum(lane_total, axis=0)
        over_c = tl.sum(lane_c, axis=0)
        over_1 = tl.sum(lane_1, axis=0)
        over_2 = tl.sum(lane_2, axis=0)
        over_3 = tl.sum(lane_3, axis=0)
        next_s = tl.max(lane_s, axis=0)
        next_i = tl.min(tl.where(lane_s == next_s, lane_i, V), axis=0)
        next_i = tl.where(next_i < V, next_i, 0)
        passes += 1
        limit = total - tl.floor(total.to(tl.float64) * drop).to(tl.int64)     # a token stays iff over it < limit
        accept = c_ok & ((topp == 0) | (c_key > hi) | (over_c < limit))
        move = (accept == 0) & topp                     # narrow the bracket (top-p rows)
        lo = tl.where(move & c_ok, tl.maximum(lo, c_key), lo)
        lo = tl.where(move & (over_1 >= limit), tl.maximum(lo, p1), lo)
        lo = tl.where(move & (over_2 >= limit), tl.maximum(lo, p2), lo)
        lo = tl.where(move & (over_3 >= limit), tl.maximum(lo, p3), lo)
        hi = tl.where(move & (over_3 < limit), tl.minimum(hi, p3), hi)
        hi = tl.where(move & (over_2 < limit), tl.minimum(hi, p2), hi)
        hi = tl.where(move & (over_1 < limit), tl.minimum(hi, p1), hi)
        c = tl.where(accept, c, next_i)
        c_x = tl.load(row + c) * r
        c_key = _key(c_x)
        c_ok = tl.where(accept, c_ok, (next_s > float("-inf")) & (c_key > lo))
        done = accept | (c_ok & ((topp == 0) | (c_key > hi)))
    return c


def sample_tokens(logits: torch.Tensor, inv_temperature: torch.Tensor, greedy: torch.Tensor,
                  min_p: torch.Tensor | None, top_k: torch.Tensor | None, drop_share: torch.Tensor | None,
                  seeds: torch.Tensor, counters: torch.Tensor, chunks: int | None = None) -> torch.Tensor:
    """int64 [B]: one token per row of fp32 logits [B, V] (module docstring; `ref.sample_tokens`). chunks: how many
    programs take each row's first pass (by default `plan_chunks`')."""
    B, V = logits.shape
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if chunks is None:
        chunks = plan_chunks(B, V, num_sms(logits.device))
    chunk = BLOCK * triton.cdiv(triton.cdiv(V, BLOCK), chunks)    # whole blocks; the last chunk may be shorter
    chunks = triton.cdiv(V, chunk)
    stat_x = torch.empty(B, chunks, 2, dtype=torch.float32, device=logits.device)
    stat_i = torch.empty(B, chunks, 2, dtype=torch.int32, device=logits.device)
    hist = torch.empty(B, chunks, 256, dtype=torch.int32, device=logits.device) if top_k is not None else stat_i
    dummy = inv_temperature
    top_k_or = dummy if top_k is None else top_k
    _chunk_kernel[(B, chunks)](logits, stat_x, stat_i, hist, V, logits.stride(0), chunk, inv_temperature, greedy,
                               top_k_or, seeds, counters, top_k is not None, BLOCK, num_warps=8)
    _sample_kernel[(B,)](logits, out, stat_x, stat_i, hist, V, logits.stride(0), chunks, inv_temperature, greedy,
                         dummy if min_p is None else min_p, top_k_or, dummy if drop_share is None else drop_share,
                         seeds, counters, min_p is not None, top_k is not None, drop_share is not None,
                         triton.next_power_of_2(chunks), BLOCK, G_SPAN, MAX_PASSES, num_warps=8)
    return out
