"""One token per row of a batch of logits (`ref.sample_tokens`'s contract): passes over chunks of every row, then
one program per row; two launches without filters, up to eight with every filter.

The rules (`ref.sample_kept`): with x = logits * inv_temperature, a row may draw the tokens that pass min-p
(exp(x - max x) >= min_p), top-k (x >= the top_k-th largest x, ties kept) and top-p (with integer masses
m = ceil(exp(x - max x) 2^SAMPLE_MASS_BITS) on what is left and T their sum, a token stays iff the tokens with a
larger x weigh less than T - floor(T * drop_share), drop_share = 1 - top_p). Each filter keeps an upper set of x,
and so do all three. The token is the Gumbel-max over that set, argmax(x + g) with `ref.gumbel`'s noise g of (row
key, token id), which draws from softmax(x) restricted to the set; greedy rows take argmax(logits). Ties go to the
lowest id.

Passes over a row run in blocks of BLOCK logits; each lane keeps its own sums and maxima, reduced after the pass.
1. `_chunk_kernel`, one program per (row, chunk of whole blocks; `plan_chunks`): argmax of the logits, max x, and
   the Gumbel winner over every token, the first candidate; with a filter also the runner-up (the winner over every
   token but the winner); a top-k row also histograms the top byte of the ordered keys of x. `_sample_kernel` (one
   program per row) combines the chunks; a greedy row stops here.
2. A top-k row: three more passes over chunks (`_radix_kernel`) finish the radix select of the top_k-th largest key
   (`radix.radix_state`: each program redoes the bytes so far from the summed histograms).
3. Rejection (FlashInfer's sampling design): a candidate in the kept set is the answer, because the winner over a
   set that holds the kept set is, when it lies in the kept set, the winner over the kept set. A rejected candidate
   takes every token with an x at most its own out (the kept set is an upper set), and the next candidate is the
   winner over the tokens above it. The runner-up stands in for a winner that min-p or top-k refuses, and without
   top-p a candidate that passes them is the answer. With top-p the first pass is a check: it sums T and the masses
   above the candidate and above the runner-up, and takes the first of them that is kept (the top-p share keeps
   the winner with probability about top_p, and one of the two with about 1 - (1 - top_p)^2). A search pass after
   it sums T and the candidate's mass above it, finds the next candidate, and weighs three pivot keys between lo
   (nothing at or below it can be drawn) and hi (everything above it is kept): the bracket narrows fourfold a pass,
   so a row ends within about 18 passes whatever its logits, and a candidate above hi is taken without a pass. No
   token with x <= max x - G_SPAN can win (g lies in [-2.86, 17.33]), which is where lo starts. The first ROUNDS
   passes run over chunks (`_pass_kernel`: every program replays the rounds before from their integer sums and
   lowest-id maxima, which combine exactly); a row not done after them makes its own passes in `_sample_kernel`.
A row reads its logits once without filters, twice with top-p (the check nearly always ends it), four or five times
with top-k. A check pass costs about a quarter of a search pass's instructions a logit (no noise, no pivots).
Nothing is read back to the host; the launches are the same for any rows, as a CUDA graph needs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .host import num_sms
from .radix import byte_of, chunks_for, clear_hists, count_bytes, pass_prefix, radix_state, shares_prefix, store_hist
from .ref import LOWBIAS32, SAMPLE_MASS_BITS, SPLITMIX64

BLOCK = 2048                  # logits per iteration of a pass
G_SPAN = 21.0                 # x + g of a token with x <= max x - G_SPAN is below the top token's: it never wins
MAX_PASSES = 48               # rejection passes: a safety bound, above the ~18 the bracket needs
COUNTED_KEYS = 16384          # a radix pass counts key by key up to this many keys of a row sharing the bytes so far
                              # (docs/tuning.md#sampler-rounds)
ROUNDS = 3                    # rejection passes run over chunks before a row's own: a rejected candidate's successor
                              # is nearly always kept, and a step waits for its slowest row
                              # (docs/tuning.md#sampler-rounds)
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


class Rows(NamedTuple):
    """The batch's per-row parameters (`sample_tokens`' arguments; a filter no row uses gets a stand-in tensor)."""
    inv_temperature: torch.Tensor    # fp32
    greedy: torch.Tensor             # bool
    min_p: torch.Tensor              # fp32
    top_k: torch.Tensor              # int64
    drop_share: torch.Tensor         # fp64
    seeds: torch.Tensor              # int64
    counters: torch.Tensor           # int64


class Filters(NamedTuple):
    """Which filters some row uses (compile-time)."""
    MIN_P: bool
    TOP_K: bool
    TOP_P: bool


def plan_chunks(rows: int, vocab: int, sms: int) -> int:
    """Chunks each row's chunked passes split into (`radix.chunks_for`: chunks of at least one BLOCK of logits)."""
    return chunks_for(rows, vocab, BLOCK, sms)


