"""V4's cached attention for every token of a ragged step in one launch: the sliding window (the slot's ring of
earlier tokens and this step's own rows) and the compressed entries (HCA: every visible entry of the sequence's
pages; CSA: the indexer's picks), one online softmax with the sink, shared K = V.

Inputs (N tokens of B sequences; D = head_dim, W = window, E entries per page):
    q        [N, H, D]          rotated queries
    kv       [N, D]             this step's rotated K = V rows, the step's tokens in order
    ring     [slots, W, D]      each slot's last W rows before the step: position p at row p mod W
    entries  [pages, E, D]      compressed entries (None for sliding-only layers), or packed fp8 rows uint8
                                [pages, E, kv_row_bytes] (`ref.fp8_kv_pack`, the fp8 cache) decoded as they load
    picks    [N, K] int         CSA: entry ids per token, -1 = none (None for HCA and sliding-only layers)
    steps    `StepTokens`       per token its sequence and position; per sequence its slot, start, first token,
                                page table
A program takes one token and BH heads: every key row it loads serves all BH heads (MQA), so a decode step reads
each sequence's rows H / BH times, not H times. When the step has too few (token, head block) programs to fill the
GPU (a small decode batch), the keys are split too (flash-decoding): programs s = 0..SPLIT each take an equal,
contiguous share of the ring's rows followed by the entries (`_key_shares`), the first one also the step's rows
(ring rows load faster than gathered entries); each leaves its fp32 partial (accumulator, running max and sum) in a
workspace, and `_combine_kernel` merges them with the sink. Keys come in blocks of BK: the ring rows holding
positions in (p - W, start), the step's rows at positions [max(start, p - W + 1), p], then the entries; masked keys
score -inf. The sink joins only the denominator. `update_ring` (decode steps: one token per sequence) also writes
each token's row into its ring at row p mod W, from the program of head block 0 and share 0 before it reads any key:
the row it replaces holds position p - W, which no query of the step sees, so every program's read of that row is
masked whatever it finds there. fp32 softmax and accumulator; the products run in `dot_dtype` (bf16 on the GPU, fp32
for fp32 queries; fp32 in the interpreter, whose bf16 dot is wrong), fp32 ones as fp32 (`dot_in`).

With `rope` (and `q_eps`) the launch also does the norm / rope launches' work around it: each program normalises its
heads' queries (the unweighted RMS of each head) and rotates their trailing channels, each channel's pair mate loaded
beside it, and the program that stores a head's output (the attention program without a split, the combine with
one) rotates it back in registers (`norm_rope_rows`). The roundings are `kernels.norm_rope`'s. A wide plan (64 heads a
program) leaves both to a norm / rope launch before and after it: there the values spill into the key loops. With
PDL the attention and combine launches let the next one start first thing, as the norm / rope launch does: the
GEMV after them (wo_a) waits for them before it reads anything.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from .host import has_pdl, num_sms
from .norm_rope import norm_rope, norm_rope_rows
from .policy import next_pow2
from .ref import kv_row_bytes
from .steps import StepTokens

WIDE_HEADS = 64     # heads a program of a launch with enough tokens (`plan_attention`; docs/tuning.md#attention-plan)
SHARE_KEYS = 128    # the fewest keys a share of a key split takes (`attention_split`, `wide_plan`; same section)
COMBINE_UNROLL = 4  # partials `_combine_kernel` reads at once (docs/tuning.md#attention-plan)


class Tensors(NamedTuple):
    q: torch.Tensor
    kv: torch.Tensor
    ring: torch.Tensor
    entries: torch.Tensor      # (the ring where the layer has none: never read)
    picks: torch.Tensor        # int32 or int64 (the step's `seq` where there are none: never read)
    sinks: torch.Tensor        # fp32 [H]
    out: torch.Tensor
    part_o: torch.Tensor       # SPLIT: fp32 [N, H, 1 + SPLIT, D] partial accumulators (else `out`: never used)
    part_ml: torch.Tensor      # SPLIT: fp32 [N, H, 1 + SPLIT, 2] their running max and sum
    cos: torch.Tensor          # HALF_ROPE: [N, HALF_ROPE] each token's rope (else q: never read)
    sin: torch.Tensor


class Strides(NamedTuple):
    q_t: int
    q_h: int
    out_t: int
    out_h: int
    ring_slot: int
    pages_seq: int
    kv_t: int
    entry_row: int             # elements of an entries row (bytes of a packed row: 584, no multiple of 16, so the
                               # compiler assumes no more alignment of a row than it has)
    rope_t: int                # between two tokens' rows of cos / sin


class Shape(NamedTuple):
    """The launch's compile-time values (one constexpr)."""
    W: int                     # window
    D: int                     # head_dim
    E: int                     # entries per page
    K: int                     # picks per token (CSA)
    RATIO: int                 # 0 (sliding only), 4 (CSA) or 128 (HCA)
    BH: int                    # heads per program
    BK: int                    # keys per block
    DOT: object                # operand dtype of the products
    SPLIT: int                 # programs over a token's keys besides the first (0: one program takes all keys)
    UPDATE_RING: bool          # the step's rows into the rings (decode steps)
    NOPE: int                  # > 0: entries are packed fp8 rows (`ref.fp8_kv_pack`) with this many fp8 channels
    Q_NORM: int                # 1: each query head RMS-normalised first (unweighted, eps q_eps)
    HALF_ROPE: int             # > 0: queries rotated first and the output back (the trailing 2 HALF_ROPE channels)
    PDL: bool                  # let the next launch start now (`host.has_pdl`): the decode GEMV after attention (wo_a)
                               # waits for it before it reads anything, and meanwhile L2-prefetches its weights


