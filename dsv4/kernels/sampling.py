"""One token per row of a batch of logits (`ref.sample_tokens`'s contract): passes over chunks of every row; two
launches without filters, three with top-p, six with every filter.

The rules (`ref.sample_kept`): with x = logits * inv_temperature, a row may draw the tokens that pass min-p
(exp(x - max x) >= min_p), top-k (x >= the top_k-th largest x, ties kept) and top-p (with integer masses
m = ceil(exp(x - max x) 2^SAMPLE_MASS_BITS) on what is left and T their sum, a token stays iff the tokens with a
larger x weigh less than T - floor(T * drop_share), drop_share = 1 - top_p). Each filter keeps an upper set of x,
and so do all three. The draw (`ref.draw_by_mass`) lays the masses end to end in token order and takes the token
that holds a uniform integer in [0, T): a 64-bit word of the row's key times T, the top 64 bits of the product.
Integer sums do not depend on their order, so the chunks' programs, the reference and any GPU draw the same token
(up to the last bit of exp). Greedy rows take argmax(logits), ties to the lowest id. Logits may be fp32, bf16 or fp16:
every load widens them to fp32, so a bf16 row draws what its fp32 copy would, without the copy (twice the bytes to
write and then to read in each pass).

Every pass runs one program per (row, chunk of whole blocks; `plan_chunks`: enough programs to keep the loads in
flight); the last program of a row to finish a pass (a per-row counter, release / acquire) does the row's work
that needs the whole row.
1. `_max_kernel`: the largest logit and its lowest id; a top-k row also histograms the top byte of the ordered keys
   of x.
2. A top-k row: three more passes (`_radix_kernel`) finish the radix select of the top_k-th largest key
   (`radix.radix_state`: each program redoes the bytes so far from the summed histograms).
3. `_mass_kernel`: the masses of the tokens min-p and top-k allow, summed per SUB tokens. The row's last program
   makes its draws (`CANDIDATES` with top-p, else one): a draw finds its SUB tokens from the running sums and its
   token from the running masses of those, recomputed. Without top-p the first draw is the token.
4. With top-p, a rejection sampler (FlashInfer's design), `_check_kernel`: the masses above each draw; the row's
   last program takes the first draw the top-p rule keeps. A draw over a set that holds the kept set, taken when
   it lies in the kept set, draws from the kept set; a row keeps one of four draws unless all four fall in the
   dropped tail (about (1 - top_p)^4 of the rows). Such a row's last program finds the kept set itself: a bracket
   (lo, hi) of keys, nothing kept at or below lo and everything above hi kept, narrowed fourfold a pass over the row
   by three pivots until no allowed token lies inside it (at most 16 passes), then one more draw over the kept
   tokens' masses.
Nothing is read back to the host; the launches are the same for any rows, as a CUDA graph needs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .host import num_sms
from .radix import byte_of, chunks_for, clear_hists, count_bytes, pass_prefix, radix_state, shares_prefix, store_hist
from .ref import SAMPLE_CANDIDATES, SAMPLE_MASS_BITS, SPLITMIX64

BLOCK = 2048                  # logits per iteration of a pass
SUB = 512                     # tokens per mass sum a draw searches (BLOCK is a multiple)
CHECK_BLOCK = 1024            # logits per iteration of the check pass: its per-draw sums fit in registers
CANDIDATES = SAMPLE_CANDIDATES   # draws over the allowed tokens a top-p row checks before drawing from its kept set
MAX_PASSES = 20               # a row's own bracket passes: a safety bound above the 16 that narrow 2^32 keys to one
COUNTED_KEYS = 16384          # a radix pass counts key by key up to this many keys of a row sharing the bytes so far
                              # (docs/tuning.md#sampler)
_MASS_SCALE = tl.constexpr(2.0**SAMPLE_MASS_BITS)
_GOLDEN = tl.constexpr(SPLITMIX64[0])
_MIX_1 = tl.constexpr(SPLITMIX64[1])
_MIX_2 = tl.constexpr(SPLITMIX64[2])


@triton.jit
def _key(x):
    """fp32 -> int64 keys in [0, 2^32) ordered as the values (-0.0 and 0.0 equal)."""
    u = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return tl.where(u < 0, u ^ 0x7FFFFFFF, u).to(tl.int64) + 2147483648


@triton.jit
def _key32(x):
    """fp32 -> int32 keys ordered as the values (-0.0 and 0.0 equal): `_key` less 2^31."""
    u = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return tl.where(u < 0, u ^ 0x7FFFFFFF, u)


@triton.jit
def _mix64(z):
    """splitmix64's mixer on uint64."""
    z = (z ^ (z >> 30)) * tl.full([], _MIX_1, tl.uint64)
    z = (z ^ (z >> 27)) * tl.full([], _MIX_2, tl.uint64)
    return z ^ (z >> 31)


