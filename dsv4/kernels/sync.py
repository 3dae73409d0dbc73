"""What a decode-GEMV unit does while it waits: L2 prefetch of tile-major weight runs, and the row flags of the
fused MoE pair (`moe_pair.py`).

A dense unit under programmatic dependent launch prefetches its first sub-steps into L2 before
`griddepcontrol.wait` (`_prefetch_unit_l2`); no kernel writes weights, so that read may overlap the previous
kernel. In the one-launch pair, every gate/up output tile written counts into its h row's flag (`_signal_row`:
a barrier so every thread's stores come first, then a release add) and a down unit polls its row's flag with
acquire loads and a nanosleep backoff (`_await_row`). Flags sit SYNC_LINE int32s apart: one 128-byte L2 line
each.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tiles import TILE_BYTES_C, TILE_ROWS_C, byte_offsets, scale_chunk_c

# int32 counters of the fused MoE pair (`moe_pair._moe_pair_kernel`) one 128-byte line apart: each flag on its own
# L2 line
SYNC_LINE = tl.constexpr(32)


@triton.jit
def _prefetch_l2(ptrs):
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _prefetch_unit_l2(w, u, splits, num_n, SPLIT, CHUNK, n_steps, FMT: tl.constexpr, GATED: tl.constexpr,
                      BN: tl.constexpr, STEPS: tl.constexpr):
    """Prefetch into L2 the first STEPS sub-steps of dense unit u's tile-major weights (`host.Operand` w;
    clamped to the unit's own sub-steps) and, for FP4, their block scales (tiled alongside)."""
    j = u % splits
    n0 = ((u // splits) % num_n) * BN
    s0 = (j % SPLIT) * CHUNK
    steps = tl.minimum(tl.minimum(CHUNK, n_steps - s0), STEPS)
    _prefetch_tiled_run(w.w, n0, s0, steps, w.stride_wn, w.stride_wg, TILE_BYTES_C, STEPS, GATED)
    if FMT >= 2:
        _prefetch_tiled_run(w.s, n0, s0, steps, w.stride_sn, w.stride_sg, scale_chunk_c(FMT), STEPS, GATED)


@triton.jit
def _prefetch_tiled_run(ptr, n0, s0, steps, stride, stride_g, CHUNK: tl.constexpr, STEPS: tl.constexpr,
                        GATED: tl.constexpr):
    """Prefetch into L2 sub-steps [s0, s0 + steps) (steps <= STEPS) of tile row n0 of a tile-major array with
    CHUNK bytes per row and sub-step: one contiguous run, one 128-byte line per element (and the same run
    stride_g further on when GATED: the up projection)."""
    LINES: tl.constexpr = TILE_ROWS_C * CHUNK // 128
    lines = tl.minimum(tl.arange(0, STEPS * LINES), steps * LINES - 1) * 128
    p = ptr + byte_offsets(n0, s0 * CHUNK, stride, CHUNK, True) + lines
    _prefetch_l2(p)
    if GATED:
        _prefetch_l2(p + stride_g)


@triton.jit
def _nanosleep(ns):
    tl.inline_asm_elementwise("nanosleep.u32 $1; mov.u32 $0, 0;", "=r,r", [ns], dtype=tl.int32, is_pure=False,
                              pack=1)


@triton.jit
def _load_acquire(ptr):
    return tl.inline_asm_elementwise("ld.global.acquire.gpu.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _await_row(flag_ptr, target, ASM: tl.constexpr):
    """Wait until the counter at flag_ptr reaches target, each thread with acquire semantics (ASM, the GPU; the
    interpreter runs programs one after another, so the count is always there)."""
    if ASM:
        seen = _load_acquire(flag_ptr)
        if seen < target:
            backoff = seen * 0 + 128   # ns, doubling to 2 us: a poll is an L2 access to the slice of the flag
            while seen < target:
                _nanosleep(backoff)
                backoff = tl.minimum(backoff * 2, 2048)
                seen = _load_acquire(flag_ptr)
    else:
        tl.device_assert(tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu") >= target, "h row not written")


@triton.jit
def _signal_row(flag_ptr):
    """One more tile of a row is written: every thread's stores come before the release."""
    tl.debug_barrier()
    tl.atomic_add(flag_ptr, 1, sem="release", scope="gpu")