@triton.jit
def _queries(T, S, t, h, d, eps, H, L: tl.constexpr):
    """Token t's heads h as q [BH, D]: as stored, or (Q_NORM / HALF_ROPE) as the norm / rope launch would make them
    from the stored values (`norm_rope_rows`' order and roundings): the unweighted RMS factor and the normalised
    values rounded to q's dtype, then the rotation of the trailing 2 HALF_ROPE channels, pair (2i, 2i+1) = (a, b) ->
    (a c - b s, b c + a s), rounded once. Each channel's pair mate (channel d ^ 1) is loaded beside it, so no value
    moves between threads; the angles load first, beside the queries."""
    at = T.q + t.to(tl.int64) * S.q_t + h[:, None] * S.q_h
    if L.HALF_ROPE > 0:
        i = d // 2 - (L.D // 2 - L.HALF_ROPE)
        rot = i >= 0
        at_rope = t.to(tl.int64) * S.rope_t
        c = tl.load(T.cos + at_rope + i, mask=rot, other=1.0)
        s = tl.load(T.sin + at_rope + i, mask=rot, other=0.0)
        partner = tl.load(at + (d ^ 1)[None, :], mask=rot[None, :] & (h < H)[:, None], other=0.0).to(tl.float32)
    q = tl.load(at + d[None, :], mask=(h < H)[:, None], other=0.0)
    if L.Q_NORM + L.HALF_ROPE > 0:
        dtype = T.q.dtype.element_ty
        v = q.to(tl.float32)
        if L.Q_NORM:
            f = tl.rsqrt(tl.sum(v * v, axis=1) / L.D + eps).to(dtype).to(tl.float32)
            v = (v * f[:, None]).to(dtype).to(tl.float32)
            if L.HALF_ROPE > 0:
                partner = (partner * f[:, None]).to(dtype).to(tl.float32)
        if L.HALF_ROPE > 0:
            v = v * c[None, :] + tl.where(d % 2 == 0, -partner, partner) * s[None, :]
        q = v.to(dtype)
    return q


@triton.jit
def _store_output(T, S, t, h, d, o, H, D: tl.constexpr, HALF_ROPE: tl.constexpr):
    """o fp32 [BH, D] of token t's heads h into out in its dtype; HALF_ROPE: its trailing channels rotated back first,
    from its values in out's dtype (the inverse of `_queries`' rotation, rounded once: `norm_rope_rows`)."""
    dtype = T.out.dtype.element_ty
    if HALF_ROPE > 0:
        at_rope = t.to(tl.int64) * S.rope_t
        o = norm_rope_rows(o.to(dtype).to(tl.float32), d, d < D, T.cos, T.cos + at_rope, T.sin + at_rope, 0.0, dtype,
                           D, D, 0, HALF_ROPE, True)
    tl.store(T.out + t.to(tl.int64) * S.out_t + h[:, None] * S.out_h + d[None, :], o.to(dtype), mask=(h < H)[:, None])