@triton.jit
def _row_key(seed, counter):
    """`ref.row_keys` of one row (uint64)."""
    return _mix64(_mix64(seed.to(tl.uint64, bitcast=True))
                  + counter.to(tl.uint64, bitcast=True) * tl.full([], _GOLDEN, tl.uint64))


@triton.jit
def _words(key, first, n: tl.constexpr):
    """`ref.draw_words`' words first .. first + n - 1 of the row with this key (uint64 [n])."""
    r = (first + 1 + tl.arange(0, n)).to(tl.uint64)
    return _mix64(key + r * tl.full([], _GOLDEN, tl.uint64))


@triton.jit
def _mulhi(word, total):
    """`ref.mulhi64`: floor(word * total / 2^64) on uint64, 0 <= total < 2^62, by 32-bit halves."""
    w0 = word & 0xFFFFFFFF
    w1 = word >> 32
    t0 = total & 0xFFFFFFFF
    t1 = total >> 32
    mid_a = w1 * t0
    mid_b = w0 * t1
    carry = ((w0 * t0) >> 32) + (mid_a & 0xFFFFFFFF) + (mid_b & 0xFFFFFFFF)
    return w1 * t1 + (mid_a >> 32) + (mid_b >> 32) + (carry >> 32)


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


PROGRAMS_PER_SM = 8           # a pass reads little per logit: many programs keep enough loads in flight


def plan_chunks(rows: int, vocab: int, sms: int) -> int:
    """Chunks each row's passes split into (`radix.chunks_for`: chunks of at least one BLOCK of logits, about
    PROGRAMS_PER_SM programs an SM)."""
    return chunks_for(rows, vocab, BLOCK, sms, PROGRAMS_PER_SM)


@triton.jit
def _row_params(b, V, P, F: tl.constexpr):
    """Row b's (1 / temperature, sampled (not greedy), k (V: off), min-p, drop share (0: off)) from the `Rows` P
    under the `Filters` F."""
    r = tl.load(P.inv_temperature + b)
    sampled = tl.load(P.greedy + b) == 0
    k = V
    if F.TOP_K:
        k = tl.minimum(tl.load(P.top_k + b), V).to(tl.int32)
    floor_e = tl.zeros([], tl.float32)
    if F.MIN_P:
        floor_e = tl.load(P.min_p + b)
    drop = tl.zeros([], tl.float64)
    if F.TOP_P:
        drop = tl.load(P.drop_share + b)
    return r, sampled, k, floor_e, drop