@triton.jit
def _row_params(b, V, P, F: tl.constexpr):
    """Row b's (1 / temperature, sampled (not greedy), row key halves, k (V: off), min-p, drop share (0: off)) from
    the `Rows` P under the `Filters` F."""
    r = tl.load(P.inv_temperature + b)
    sampled = tl.load(P.greedy + b) == 0
    low, high = _row_key(tl.load(P.seeds + b), tl.load(P.counters + b))
    k = V
    if F.TOP_K:
        k = tl.minimum(tl.load(P.top_k + b), V).to(tl.int32)
    floor_e = tl.zeros([], tl.float32)
    if F.MIN_P:
        floor_e = tl.load(P.min_p + b)
    drop = tl.zeros([], tl.float64)
    if F.TOP_P:
        drop = tl.load(P.drop_share + b)
    return r, sampled, low, high, k, floor_e, drop


@triton.jit
def _combined(stat_x, stat_i, b, chunks, V, slot: tl.constexpr, SLOTS: tl.constexpr, CHUNKS_PAD: tl.constexpr):
    """Over row b's chunks, the largest value at `slot` of stat_x [B, S, SLOTS] and the lowest id stat_i holds for
    it (V: none)."""
    c = tl.arange(0, CHUNKS_PAD)
    at = (b * chunks + c) * SLOTS + slot
    v = tl.load(stat_x + at, mask=c < chunks, other=float("-inf"))
    m = tl.max(v, axis=0)
    return m, tl.min(tl.where(v == m, tl.load(stat_i + at, mask=c < chunks, other=V), V), axis=0)


@triton.jit
def _track(score, j, win_s, win_j, run_s, run_j):
    """Each lane's winner and runner-up (score, id) after tokens j of scores `score` (ids rising lane by lane)."""
    up = score > win_s
    second = (up == 0) & (score > run_s)
    run_j = tl.where(up, win_j, tl.where(second, j, run_j))
    run_s = tl.where(up, win_s, tl.where(second, score, run_s))
    return tl.where(up, score, win_s), tl.where(up, j, win_j), run_s, run_j


@triton.jit
def _top_two(win_s, win_j, run_s, run_j, V):
    """The lanes' winner (score, lowest id) and runner-up: the best of the other lanes' winners and the winning
    lane's runner-up (ids V: none)."""
    w = tl.max(win_s, axis=0)
    w_j = tl.min(tl.where(win_s == w, win_j, V), axis=0)
    alt_s = tl.where(win_j == w_j, run_s, win_s)
    alt_j = tl.where(win_j == w_j, run_j, win_j)
    r = tl.max(alt_s, axis=0)
    return w, w_j, r, tl.min(tl.where(alt_s == r, alt_j, V), axis=0)


@triton.jit
def _combined_two(stat_x, stat_i, b, chunks, V, slot: tl.constexpr, SLOTS: tl.constexpr, CHUNKS_PAD: tl.constexpr):
    """Over row b's chunks, the winner (slot) and runner-up (slot + 1) of stat_x / stat_i [B, S, SLOTS] -> (winner's
    score, id, runner-up's score, id; V: none)."""
    q = tl.arange(0, CHUNKS_PAD)
    at = (b * chunks + q) * SLOTS + slot
    w_x = tl.load(stat_x + at, mask=q < chunks, other=float("-inf"))
    w_i = tl.load(stat_i + at, mask=q < chunks, other=V)
    r_x = tl.load(stat_x + at + 1, mask=q < chunks, other=float("-inf"))
    r_i = tl.load(stat_i + at + 1, mask=q < chunks, other=V)
    return _top_two(w_x, w_i, r_x, r_i, V)


