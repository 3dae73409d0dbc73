"""The radix select of the k-th largest key of each row, over chunks of the row (`sampling`, `indexer`; its byte step,
`next_byte`, also serves the indexer's one-program select): keys are integers in [0, 2^32) ordered as the values they
stand for; pass p (1..4) histograms byte p (from the top) of the keys that share the bytes found so far, each chunk
of a row in its own program, and every program of the next pass finds the next byte from the summed histograms.

    hist   int32 [rows, 4, chunks, 256]   pass p's histogram of chunk s at [row, p - 1, s]; a pass over the keys
                                          that share earlier bytes may count them one by one (`count_bytes`) into a
                                          histogram that a pass before cleared (`clear_hists`)
    state  int64 [rows, 4, 2]             after d bytes, at [row, d - 1]: (those bytes in place, how many keys that
                                          share them are still to be counted); chunk 0 of the pass that reads state
                                          d - 1 stores state d (no program writes what another reads)
"""

from __future__ import annotations

import triton
import triton.language as tl


def chunks_for(rows: int, width: int, block: int, sms: int, per_sm: int = 2) -> int:
    """Chunks each row's passes split into: enough (row, chunk) programs for `per_sm` a streaming multiprocessor,
    each chunk at least one block of the row."""
    return max(1, min(triton.cdiv(width, block), triton.cdiv(per_sm * sms, rows)))


@triton.jit
def summed_hist(hist, row, chunks, PASS: tl.constexpr, CHUNKS_PAD: tl.constexpr):
    """Pass PASS's histogram of the whole row [256]: its chunks' histograms summed."""
    c = tl.arange(0, CHUNKS_PAD)
    return tl.sum(tl.load(hist + ((row * 4 + PASS - 1) * chunks + c)[:, None] * 256 + tl.arange(0, 256)[None, :],
                          mask=(c < chunks)[:, None], other=0), axis=0)


@triton.jit
def load_state(state, row, DIGITS: tl.constexpr):
    """State DIGITS of the row (`store_state`'s): (the bytes in place, how many keys sharing them are still to be
    counted)."""
    return tl.load(state + (row * 4 + DIGITS - 1) * 2), tl.load(state + (row * 4 + DIGITS - 1) * 2 + 1)


@triton.jit
def radix_state(hist, state, row, chunks, k, DIGITS: tl.constexpr, CHUNKS_PAD: tl.constexpr):
    """Row `row`'s select of the k-th largest key after DIGITS bytes: (the bytes in place, how many keys sharing them
    are still to be counted) from state DIGITS - 1 (the initial (0, k) for the first byte) and pass DIGITS's
    histograms, summed over the row's chunks."""
    prefix, need, shared = _radix_step(hist, state, row, chunks, k, DIGITS, CHUNKS_PAD)
    return prefix, need


@triton.jit
def _radix_step(hist, state, row, chunks, k, DIGITS: tl.constexpr, CHUNKS_PAD: tl.constexpr):
    """`radix_state`'s (prefix, need), and how many keys of the row share that prefix (its byte's bin)."""
    prefix = tl.zeros([], tl.int64)
    need = k.to(tl.int64)
    if DIGITS > 1:
        prefix, need = load_state(state, row, DIGITS - 1)
    h = summed_hist(hist, row, chunks, DIGITS, CHUNKS_PAD).to(tl.int64)
    prefix, need = next_byte(h, prefix, need, DIGITS)
    return prefix, need, tl.sum(tl.where(tl.arange(0, 256) == byte_of(prefix, DIGITS), h, 0), axis=0)


@triton.jit
def next_byte(h, prefix, need, DIGITS: tl.constexpr):
    """From the histogram h [256] of byte DIGITS of the keys that share `prefix` (the bytes before it), where the
    k-th largest key is the need-th largest among them: (prefix with byte DIGITS, the need among the keys sharing
    that)."""
    bins = tl.arange(0, 256)
    above = tl.sum(h, axis=0) - tl.cumsum(h, axis=0)                 # keys with a larger byte here
    d = tl.maximum(tl.max(tl.where(above + h >= need, bins, -1), axis=0), 0)
    need -= tl.sum(tl.where(bins == d, above, 0), axis=0)
    return prefix | (d.to(tl.int64) << (32 - 8 * DIGITS)), need


@triton.jit
def byte_of(key, DIGITS: tl.constexpr):
    """Byte DIGITS (1: the top one) of keys, as int32 histogram bins."""
    return ((key >> (32 - 8 * DIGITS)) & 255).to(tl.int32)


@triton.jit
def shares_prefix(key, prefix, DIGITS: tl.constexpr):
    """Whether keys share the prefix's bytes before byte DIGITS (always, for the top byte)."""
    if DIGITS > 1:
        return (key >> (40 - 8 * DIGITS)) == (prefix >> (40 - 8 * DIGITS))
    return key >= 0


@triton.jit
def store_state(state, row, prefix, need, DIGITS: tl.constexpr):
    """State DIGITS of the row (`radix_state`'s result after DIGITS bytes)."""
    tl.store(state + (row * 4 + DIGITS - 1) * 2, prefix)
    tl.store(state + (row * 4 + DIGITS - 1) * 2 + 1, need)


@triton.jit
def pass_prefix(hist, state, row, chunks, k, PASS: tl.constexpr, CHUNKS_PAD: tl.constexpr):
    """The bytes before byte PASS (2..4) that pass PASS's programs histogram under, and how many keys of the row
    share them: from the earlier passes, chunk 0 of the row storing them as state PASS - 1 for the passes after."""
    prefix, need, shared = _radix_step(hist, state, row, chunks, k, PASS - 1, CHUNKS_PAD)
    if tl.program_id(1) == 0:
        store_state(state, row, prefix, need, PASS - 1)
    return prefix, shared


@triton.jit
def store_hist(hist, row, h, PASS: tl.constexpr):
    """Pass PASS's histogram h [256] of the program's chunk."""
    tl.store(_chunk_hist(hist, row, PASS) + tl.arange(0, 256), h)


@triton.jit
def _chunk_hist(hist, row, PASS: tl.constexpr):
    """Where pass PASS's histogram of the program's chunk starts (program (row, chunk): axis 1 numbers the chunks)."""
    return hist + ((row * 4 + PASS - 1) * tl.num_programs(1) + tl.program_id(1)) * 256


@triton.jit
def clear_hists(hist, row, FIRST: tl.constexpr):
    """Zeroes the histograms of passes FIRST..4 of the program's chunk, for `count_bytes`."""
    for p in tl.static_range(FIRST, 5):
        store_hist(hist, row, tl.zeros([256], tl.int32), p)


@triton.jit
def count_bytes(hist, row, key, mask, PASS: tl.constexpr):
    """Adds the keys under mask to pass PASS's histogram of the program's chunk, bin byte PASS, one atomic add each.
    A pass after the first counts only the keys that share the bytes found so far, few of a row: a relaxed atomic
    for each of them takes fewer instructions than `tl.histogram`'s votes over every key."""
    tl.atomic_add(_chunk_hist(hist, row, PASS) + byte_of(key, PASS), tl.full(key.shape, 1, tl.int32), mask=mask,
                  sem="relaxed")