@triton.jit
def _row_limits(stat_x, stat_i, hist, state, b, chunks, V, P, F: tl.constexpr, CHUNKS_PAD: tl.constexpr):
    """Row b's state for the passes after the largest logit's: its `_row_params` (1 / temperature, sampled, min-p,
    drop share) and, from the chunks' stats, max x, the smallest `_key32` top-k allows (the least: every key) and the
    argmax of the logits with the lowest id (V: none)."""
    r, sampled, k, floor_e, drop = _row_params(b, V, P, F)
    c = tl.arange(0, CHUNKS_PAD)
    v = tl.load(stat_x + b * chunks + c, mask=c < chunks, other=float("-inf"))
    max_l = tl.max(v, axis=0)
    top_id = tl.min(tl.where(v == max_l, tl.load(stat_i + b * chunks + c, mask=c < chunks, other=V), V), axis=0)
    kth = tl.zeros([], tl.int64)
    if F.TOP_K:
        if k < V:
            kth, need = radix_state(hist, state, b, chunks, k, 4, CHUNKS_PAD)
    return r, sampled, floor_e, drop, max_l * r, (kth - 2147483648).to(tl.int32), top_id


@triton.jit
def _masses(row, j, end, r, m_x, kth32, floor_e):
    """The masses (int64) of a row's tokens j (ids below end; any shape) that min-p and top-k allow (0 for the others,
    for -inf and past end), and the `_key32` keys of their x = logits * r; kth32: the smallest key32 top-k allows."""
    valid = j < end
    x = tl.load(row + j, mask=valid, other=float("-inf")).to(tl.float32) * r
    key = _key32(x)
    e = tl.exp(x - m_x)
    ok = valid & (key >= kth32) & (e >= floor_e) & (x > float("-inf"))
    return tl.where(ok, tl.math.ceil(e * _MASS_SCALE), 0.0).to(tl.int64), key


@triton.jit
def _max_kernel(logits, stat_x, stat_i, hist, cnt, V, stride, chunk, P, F: tl.constexpr, BLOCK: tl.constexpr):
    """Step 1 for program (row b, chunk s), the tokens [s chunk, (s + 1) chunk): the largest logit and its lowest id
    (stat_x fp32 / stat_i int32 [B, S]; V where the chunk holds only -inf) and, for a sampled top-k row, the histogram
    of the keys' top byte (hist int32 [B, 4, S, 256], pass 1). Chunk 0 zeroes the row's pass counters (cnt int32
    [B, 2]) for the passes after."""
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    row = logits + b * stride
    offs = tl.arange(0, BLOCK)
    r, sampled, k, floor_e, drop = _row_params(b, V, P, F)
    radix = sampled & (k < V)
    top_l = tl.full([BLOCK], float("-inf"), tl.float32)
    top_j = tl.full([BLOCK], V, tl.int32)
    h = tl.zeros([256], tl.int32)
    start = s * chunk
    end = tl.minimum(start + chunk, V)
    for j0 in range(start, end, BLOCK):
        j = j0 + offs
        lg = tl.load(row + j, mask=j < end, other=float("-inf")).to(tl.float32)
        up = lg > top_l
        top_j = tl.where(up, j, top_j)
        top_l = tl.where(up, lg, top_l)
        if F.TOP_K:
            if radix:
                h += tl.histogram(byte_of(_key(lg * r), 1), 256, mask=j < end)
    m = tl.max(top_l, axis=0)
    tl.store(stat_x + b * tl.num_programs(1) + s, m)
    tl.store(stat_i + b * tl.num_programs(1) + s, tl.min(tl.where(top_l == m, top_j, V), axis=0))
    if s == 0:
        tl.store(cnt + 2 * b + tl.arange(0, 2), tl.zeros([2], tl.int32))
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
    key = _key(tl.load(row + j, mask=j < end, other=float("-inf")).to(tl.float32) * r)
    return key, (j < end) & shares_prefix(key, prefix, PASS)


@triton.jit
def _last_of_row(cnt, chunks):
    """Whether this program is the last of its row's chunks to get here (cnt: the row's counter for this pass): a
    barrier so that every thread's stores come first, then an acquire / release add, so that the last one sees the
    stores of all."""
    tl.debug_barrier()
    return tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == chunks - 1