@triton.jit
def _chunk_kernel(logits, stat_x, stat_i, hist, V, stride, chunk, P, F: tl.constexpr, SLOTS: tl.constexpr,
                  RUNNER_UP: tl.constexpr, BLOCK: tl.constexpr):
    """Step 1 for program (row b, chunk s), the tokens [s chunk, (s + 1) chunk): the largest logit and its lowest id,
    and (a sampled row) the Gumbel winner over every token (score, lowest id), with RUNNER_UP the runner-up (the
    winner over the chunk's other tokens), and, for top-k, the histogram of the keys' top byte. stat_x fp32 / stat_i
    int32 [B, S, SLOTS]: slots 0, 1 and 2 (max logit, winner's score, runner-up's score) / their ids (V where the
    chunk holds only -inf); hist int32 [B, 4, S, 256], pass 1."""
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    row = logits + b * stride
    offs = tl.arange(0, BLOCK)
    r, sampled, low, high, k, floor_e, drop = _row_params(b, V, P, F)
    radix = sampled & (k < V)
    top_l = tl.full([BLOCK], float("-inf"), tl.float32)
    top_j = tl.full([BLOCK], V, tl.int32)
    win_s = tl.full([BLOCK], float("-inf"), tl.float32)
    win_j = tl.full([BLOCK], V, tl.int32)
    run_s = tl.full([BLOCK], float("-inf"), tl.float32)
    run_j = tl.full([BLOCK], V, tl.int32)
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
            if RUNNER_UP:
                win_s, win_j, run_s, run_j = _track(score, j, win_s, win_j, run_s, run_j)
            else:
                up = score > win_s
                win_j = tl.where(up, j, win_j)
                win_s = tl.where(up, score, win_s)
            if radix:
                h += tl.histogram(byte_of(_key(x), 1), 256, mask=valid)
    m = tl.max(top_l, axis=0)
    at = (b * tl.num_programs(1) + s) * SLOTS
    tl.store(stat_x + at, m)
    tl.store(stat_i + at, tl.min(tl.where(top_l == m, top_j, V), axis=0))
    w, w_j, r_s, r_j = _top_two(win_s, win_j, run_s, run_j, V)
    tl.store(stat_x + at + 1, w)
    tl.store(stat_i + at + 1, w_j)
    if RUNNER_UP:
        tl.store(stat_x + at + 2, r_s)
        tl.store(stat_i + at + 2, r_j)
    if F.TOP_K:
        store_hist(hist, b, h, 1)
        clear_hists(hist, b, 2)