@triton.jit
def dot_in(a, b, DOT: tl.constexpr):
    """a @ b with both operands in DOT, accumulated in fp32. fp32 operands multiply as fp32 (input precision
    "ieee"), not as the tf32 that Triton's dot defaults to on the GPU: an fp32 model computes in fp32."""
    if DOT == tl.float32:
        return tl.dot(a.to(DOT), b.to(DOT), out_dtype=tl.float32, input_precision="ieee")
    else:
        return tl.dot(a.to(DOT), b.to(DOT), out_dtype=tl.float32)


@triton.jit
def _online(acc, m_i, l_i, q, k, valid, scale, DOT: tl.constexpr):
    """One block of keys k [BK, D] (masked by valid [BK]) into the running softmax of q [BH, D]."""
    s = dot_in(q, tl.trans(k), DOT) * scale
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)    # no key yet: keep exp() away from -inf - -inf
    alpha = tl.exp(m_i - m_use)
    p = tl.exp(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + dot_in(p, k, DOT)
    return acc, m_new, l_i


@triton.jit
def _entry_keys(T, S, rows, valid, d, L: tl.constexpr):
    """Entries at `rows` [BK] (page * E + row of the page; masked by valid) -> keys [BK, D]: the rows themselves, or
    packed fp8 rows decoded in DOT (exactly: an e4m3 code times its block's power of two fits bf16; the rope
    channels' bf16)."""
    if L.NOPE > 0:
        NOPE: tl.constexpr = L.NOPE
        at = T.entries + rows[:, None] * S.entry_row
        nope = valid[:, None] & (d < NOPE)[None, :]
        rope = valid[:, None] & (d >= NOPE)[None, :]
        # each channel's code and its block's exponent byte (8 distinct bytes a row: cached), the rope channels' bf16
        # from their two bytes; byte loads only, and no reshape (a row starts 8-byte aligned)
        code = tl.load(at + d[None, :], mask=nope, other=0).to(tl.float8e4nv, bitcast=True).to(L.DOT)
        exponent = tl.load(at + (2 * L.D - NOPE) + d[None, :] // 64, mask=nope, other=0).to(tl.int32)
        scale = (exponent << 23).to(tl.float32, bitcast=True).to(L.DOT)
        lo = tl.load(at + NOPE + 2 * (d[None, :] - NOPE), mask=rope, other=0).to(tl.int32)
        hi = tl.load(at + NOPE + 2 * (d[None, :] - NOPE) + 1, mask=rope, other=0).to(tl.int32)
        rope_values = ((hi << 24) | (lo << 16)).to(tl.float32, bitcast=True).to(L.DOT)
        k = tl.where((d < NOPE)[None, :], code * scale, rope_values)
    else:
        k = tl.load(T.entries + rows[:, None] * S.entry_row + d[None, :], mask=valid[:, None], other=0.0)
    return k


@triton.jit
def _entry_block(T, steps, S, t, b, e0, e_hi, d, L: tl.constexpr):
    """Block [e0, e0 + BK) of token t's entries below e_hi -> (keys [BK, D], valid [BK]): HCA's entries in order,
    CSA's picks (-1: none); nothing is read past e_hi."""
    E: tl.constexpr = L.E
    i = e0 + tl.arange(0, L.BK)
    if L.RATIO == 4:
        j = tl.load(T.picks + t.to(tl.int64) * L.K + i, mask=i < e_hi, other=-1)
        valid = j >= 0
    else:
        j = i
        valid = i < e_hi
    page = tl.load(steps.pages + b * S.pages_seq + j // E, mask=valid, other=0).to(tl.int64)
    return _entry_keys(T, S, page * E + j % E, valid, d, L), valid


@triton.jit
def _attention_kernel(T, steps, S, H, scale, q_eps, L: tl.constexpr):
    W: tl.constexpr = L.W
    D: tl.constexpr = L.D
    E: tl.constexpr = L.E
    K: tl.constexpr = L.K
    RATIO: tl.constexpr = L.RATIO
    BK: tl.constexpr = L.BK
    BH: tl.constexpr = L.BH
    DOT: tl.constexpr = L.DOT
    SPLIT: tl.constexpr = L.SPLIT
    if L.PDL:
        gdc_launch_dependents()
    t, hb, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b = tl.load(steps.seq + t)
    p = tl.load(steps.pos + t)
    slot = tl.load(steps.slot + b).to(tl.int64)
    start = tl.load(steps.start + b)
    first = tl.load(steps.first + b)
    h = hb * BH + tl.arange(0, BH)
    d = tl.arange(0, D)
    if L.UPDATE_RING:      # first: the row it replaces (position p - W) is masked for every query of the step
        if (hb == 0) & (part == 0):
            tl.store(T.ring + slot * S.ring_slot + (p % W) * D + d, tl.load(T.kv + t.to(tl.int64) * S.kv_t + d))
    q = _queries(T, S, t, h, d, q_eps, H, L)
    acc = tl.zeros([BH, D], tl.float32)
    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    lo = p - W                                     # keys at positions > lo are in the window
    # HCA: every entry j with (j + 1) * 128 <= p + 1; CSA: the picks
    n_entries = (p + 1) // RATIO if RATIO == 128 else K if RATIO == 4 else 0
    r_lo, r_hi, e_lo, e_hi = _key_shares(n_entries, part, W, SPLIT)
    # the ring: row r holds the latest position < start that is r mod W (none if start - 1 < r)
    for r0 in range(r_lo, r_hi, BK):
        r = r0 + tl.arange(0, BK)
        back = start - 1 - r
        held = tl.where(back >= 0, start - 1 - back % W, -1)
        valid = (r < r_hi) & (held >= 0) & (held > lo)
        k = tl.load(T.ring + slot * S.ring_slot + r[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
        acc, m_i, l_i = _online(acc, m_i, l_i, q, k, valid, scale, DOT)
    if part == 0:                                  # this step's rows of the sequence, up to the token itself
        j_lo = tl.maximum(start, lo + 1)
        for j0 in range(j_lo, p + 1, BK):
            j = j0 + tl.arange(0, BK)
            valid = j <= p
            row = (first + j - start).to(tl.int64)
            k = tl.load(T.kv + row[:, None] * S.kv_t + d[None, :], mask=valid[:, None], other=0.0)
            acc, m_i, l_i = _online(acc, m_i, l_i, q, k, valid, scale, DOT)
    if RATIO > 0:
        for e0 in range(e_lo, e_hi, BK):
            k, valid = _entry_block(T, steps, S, t, b, e0, e_hi, d, L)
            acc, m_i, l_i = _online(acc, m_i, l_i, q, k, valid, scale, DOT)
    if SPLIT == 0:
        sink = tl.load(T.sinks + h, mask=h < H, other=0.0)
        _store_output(T, S, t, h, d, acc / (l_i + tl.exp(sink - m_i))[:, None], H, D, L.HALF_ROPE)
    else:                                          # the partial, for `_combine_kernel`
        row = (t.to(tl.int64) * H + h) * (SPLIT + 1) + part
        tl.store(T.part_o + row[:, None] * D + d[None, :], acc, mask=(h < H)[:, None])
        tl.store(T.part_ml + row * 2, m_i, mask=h < H)
        tl.store(T.part_ml + row * 2 + 1, l_i, mask=h < H)


@triton.jit
def _key_shares(n, part, W: tl.constexpr, SPLIT: tl.constexpr):
    """The ring rows [r_lo, r_hi) and the entries [e_lo, e_hi) (of n) that program `part` takes: all of them
    without a split; with one, an equal share of the W ring rows followed by the n entries, so that every one of the
    SPLIT + 1 programs reads about (W + n) / (SPLIT + 1) keys."""
    if SPLIT == 0:
        r_lo = part * 0
        r_hi = part * 0 + W
        e_lo = n * 0
        e_hi = n
    else:
        size = (W + n + SPLIT) // (SPLIT + 1)
        lo = part * size
        hi = lo + size
        r_lo = tl.minimum(lo, W)
        r_hi = tl.minimum(hi, W)
        e_lo = tl.minimum(tl.maximum(lo - W, 0), n)
        e_hi = tl.minimum(tl.maximum(hi - W, 0), n)
    return r_lo, r_hi, e_lo, e_hi


@triton.jit
def _combine_kernel(T, S, H, SPLIT: tl.constexpr, D: tl.constexpr, BH: tl.constexpr, UNROLL: tl.constexpr,
                    HALF_ROPE: tl.constexpr, PDL: tl.constexpr):
    """Token t, heads of block hb: merge the 1 + SPLIT partials with the sink (which joins only the denominator),
    then (HALF_ROPE) rotate the output back as `_attention_kernel` does without a split. The partials are read
    UNROLL at a time, their loads issued together rather than one round trip each; those past SPLIT load as weight
    0 and add exact zeros. PDL: the next launch may start now (`Shape.PDL`)."""
    if PDL:
        gdc_launch_dependents()
    t, hb = tl.program_id(0), tl.program_id(1)
    h = hb * BH + tl.arange(0, BH)
    d = tl.arange(0, D)
    hm = h < H
    base = (t.to(tl.int64) * H + h) * (SPLIT + 1)
    top = tl.load(T.sinks + h, mask=hm, other=0.0)
    for s0 in range(0, SPLIT + 1, UNROLL):
        for i in tl.static_range(UNROLL):
            ok = hm & (h * 0 + s0 + i <= SPLIT)         # (a mask of the heads' shape: the interpreter's s0 is an int)
            top = tl.maximum(top, tl.load(T.part_ml + (base + s0 + i) * 2, mask=ok, other=float("-inf")))
    den = tl.exp(tl.load(T.sinks + h, mask=hm, other=0.0) - top)
    acc = tl.zeros([BH, D], tl.float32)
    for s0 in range(0, SPLIT + 1, UNROLL):
        for i in tl.static_range(UNROLL):
            s = s0 + i
            ok = hm & (h * 0 + s <= SPLIT)
            w = tl.exp(tl.load(T.part_ml + (base + s) * 2, mask=ok, other=float("-inf")) - top)
            den += w * tl.load(T.part_ml + (base + s) * 2 + 1, mask=ok, other=0.0)
            acc += w[:, None] * tl.load(T.part_o + (base + s)[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
    _store_output(T, S, t, h, d, acc / den[:, None], H, D, HALF_ROPE)


class AttentionPlan(NamedTuple):
    """A launch's geometry (`plan_attention`)."""
    heads: int                 # query heads a program takes (BH)
    keys: int                  # keys a block (BK)
    warps: int
    split: int                 # programs over a token's keys besides the first (0: one program takes all keys)


@lru_cache(maxsize=None)
def plan_attention(tokens: int, heads: int, head_dim: int, window: int, entries: int, packed: bool, sms: int,
                   split: int | None = None) -> AttentionPlan:
    """The geometry of a launch of `tokens` tokens seeing a window of up to `window` keys and up to `entries` entries
    (pure, cached). Where they fill at least half the GPU (`wide_plan`), programs of every head of a token, WIDE_HEADS,
    on 8 warps, 32 keys a block: each key row is read once per token and the products have 64 rows (wgmma on sm_90; 64
    keys a block would need more shared memory than an SM has). Otherwise a launch that fills the GPU: 32 heads a
    program on 8 warps (the fp32 accumulator [32, 512] at 64 values a thread), 64 keys a block; one that does not takes
    a key split (`attention_split`, or `split` as given) and 16 heads on 4 warps, 32 keys a block: more, smaller
    programs. Packed entries: 16 heads and 16 keys of 512 on 8 warps (their decode needs the registers).
    docs/tuning.md#attention-plan has the measurements."""
    wide = wide_plan(tokens, heads, head_dim, window + entries, packed, sms, split)
    if wide is not None:
        return wide
    bh = max(16, min(64, next_pow2(heads), 16384 // head_dim))
    if split is None:
        split = attention_split(tokens * -(-heads // bh), window + entries, sms)
    if packed:
        return AttentionPlan(16, 16 if head_dim > 256 else 32, 8, split)
    if split:
        return AttentionPlan(16, 32, 4, split)
    return AttentionPlan(bh, 64, 8 if bh * head_dim >= 16384 else 4, 0)


def wide_plan(tokens: int, heads: int, head_dim: int, keys: int, packed: bool, sms: int,
              split: int | None) -> AttentionPlan | None:
    """`plan_attention`'s plan of WIDE_HEADS heads a program, or None where it does not apply: packed entries, fewer
    heads, head_dim above 512 (the accumulator [64, head_dim] in fp32 at 128 values a thread on 8 warps), or fewer
    than half as many programs as SMs. A wide program takes 160 KB of shared memory, so an SM runs one at a time:
    the key split (unless given) is the largest that keeps the launch within one wave, with shares of at least
    SHARE_KEYS of the `keys` (window and entries) a token sees."""
    if packed or heads < WIDE_HEADS or head_dim > 512:
        return None
    programs = tokens * -(-heads // WIDE_HEADS)
    if split is None:
        split = attention_split(programs, keys, sms, per_sm=1)
    if 2 * programs * (split + 1) < sms:
        return None
    return AttentionPlan(WIDE_HEADS, 32, 8, split)


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, ring: torch.Tensor, entries: torch.Tensor | None,
                     picks: torch.Tensor | None, steps: StepTokens, ratio: int, sinks: torch.Tensor,
                     scale: float, max_entries: int | None = None, update_ring: bool = False, entry_nope: int = 0,
                     rope: tuple[torch.Tensor, torch.Tensor] | None = None, q_eps: float | None = None,
                     split: int | None = None, dot_dtype: torch.dtype | None = None, fallback=None,
                     plan: AttentionPlan | None = None) -> torch.Tensor:
    """o [N, H, D] in q's dtype (module docstring). A head_dim the kernel does not take (not a power of two >= 16)
    goes to `fallback` (the reference), or raises without one. max_entries: a bound on the entries any token sees
    (HCA; by default what the pages hold), which sizes the key split; update_ring: also `write_ring` (the caller
    guarantees one token per sequence); entry_nope > 0: the entries are packed fp8 rows uint8 [pages, E,
    kv_row_bytes] with that many fp8 channels. rope = (cos, sin) [N, R] and q_eps: the queries come un-normalised
    and un-rotated; each program normalises its heads (q_eps: the unweighted RMS) and rotates them, and rotates the
    output back, with `norm_rope`'s roundings (`ref.sparse_attention`): the two norm / rope launches around the
    attention, inside it. split: the split itself, else planned; plan: the whole geometry (`plan_attention`'s by
    default)."""
    N, H, D = q.shape
    W = ring.shape[1]
    if D & (D - 1) or D < 16:
        if fallback is not None:
            return fallback(q, kv, ring, entries, picks, steps, ratio, sinks, scale, max_entries, update_ring,
                            entry_nope, rope, q_eps)
        raise ValueError(f"sparse_attention needs a power-of-two head_dim >= 16, got {D}")
    if entries is not None and (entries.shape[-1] != (kv_row_bytes(D, entry_nope) if entry_nope else D)
                                or entry_nope and D < 64):
        raise ValueError(f"sparse_attention: entries {tuple(entries.shape)} do not hold rows of head_dim {D}"
                         + (f" packed with {entry_nope} fp8 channels (head_dim >= 64)" if entry_nope else ""))
    o = torch.empty_like(q)
    if N == 0:
        return o
    if dot_dtype is None:
        dot_dtype = torch.float32 if q.device.type != "cuda" or q.dtype == torch.float32 else torch.bfloat16
    dot = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dot_dtype]
    ratio = ratio if entries is not None else 0
    entry_nope = entry_nope if ratio else 0
    ent = entries if ratio else kv     # never read when RATIO = 0 (not the ring, which may be written)
    E = entries.shape[1] if ratio else 1
    K = picks.shape[1] if picks is not None else 0
    if plan is None:
        keys = K if ratio == 4 else (max_entries if max_entries is not None else steps.pages.shape[1] * E)
        plan = plan_attention(N, H, D, W, keys if ratio else 0, bool(entry_nope), num_sms(q.device), split)
    if plan.heads >= WIDE_HEADS and (rope is not None or q_eps is not None):
        # a wide program holds 64 heads in registers: the rotation's values would spill into its key loops (sm_90),
        # so the queries and the output take a norm / rope launch each
        o = sparse_attention(norm_rope(q, *(rope or (None, None)), eps=q_eps), kv, ring, entries, picks, steps,
                             ratio, sinks, scale, max_entries, update_ring, entry_nope, dot_dtype=dot_dtype, plan=plan)
        return norm_rope(o, *rope, inverse=True) if rope is not None else o
    pk = picks.contiguous() if picks is not None else steps.seq
    if ring.stride(2) != 1 or ring.stride(1) != D:        # rows of D values; any slot stride
        if update_ring:
            raise ValueError(f"update_ring writes the rings in place: their rows must be contiguous, got strides "
                             f"{ring.stride()}")
        ring = ring.contiguous()
    kv, ent = kv.contiguous(), ent.contiguous()
    half = 0
    cos = sin = q
    if rope is not None:
        half = rope[0].shape[-1]                   # [..., N, half] or [N, half]
        if rope[0].shape != rope[1].shape or rope[0].numel() != N * half or not 0 < 2 * half <= D:
            raise ValueError(f"sparse_attention: rope tables {tuple(rope[0].shape)} / {tuple(rope[1].shape)} do not "
                             f"rotate {N} tokens of head_dim {D}")
        cos, sin = (r.reshape(N, half).contiguous() for r in rope)
    tensors = Tensors(q, kv, ring, ent, pk, sinks.float().contiguous(), o, o, o, cos, sin)
    strides = Strides(q.stride(0), q.stride(1), o.stride(0), o.stride(1), ring.stride(0), steps.pages.stride(0),
                      kv.stride(0), ent.shape[-1], cos.stride(0))
    if plan.split:
        part_o = torch.empty(N, H, plan.split + 1, D, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(N, H, plan.split + 1, 2, dtype=torch.float32, device=q.device)
        tensors = tensors._replace(part_o=part_o, part_ml=part_ml)
    pdl = has_pdl(q.device)
    shape = Shape(W, D, E, K, ratio, plan.heads, plan.keys, dot, plan.split, update_ring, entry_nope,
                  int(q_eps is not None), half, pdl)
    _attention_kernel[(N, triton.cdiv(H, plan.heads), plan.split + 1)](
        tensors, steps, strides, H, scale, q_eps if q_eps is not None else 0.0, shape, num_warps=plan.warps)
    if plan.split:
        bh = 8 if D > 256 else 16
        _combine_kernel[(N, triton.cdiv(H, bh))](tensors, strides, H, plan.split, D, bh, COMBINE_UNROLL, half, pdl,
                                                 num_warps=4)
    return o


def attention_split(programs: int, keys: int, sms: int, per_sm: int = 2) -> int:
    """Programs over a token's keys besides the first, for a launch of `programs` (token, head block) programs whose
    tokens see up to `keys` keys (window and entries): shares of at least SHARE_KEYS keys, as many as keep the launch
    within `per_sm` programs per SM; none once the launch fills the GPU."""
    if programs >= sms:
        return 0
    return max(0, min(-(-keys // SHARE_KEYS), (per_sm * sms) // programs) - 1)


@triton.jit
def sequence_tokens(steps, N, B, b):
    """(slot as int64, start, first token, token count) of sequence b of a step of N tokens in B sequences."""
    slot = tl.load(steps.slot + b).to(tl.int64)
    first = tl.load(steps.first + b)
    nxt = tl.load(steps.first + b + 1, mask=b + 1 < B, other=N)
    return slot, tl.load(steps.start + b), first, nxt - first


@triton.jit
def _write_ring_kernel(ring, kv, steps, N, B, ring_slot, kv_t, W: tl.constexpr, D: tl.constexpr):
    """Token t's row into its slot's ring at row pos mod W, if it is among its sequence's last W of the step."""
    t = tl.program_id(0)
    p = tl.load(steps.pos + t)
    slot, start, _, n = sequence_tokens(steps, N, B, tl.load(steps.seq + t))
    if p >= start + n - W:
        d = tl.arange(0, D)
        tl.store(ring + slot * ring_slot + (p % W) * D + d, tl.load(kv + t.to(tl.int64) * kv_t + d))


def write_ring(ring: torch.Tensor, kv: torch.Tensor, steps: StepTokens) -> None:
    """Each sequence's last W rows of this step into its slot's ring (row = position mod W), in place
    (`ref.write_ring`'s contract), one program per token. kv [N, D] with D a power of two."""
    N, D = kv.shape
    if N == 0:
        return
    if D & (D - 1):
        raise ValueError(f"write_ring needs a power-of-two head_dim, got {D}")
    if ring.stride(2) != 1 or ring.stride(1) != D:
        raise ValueError(f"write_ring writes the rings in place: their rows must be contiguous, got strides "
                         f"{ring.stride()}")
    kv = kv.contiguous()
    _write_ring_kernel[(N,)](ring, kv, steps, N, steps.slot.shape[0], ring.stride(0), kv.stride(0), ring.shape[1], D,
                             num_warps=4)