@triton.jit
def _mass_kernel(logits, out, stat_x, stat_i, hist, state, sums, cand, cnt, V, stride, chunk, NS, P, F: tl.constexpr,
                 D: tl.constexpr, NS_PAD: tl.constexpr, CHUNKS_PAD: tl.constexpr, BLOCK: tl.constexpr,
                 SUB: tl.constexpr):
    """Step 3 for program (row b, chunk s): a sampled row's masses that min-p and top-k allow, summed per SUB tokens
    (sums int64 [B, NS]); the row's last program makes its D draws (cand int32 [B, D]) or, without top-p, stores its
    token in out (a greedy row's: its argmax)."""
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    chunks = tl.num_programs(1)
    r, sampled, floor_e, drop, m_x, kth, token = _row_limits(stat_x, stat_i, hist, state, b, chunks, V, P, F,
                                                             CHUNKS_PAD)
    row = logits + b * stride
    if sampled:
        start = s * chunk
        end = tl.minimum(start + chunk, V)
        for j0 in range(start, end, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            m, key = _masses(row, j, end, r, m_x, kth, floor_e)
            q = j0 // SUB + tl.arange(0, BLOCK // SUB)
            tl.store(sums + b * NS + q, tl.sum(tl.reshape(m, (BLOCK // SUB, SUB)), axis=1), mask=q < NS)
    if _last_of_row(cnt + 2 * b, chunks):
        if sampled:
            key = _row_key(tl.load(P.seeds + b), tl.load(P.counters + b))
            c = _draws(row, r, m_x, kth, floor_e, sums + b * NS, NS, _words(key, 0, D), V, D, NS_PAD, SUB)
            if F.TOP_P:
                tl.store(cand + b * D + tl.arange(0, D), c.to(tl.int32))
            token = tl.sum(tl.where(tl.arange(0, D) == 0, c, 0), axis=0)
        if not F.TOP_P:
            tl.store(out + b, tl.where(token < V, token, 0).to(tl.int64))


@triton.jit
def _draws(row, r, m_x, kth, floor_e, sums_row, NS, words, V, D: tl.constexpr, NS_PAD: tl.constexpr,
           SUB: tl.constexpr):
    """The tokens [D] that `ref.draw_by_mass` draws with words [D] (uint64) over the allowed masses whose sums per SUB
    tokens start at sums_row (V: the row weighs nothing): each word's SUB tokens from the running sums, its token
    from the running masses of those."""
    q = tl.arange(0, NS_PAD)
    sums = tl.load(sums_row + q, mask=q < NS, other=0)
    running = tl.cumsum(sums, axis=0)
    total = tl.sum(sums, axis=0)
    u = _mulhi(words, total.to(tl.uint64)).to(tl.int64)                                  # [D]
    at = tl.sum((running[None, :] <= u[:, None]).to(tl.int32), axis=1)                   # [D] the sums holding u
    base = tl.sum(tl.where(q[None, :] < at[:, None], sums[None, :], 0), axis=1)
    j = at[:, None] * SUB + tl.arange(0, SUB)[None, :]
    m, key = _masses(row, j, V, r, m_x, kth, floor_e)
    inside = tl.sum((tl.cumsum(m, axis=1) <= (u - base)[:, None]).to(tl.int32), axis=1)
    return tl.where(total > 0, at * SUB + inside, V)


@triton.jit
def _cand_keys(row, r, cand_row, V, D: tl.constexpr):
    """A row's D draws (V: none) and the `_key32` keys of their x (the largest int32, above every key of a value,
    where a draw is none)."""
    c = tl.load(cand_row + tl.arange(0, D))
    c = tl.where((c >= 0) & (c < V), c, V)
    x = tl.load(row + tl.where(c < V, c, 0)).to(tl.float32) * r
    return tl.where(c < V, _key32(x), 2147483647), c


@triton.jit
def _check_kernel(logits, out, stat_x, stat_i, hist, state, sums, cand, over, cnt, V, stride, chunk, NS, P,
                  F: tl.constexpr, D: tl.constexpr, NS_PAD: tl.constexpr, CHUNKS_PAD: tl.constexpr,
                  CHECK_BLOCK: tl.constexpr, SUB: tl.constexpr, MAX_PASSES: tl.constexpr):
    """Step 4 for program (row b, chunk s) (a batch with top-p): a sampled top-p row's allowed masses above each of
    its D draws (over int64 [B, S, D]); the row's last program stores the row's token in out (`_take`)."""
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    chunks = tl.num_programs(1)
    r, sampled, floor_e, drop, m_x, kth, token = _row_limits(stat_x, stat_i, hist, state, b, chunks, V, P, F,
                                                             CHUNKS_PAD)
    row = logits + b * stride
    if sampled & (drop > 0.0):
        c_key, c = _cand_keys(row, r, cand + b * D, V, D)
        lanes = tl.zeros([D, CHECK_BLOCK], tl.int64)
        start = s * chunk
        end = tl.minimum(start + chunk, V)
        for j0 in range(start, end, CHECK_BLOCK):
            j = j0 + tl.arange(0, CHECK_BLOCK)
            m, key = _masses(row, j, end, r, m_x, kth, floor_e)
            lanes += tl.where(key[None, :] > c_key[:, None], m[None, :], 0)
        tl.store(over + (b * chunks + s) * D + tl.arange(0, D), tl.sum(lanes, axis=1))
    if _last_of_row(cnt + 2 * b + 1, chunks):
        if sampled:
            token = _take(row, r, m_x, kth, floor_e, drop, sums + b * NS, NS, cand + b * D, over + b * chunks * D,
                          chunks, P, b, V, D, NS_PAD, CHUNKS_PAD, SUB, MAX_PASSES)
        tl.store(out + b, tl.where(token < V, token, 0).to(tl.int64))


@triton.jit
def _take(row, r, m_x, kth, floor_e, drop, sums_row, NS, cand_row, over_row, chunks, P, b, V, D: tl.constexpr,
          NS_PAD: tl.constexpr, CHUNKS_PAD: tl.constexpr, SUB: tl.constexpr, MAX_PASSES: tl.constexpr):
    """A sampled row's token: without top-p its first draw; with top-p the first of its draws the rule keeps, else
    (none kept) a draw over its kept set found by the bracket (`_kept_floor`, SUB logits an iteration: few registers
    for a path that is seldom taken)."""
    c_key, c = _cand_keys(row, r, cand_row, V, D)
    d = tl.arange(0, D)
    token = tl.sum(tl.where(d == 0, c, 0), axis=0)
    if drop > 0.0:
        q = tl.arange(0, NS_PAD)
        total = tl.sum(tl.load(sums_row + q, mask=q < NS, other=0), axis=0)
        limit = _limit(total, drop)
        w = tl.arange(0, CHUNKS_PAD)
        above = tl.sum(tl.load(over_row + w[:, None] * D + d[None, :], mask=(w < chunks)[:, None], other=0),
                       axis=0)                                                                     # [D]
        first = tl.min(tl.where((above < limit) & (c < V), d, D), axis=0)
        token = tl.sum(tl.where(d == first, c, 0), axis=0)
        if (first == D) & (total > 0):
            # every draw fell in the dropped tail: nothing at or below the highest of them is kept
            lo = tl.max(tl.where(c < V, c_key, -2147483648), axis=0).to(tl.int64)
            mass_lo = tl.min(tl.where(c < V, above, total), axis=0)         # the masses above lo: the least above
            lo, mass_lo = _kept_floor(row, r, m_x, kth, floor_e, lo, mass_lo, _key32(m_x).to(tl.int64), limit, V,
                                      SUB, MAX_PASSES)
            key = _row_key(tl.load(P.seeds + b), tl.load(P.counters + b))
            token = _draw_above(row, r, m_x, kth, floor_e, lo, mass_lo, tl.sum(_words(key, D, 1), axis=0), V, SUB)
    return token


@triton.jit
def _limit(total, drop):
    """A token stays iff the masses above it are below this."""
    return total - tl.floor(total.to(tl.float64) * drop).to(tl.int64)


@triton.jit
def _bracket_pass(row, r, m_x, kth, floor_e, lo, hi, V, BLOCK: tl.constexpr):
    """One pass over the row for `_kept_floor`: its pivots p1 <= p2 <= p3 in [lo, hi], the allowed masses above each
    [3] and how many allowed tokens of mass lie strictly inside each of (lo, p1), (p1, p2), (p2, p3), (p3, hi) [4]."""
    i3 = tl.arange(0, 4)
    span = hi - lo
    ends = tl.where(i3 == 0, lo, tl.where(i3 == 1, lo + span // 4, tl.where(i3 == 2, lo + span // 2,
                                                                           hi - span // 4)))   # lo, p1, p2, p3
    tops = tl.where(i3 == 3, hi, tl.where(i3 == 0, lo + span // 4, tl.where(i3 == 1, lo + span // 2, hi - span // 4)))
    above = tl.zeros([4, BLOCK], tl.int64)
    inside = tl.zeros([4, BLOCK], tl.int32)
    for j0 in range(0, V, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        m, key = _masses(row, j, V, r, m_x, kth, floor_e)
        key = key.to(tl.int64)[None, :]
        above += tl.where(key > ends[:, None], m[None, :], 0)
        inside += ((key > ends[:, None]) & (key < tops[:, None]) & (m[None, :] > 0)).to(tl.int32)
    return ends, tl.sum(above, axis=1), tl.sum(inside, axis=1)


@triton.jit
def _kept_floor(row, r, m_x, kth, floor_e, lo, mass_lo, hi, limit, V, BLOCK: tl.constexpr,
                MAX_PASSES: tl.constexpr):
    """A top-p row's kept set, the allowed tokens with a key above the returned lo, and their mass: from the bracket
    (lo, hi), the masses above lo at least the limit (nothing at or below lo kept) and those above hi below it
    (everything above hi kept), narrowed until no allowed token of mass lies strictly inside it."""
    undecided = tl.full([], 1, tl.int32)
    passes = tl.zeros([], tl.int32)
    i3 = tl.arange(0, 4)
    while (undecided > 0) & (passes < MAX_PASSES):
        ends, above, inside = _bracket_pass(row, r, m_x, kth, floor_e, lo, hi, V, BLOCK)
        above = tl.where(i3 == 0, mass_lo, above)
        # the masses above a key fall as the key rises: the pivots at or above the limit are a prefix of (lo, p1..p3)
        n = tl.sum((above >= limit).to(tl.int32), axis=0) - 1                 # the new lo's place in (lo, p1..p3)
        new_lo = tl.sum(tl.where(i3 == n, ends, 0), axis=0)
        mass_lo = tl.sum(tl.where(i3 == n, above, 0), axis=0)
        hi = tl.where(n == 3, hi, tl.sum(tl.where(i3 == n + 1, ends, 0), axis=0))
        lo = new_lo
        undecided = tl.sum(tl.where(i3 == n, inside, 0), axis=0)
        passes += 1
    return lo, mass_lo


@triton.jit
def _draw_above(row, r, m_x, kth, floor_e, lo, total, word, V, BLOCK: tl.constexpr):
    """`ref.draw_by_mass` with one word over the allowed masses of keys above lo (their sum: total), block by block
    in token order until the running sum passes the drawn integer (V: total 0)."""
    u = _mulhi(word, total.to(tl.uint64)).to(tl.int64)
    acc = tl.zeros([], tl.int64)
    token = tl.full([], V, tl.int32)
    j0 = tl.zeros([], tl.int32)
    while (j0 < V) & (token == V) & (total > 0):
        j = j0 + tl.arange(0, BLOCK)
        m, key = _masses(row, j, V, r, m_x, kth, floor_e)
        m = tl.where(key.to(tl.int64) > lo, m, 0)
        here = tl.sum(m, axis=0)
        if acc + here > u:
            token = j0 + tl.sum((tl.cumsum(m, axis=0) <= u - acc).to(tl.int32), axis=0)
        acc += here
        j0 += BLOCK
    return token


def sample_tokens(logits: torch.Tensor, inv_temperature: torch.Tensor, greedy: torch.Tensor,
                  min_p: torch.Tensor | None, top_k: torch.Tensor | None, drop_share: torch.Tensor | None,
                  seeds: torch.Tensor, counters: torch.Tensor, chunks: int | None = None,
                  candidates: int = CANDIDATES, counted_keys: int = COUNTED_KEYS) -> torch.Tensor:
    """int64 [B]: one token per row of logits [B, V] (fp32, bf16 or fp16; module docstring; `ref.sample_tokens`).
    chunks: how many programs take each row's chunked passes (by default `plan_chunks`'); candidates: draws a top-p
    row checks before its own bracket (a power of two; `ref.sample_tokens` must be given the same); counted_keys:
    `_radix_kernel`'s bound on counting key by key."""
    B, V = logits.shape
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B == 0:
        return out
    if candidates < 1 or candidates & (candidates - 1):
        raise ValueError(f"sample_tokens: candidates must be a power of two, got {candidates}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if chunks is None:
        chunks = plan_chunks(B, V, num_sms(logits.device))
    chunk = BLOCK * triton.cdiv(triton.cdiv(V, BLOCK), chunks)    # whole blocks; the last chunk may be shorter
    chunks = triton.cdiv(V, chunk)
    ns = triton.cdiv(V, SUB)
    dev = logits.device
    F = Filters(min_p is not None, top_k is not None, drop_share is not None)
    D = candidates if F.TOP_P else 1
    stat_x = torch.empty(B, chunks, dtype=torch.float32, device=dev)
    stat_i = torch.empty(B, chunks, dtype=torch.int32, device=dev)
    cnt = torch.empty(B, 2, dtype=torch.int32, device=dev)
    hist = torch.empty(B, 4, chunks, 256, dtype=torch.int32, device=dev) if F.TOP_K else stat_i
    state = torch.empty(B, 4, 2, dtype=torch.int64, device=dev) if F.TOP_K else out
    sums = torch.empty(B, ns, dtype=torch.int64, device=dev)
    cand = torch.empty(B, D, dtype=torch.int32, device=dev) if F.TOP_P else stat_i
    over = torch.empty(B, chunks, D, dtype=torch.int64, device=dev) if F.TOP_P else sums
    dummy = inv_temperature
    P = Rows(inv_temperature, greedy, dummy if min_p is None else min_p, dummy if top_k is None else top_k,
             dummy if drop_share is None else drop_share, seeds, counters)
    pad, ns_pad = triton.next_power_of_2(chunks), triton.next_power_of_2(ns)
    stride = logits.stride(0)
    _max_kernel[(B, chunks)](logits, stat_x, stat_i, hist, cnt, V, stride, chunk, P, F, BLOCK, num_warps=8)
    if F.TOP_K:
        for p in (2, 3, 4):
            _radix_kernel[(B, chunks)](logits, hist, state, V, stride, chunk, P, p, counted_keys, pad, BLOCK,
                                       num_warps=8)
    _mass_kernel[(B, chunks)](logits, out, stat_x, stat_i, hist, state, sums, cand, cnt, V, stride, chunk, ns, P, F,
                              D, ns_pad, pad, BLOCK, SUB, num_warps=8)
    if F.TOP_P:
        _check_kernel[(B, chunks)](logits, out, stat_x, stat_i, hist, state, sums, cand, over, cnt, V, stride, chunk,
                                   ns, P, F, D, ns_pad, pad, CHECK_BLOCK, SUB, MAX_PASSES, num_warps=8)
    return out