@triton.jit
def _radix_kernel(logits, hist, state, V, stride, chunk, P, PASS: tl.constexpr, COUNTED_KEYS: tl.constexpr,
                  CHUNKS_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """Step 2, pass PASS (2..4) for program (row b, chunk s) of a top-k row: the bytes so far from the earlier
    passes' histograms (chunk 0 stores them in state for the later passes), then the histogram of byte PASS of the
    chunk's keys that share them: counted key by key into the histogram the first pass cleared where the row has at
    most COUNTED_KEYS of them (a top-k row's usual case), else by `tl.histogram`'s votes over every key (many keys
    on a few bins would queue their atomic adds: a row of equal logits, or a masked row whose k-th key is -inf)."""
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    chunks = tl.num_programs(1)
    k = tl.minimum(tl.load(P.top_k + b), V).to(tl.int32)
    if (tl.load(P.greedy + b) == 0) & (k < V):
        prefix, shared = pass_prefix(hist, state, b, chunks, k, PASS, CHUNKS_PAD)
        row = logits + b * stride
        r = tl.load(P.inv_temperature + b)
        start = s * chunk
        end = tl.minimum(start + chunk, V)
        if shared <= COUNTED_KEYS:         # two loops, not a branch in one: the counting loop stays short
            for j0 in range(start, end, BLOCK):
                key, mask = _sharing_keys(row, j0, end, r, prefix, PASS, BLOCK)
                count_bytes(hist, b, key, mask, PASS)
        else:
            h = tl.zeros([256], tl.int32)
            for j0 in range(start, end, BLOCK):
                key, mask = _sharing_keys(row, j0, end, r, prefix, PASS, BLOCK)
                h += tl.histogram(byte_of(key, PASS), 256, mask=mask)
            store_hist(hist, b, h, PASS)


@triton.jit
def _sharing_keys(row, j0, end, r, prefix, PASS: tl.constexpr, BLOCK: tl.constexpr):
    """The keys of x at tokens [j0, j0 + BLOCK) and which of them (below end) share the prefix's bytes before byte
    PASS."""
    j = j0 + tl.arange(0, BLOCK)
    key = _key(tl.load(row + j, mask=j < end, other=float("-inf")) * r)
    return key, (j < end) & shares_prefix(key, prefix, PASS)


@triton.jit
def _allowed(x, m_x, kth, floor_e):
    """Whether x passes min-p and top-k, its key and exp(x - max x)."""
    key = _key(x)
    e = tl.exp(x - m_x)
    return (key >= kth) & (e >= floor_e), key, e


@triton.jit
def _pair(c, c_key, c_ok, s, s_key, s_ok):
    """A candidate and a runner-up (ids, keys, whether each may be drawn) -> the same, the runner-up standing in for
    a candidate that may not be."""
    promote = (c_ok == 0) & s_ok
    return (tl.where(promote, s, c), tl.where(promote, s_key, c_key), c_ok | s_ok, s, s_key,
            s_ok & (promote == 0))


@triton.jit
def _x_at(row, r, i, V):
    """Token i's x (i clamped to 0 where it is V: none), and the clamped id."""
    i = tl.where(i < V, i, 0)
    return tl.load(row + i) * r, i


@triton.jit
def _pivots(c_ok, c_key, lo, hi):
    """A search pass's floor (a token at or below it is not the next candidate) and its three pivot keys."""
    return tl.where(c_ok, tl.maximum(lo, c_key), lo), lo + (hi - lo) // 4, lo + (hi - lo) // 2, hi - (hi - lo) // 4


@triton.jit
def _check_pass(row, start, end, r, m_x, kth, floor_e, c_key, s_key, BLOCK: tl.constexpr):
    """A check pass over the tokens [start, end): (T, the masses above c_key, the masses above s_key)."""
    offs = tl.arange(0, BLOCK)
    lane_total = tl.zeros([BLOCK], tl.int64)
    lane_c = tl.zeros([BLOCK], tl.int64)
    lane_s = tl.zeros([BLOCK], tl.int64)
    for j0 in range(start, end, BLOCK):
        j = j0 + offs
        x = tl.load(row + j, mask=j < end, other=float("-inf")) * r
        ok, key, e = _allowed(x, m_x, kth, floor_e)
        m = tl.where(ok & (j < end), tl.math.ceil(e * _MASS_SCALE), 0.0).to(tl.int64)
        lane_total += m
        lane_c += tl.where(key > c_key, m, 0)
        lane_s += tl.where(key > s_key, m, 0)
    return tl.sum(lane_total, axis=0), tl.sum(lane_c, axis=0), tl.sum(lane_s, axis=0)


@triton.jit
def _search_pass(row, start, end, r, low, high, m_x, kth, floor_e, topp, c_key, floor_key, p1, p2, p3, V,
                 BLOCK: tl.constexpr):
    """A search pass over the tokens [start, end): (T, the masses above c_key, p1, p2, p3, and the next candidate
    and its runner-up: the Gumbel winner above floor_key and the winner over the rest (score, lowest id; V: none)).
    Each lane sums its own masses and keeps its own best scores, reduced once after the pass."""
    offs = tl.arange(0, BLOCK)
    lane_total = tl.zeros([BLOCK], tl.int64)
    lane_c = tl.zeros([BLOCK], tl.int64)
    lane_1 = tl.zeros([BLOCK], tl.int64)
    lane_2 = tl.zeros([BLOCK], tl.int64)
    lane_3 = tl.zeros([BLOCK], tl.int64)
    win_s = tl.full([BLOCK], float("-inf"), tl.float32)
    win_j = tl.full([BLOCK], V, tl.int32)
    run_s = tl.full([BLOCK], float("-inf"), tl.float32)
    run_j = tl.full([BLOCK], V, tl.int32)
    for j0 in range(start, end, BLOCK):
        j = j0 + offs
        x = tl.load(row + j, mask=j < end, other=float("-inf")) * r
        allowed, key, e = _allowed(x, m_x, kth, floor_e)
        allowed = allowed & (j < end)
        if topp:
            m = tl.where(allowed, tl.math.ceil(e * _MASS_SCALE), 0.0).to(tl.int64)
            lane_total += m
            lane_c += tl.where(key > c_key, m, 0)
            lane_1 += tl.where(key > p1, m, 0)
            lane_2 += tl.where(key > p2, m, 0)
            lane_3 += tl.where(key > p3, m, 0)
        drawable = allowed & (key > floor_key)
        if tl.max(drawable.to(tl.int32), axis=0) > 0:
            score = tl.where(drawable, x + _gumbel(j, low, high), float("-inf"))
            win_s, win_j, run_s, run_j = _track(score, j, win_s, win_j, run_s, run_j)
    w, w_j, r_s, r_j = _top_two(win_s, win_j, run_s, run_j, V)
    return (tl.sum(lane_total, axis=0), tl.sum(lane_c, axis=0), tl.sum(lane_1, axis=0), tl.sum(lane_2, axis=0),
            tl.sum(lane_3, axis=0), w, w_j, r_s, r_j)


@triton.jit
def _limit(total, drop):
    """A token stays iff the masses above it are below this."""
    return total - tl.floor(total.to(tl.float64) * drop).to(tl.int64)


@triton.jit
def _after_check(c, c_key, s, s_key, s_ok, lo, drop, total, over_c, over_s):
    """After a check pass: take the candidate, else the runner-up, else no candidate, the bracket's floor above both
    (the kept set is an upper set) -> (c, c_ok, c_key, lo, done)."""
    limit = _limit(total, drop)
    take_c = over_c < limit
    take_s = (take_c == 0) & s_ok & (over_s < limit)
    done = take_c | take_s
    lo = tl.where(done, lo, tl.maximum(lo, c_key))
    lo = tl.where(done | (s_ok == 0), lo, tl.maximum(lo, s_key))
    return tl.where(take_s, s, c), done, tl.where(take_s, s_key, c_key), lo, done


@triton.jit
def _after_search(row, r, drop, c, c_ok, c_key, lo, hi, p1, p2, p3, total, over_c, over_1, over_2, over_3, next_s,
                  next_i, run_s, run_i, V):
    """After a search pass: take the candidate, or narrow the bracket (top-p rows) and take the next candidate and
    its runner-up -> (c, c_ok, c_key, s, s_key, s_ok, lo, hi, done, check: the next pass is a check)."""
    topp = drop > 0.0
    limit = _limit(total, drop)
    accept = c_ok & ((topp == 0) | (c_key > hi) | (over_c < limit))
    move = (accept == 0) & topp
    lo = tl.where(move & c_ok, tl.maximum(lo, c_key), lo)
    lo = tl.where(move & (over_1 >= limit), tl.maximum(lo, p1), lo)
    lo = tl.where(move & (over_2 >= limit), tl.maximum(lo, p2), lo)
    lo = tl.where(move & (over_3 >= limit), tl.maximum(lo, p3), lo)
    hi = tl.where(move & (over_3 < limit), tl.minimum(hi, p3), hi)
    hi = tl.where(move & (over_2 < limit), tl.minimum(hi, p2), hi)
    hi = tl.where(move & (over_1 < limit), tl.minimum(hi, p1), hi)
    n_x, n = _x_at(row, r, next_i, V)
    s_x, s = _x_at(row, r, run_i, V)
    n_key = _key(n_x)
    s_key = _key(s_x)
    n, n_key, n_ok, s, s_key, s_ok = _pair(n, n_key, (next_s > float("-inf")) & (n_key > lo), s, s_key,
                                           (run_s > float("-inf")) & (s_key > lo))
    s_ok = s_ok & (accept == 0)
    c = tl.where(accept, c, n)
    c_key = tl.where(accept, c_key, n_key)
    c_ok = tl.where(accept, c_ok, n_ok)
    done = accept | (c_ok & ((topp == 0) | (c_key > hi)))
    return c, c_ok, c_key, s, s_key, s_ok, lo, hi, done, (done == 0) & c_ok & topp


@triton.jit
def _first_candidate(row, stat_x, stat_i, hist, state, b, chunks, V, r, k, floor_e, drop, HAS_TOP_K: tl.constexpr,
                     SLOTS: tl.constexpr, CHUNKS_PAD: tl.constexpr, G_SPAN: tl.constexpr):
    """Step 3's start from the chunks' stats: (c, m_x, kth, c_key, c_ok, s, s_key, s_ok, check, done, lo, hi). With
    top-p the first pass checks an allowed candidate and runner-up."""
    max_l, top_id = _combined(stat_x, stat_i, b, chunks, V, 0, SLOTS, CHUNKS_PAD)
    best, c, s_score, s = _combined_two(stat_x, stat_i, b, chunks, V, 1, SLOTS, CHUNKS_PAD)
    m_x = max_l * r
    kth = tl.zeros([], tl.int64)                        # keys >= kth pass top-k
    if HAS_TOP_K:
        if k < V:
            kth, need = radix_state(hist, state, b, chunks, k, 4, CHUNKS_PAD)
    c_x, c = _x_at(row, r, c, V)
    s_x, s = _x_at(row, r, s, V)
    c_ok, c_key, c_e = _allowed(c_x, m_x, kth, floor_e)
    s_ok, s_key, s_e = _allowed(s_x, m_x, kth, floor_e)
    c, c_key, c_ok, s, s_key, s_ok = _pair(c, c_key, c_ok, s, s_key, s_ok & (s_score > float("-inf")))
    topp = drop > 0.0
    lo = _key(m_x - G_SPAN)             # keys <= lo: not drawn; keys > hi: kept
    return c, m_x, kth, c_key, c_ok, s, s_key, s_ok, c_ok & topp, c_ok & (topp == 0), lo, _key(m_x)


@triton.jit
def _replay(row, mass, stat_x, stat_i, b, chunks, V, r, drop, c, c_ok, c_key, s, s_key, s_ok, check, done, lo, hi,
            TAKE: tl.constexpr, ROUNDS: tl.constexpr, SLOTS: tl.constexpr, CHUNKS_PAD: tl.constexpr):
    """Step 3's first TAKE rounds from their chunks' sums (mass int64 [B, ROUNDS, S, 5]) and a search's next
    candidates (stat slots 3 + 2 round, its runner-up the slot after) -> the state after them and the rounds a row
    not yet done took."""
    taken = tl.zeros([], tl.int32)
    q = tl.arange(0, CHUNKS_PAD)
    for rnd in tl.static_range(TAKE):
        if done == 0:
            at = ((b * ROUNDS + rnd) * chunks + q) * 5
            total = tl.sum(tl.load(mass + at, mask=q < chunks, other=0), axis=0)
            over_c = tl.sum(tl.load(mass + at + 1, mask=q < chunks, other=0), axis=0)
            over_1 = tl.sum(tl.load(mass + at + 2, mask=q < chunks, other=0), axis=0)
            if check:
                c, c_ok, c_key, lo, done = _after_check(c, c_key, s, s_key, s_ok, lo, drop, total, over_c, over_1)
                check = tl.zeros([], tl.int1)
            else:
                floor_key, p1, p2, p3 = _pivots(c_ok, c_key, lo, hi)
                over_2 = tl.sum(tl.load(mass + at + 3, mask=q < chunks, other=0), axis=0)
                over_3 = tl.sum(tl.load(mass + at + 4, mask=q < chunks, other=0), axis=0)
                next_s, next_i, run_s, run_i = _combined_two(stat_x, stat_i, b, chunks, V, 3 + 2 * rnd, SLOTS,
                                                             CHUNKS_PAD)
                c, c_ok, c_key, s, s_key, s_ok, lo, hi, done, check = _after_search(
                    row, r, drop, c, c_ok, c_key, lo, hi, p1, p2, p3, total, over_c, over_1, over_2, over_3, next_s,
                    next_i, run_s, run_i, V)
            taken += 1
    return c, c_ok, c_key, s, s_key, s_ok, check, done, lo, hi, taken


@triton.jit
def _row_state(row, stat_x, stat_i, hist, state, mass, b, chunks, V, r, k, floor_e, drop, TOP_K: tl.constexpr,
               TAKE: tl.constexpr, ROUNDS: tl.constexpr, SLOTS: tl.constexpr, CHUNKS_PAD: tl.constexpr,
               G_SPAN: tl.constexpr):
    """A sampled row's step 3 after its first TAKE rounds over chunks: (c, m_x, kth, c_key, c_ok, s, s_key, s_ok,
    check, done, lo, hi, the rounds it took)."""
    c, m_x, kth, c_key, c_ok, s, s_key, s_ok, check, done, lo, hi = _first_candidate(
        row, stat_x, stat_i, hist, state, b, chunks, V, r, k, floor_e, drop, TOP_K, SLOTS, CHUNKS_PAD, G_SPAN)
    c, c_ok, c_key, s, s_key, s_ok, check, done, lo, hi, taken = _replay(
        row, mass, stat_x, stat_i, b, chunks, V, r, drop, c, c_ok, c_key, s, s_key, s_ok, check, done, lo, hi, TAKE,
        ROUNDS, SLOTS, CHUNKS_PAD)
    return c, m_x, kth, c_key, c_ok, s, s_key, s_ok, check, done, lo, hi, taken


@triton.jit
def _pass_kernel(logits, stat_x, stat_i, hist, state, mass, V, stride, chunk, P, F: tl.constexpr, ROUND: tl.constexpr,
                 ROUNDS: tl.constexpr, SLOTS: tl.constexpr, CHUNKS_PAD: tl.constexpr, BLOCK: tl.constexpr,
                 G_SPAN: tl.constexpr):
    """Step 3's pass ROUND over chunks, program (row b, chunk s) of a sampled row not done after the rounds before
    (replayed from their sums): the chunk's sums (mass [b, ROUND, s]) and, for a search, its next candidate and
    runner-up (stat slots 3 + 2 ROUND and the one after)."""
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    chunks = tl.num_programs(1)
    row = logits + b * stride
    r, sampled, low, high, k, floor_e, drop = _row_params(b, V, P, F)
    if sampled:
        c, m_x, kth, c_key, c_ok, spare, s_key, s_ok, check, done, lo, hi, taken = _row_state(
            row, stat_x, stat_i, hist, state, mass, b, chunks, V, r, k, floor_e, drop, F.TOP_K, ROUND, ROUNDS, SLOTS,
            CHUNKS_PAD, G_SPAN)
        if done == 0:
            start = s * chunk
            end = tl.minimum(start + chunk, V)
            at = ((b * ROUNDS + ROUND) * chunks + s) * 5
            if check:
                total, over_c, over_s = _check_pass(row, start, end, r, m_x, kth, floor_e, c_key, s_key, BLOCK)
                tl.store(mass + at, total)
                tl.store(mass + at + 1, over_c)
                tl.store(mass + at + 2, over_s)
            else:
                floor_key, p1, p2, p3 = _pivots(c_ok, c_key, lo, hi)
                sums = _search_pass(row, start, end, r, low, high, m_x, kth, floor_e, drop > 0.0, c_key, floor_key,
                                    p1, p2, p3, V, BLOCK)
                for q in tl.static_range(5):
                    tl.store(mass + at + q, sums[q])
                slot = (b * chunks + s) * SLOTS + 3 + 2 * ROUND
                tl.store(stat_x + slot, sums[5])
                tl.store(stat_i + slot, sums[6])
                tl.store(stat_x + slot + 1, sums[7])
                tl.store(stat_i + slot + 1, sums[8])


@triton.jit
def _sample_kernel(logits, out, stat_x, stat_i, hist, state, mass, V, stride, chunks, P, F: tl.constexpr,
                   ROUNDS: tl.constexpr, SLOTS: tl.constexpr, CHUNKS_PAD: tl.constexpr, BLOCK: tl.constexpr,
                   G_SPAN: tl.constexpr, MAX_PASSES: tl.constexpr):
    """Row b: a greedy row's argmax from the chunks; a sampled row's step 3 from the chunks' winner and runner-up,
    its first ROUNDS rounds taken from `_pass_kernel`'s chunks, any later one over the whole row."""
    b = tl.program_id(0).to(tl.int64)
    row = logits + b * stride
    r, sampled, low, high, k, floor_e, drop = _row_params(b, V, P, F)
    if sampled:
        c, m_x, kth, c_key, c_ok, s, s_key, s_ok, check, done, lo, hi, passes = _row_state(
            row, stat_x, stat_i, hist, state, mass, b, chunks, V, r, k, floor_e, drop, F.TOP_K, ROUNDS, ROUNDS,
            SLOTS, CHUNKS_PAD, G_SPAN)
        while (done == 0) & (passes < MAX_PASSES):
            if check:
                total, over_c, over_s = _check_pass(row, 0, V, r, m_x, kth, floor_e, c_key, s_key, BLOCK)
                c, c_ok, c_key, lo, done = _after_check(c, c_key, s, s_key, s_ok, lo, drop, total, over_c, over_s)
                check = tl.zeros([], tl.int1)
            else:
                floor_key, p1, p2, p3 = _pivots(c_ok, c_key, lo, hi)
                total, over_c, over_1, over_2, over_3, next_s, next_i, run_s, run_i = _search_pass(
                    row, 0, V, r, low, high, m_x, kth, floor_e, drop > 0.0, c_key, floor_key, p1, p2, p3, V, BLOCK)
                c, c_ok, c_key, s, s_key, s_ok, lo, hi, done, check = _after_search(
                    row, r, drop, c, c_ok, c_key, lo, hi, p1, p2, p3, total, over_c, over_1, over_2, over_3, next_s,
                    next_i, run_s, run_i, V)
            passes += 1
        token = c
    else:
        max_l, token = _combined(stat_x, stat_i, b, chunks, V, 0, SLOTS, CHUNKS_PAD)
    tl.store(out + b, tl.where(token < V, token, 0).to(tl.int64))


def sample_tokens(logits: torch.Tensor, inv_temperature: torch.Tensor, greedy: torch.Tensor,
                  min_p: torch.Tensor | None, top_k: torch.Tensor | None, drop_share: torch.Tensor | None,
                  seeds: torch.Tensor, counters: torch.Tensor, chunks: int | None = None,
                  rounds: int = ROUNDS, counted_keys: int = COUNTED_KEYS) -> torch.Tensor:
    """int64 [B]: one token per row of fp32 logits [B, V] (module docstring; `ref.sample_tokens`). chunks: how many
    programs take each row's chunked passes (by default `plan_chunks`'); rounds: rejection passes over chunks
    before a row's own (with a filter); counted_keys: `_radix_kernel`'s bound on counting key by key."""
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
    dev = logits.device
    F = Filters(min_p is not None, top_k is not None, drop_share is not None)
    filtered = F.MIN_P or F.TOP_K or F.TOP_P
    rounds = rounds if filtered else 0
    slots = 3 + 2 * rounds if filtered else 2   # max logit, winner, runner-up; a search's next two
    stat_x = torch.empty(B, chunks, slots, dtype=torch.float32, device=dev)
    stat_i = torch.empty(B, chunks, slots, dtype=torch.int32, device=dev)
    hist = torch.empty(B, 4, chunks, 256, dtype=torch.int32, device=dev) if top_k is not None else stat_i
    state = torch.empty(B, 4, 2, dtype=torch.int64, device=dev) if top_k is not None else out
    mass = torch.empty(B, rounds, chunks, 5, dtype=torch.int64, device=dev) if rounds else out
    dummy = inv_temperature
    P = Rows(inv_temperature, greedy, dummy if min_p is None else min_p, dummy if top_k is None else top_k,
             dummy if drop_share is None else drop_share, seeds, counters)
    pad = triton.next_power_of_2(chunks)
    _chunk_kernel[(B, chunks)](logits, stat_x, stat_i, hist, V, logits.stride(0), chunk, P, F, slots, filtered,
                               BLOCK, num_warps=8)
    if F.TOP_K:
        for p in (2, 3, 4):
            _radix_kernel[(B, chunks)](logits, hist, state, V, logits.stride(0), chunk, P, p, counted_keys, pad, BLOCK,
                                       num_warps=8)
    for rnd in range(rounds):
        _pass_kernel[(B, chunks)](logits, stat_x, stat_i, hist, state, mass, V, logits.stride(0), chunk, P, F, rnd,
                                  rounds, slots, pad, BLOCK, G_SPAN, num_warps=8)
    _sample_kernel[(B,)](logits, out, stat_x, stat_i, hist, state, mass, V, logits.stride(0), chunks, P, F, rounds,
                         slots, pad, BLOCK, G_SPAN, MAX_PASSES, num_warps=8)
    return out
