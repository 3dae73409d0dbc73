"""Decode GEMV (at most 16 activation rows per weight): y = x @ W^T computed as y^T = W x^T (swap-AB). This file
holds the device code; `gemv_launch.py` launches it.

The weight tile is the A operand of the MMA (mma.sync, 2 warps), streamed from global memory into registers -
directly (LDG.128, prefetched a loop iteration ahead: FP8 by default, `_unit_acc`) or through cp.async and one
LDS.128 per 16 bytes already in the operand layout (`num_stages` > 1); x (small) is the B operand. Decoded weights
never go through shared memory and are never shuffled between threads. Weights are row-major or tile-major
(`QWeight.tiled`: one sub-step of a 64-row tile is one contiguous 4 KB run; `tiles.byte_offsets`), tiled FP4 words
XOR-coded (`formats.wordcode`: a pair of values decodes in a shift and one LOP3).

Layout trick (no byte moves within a row). A K step ("sub-step") covers 64 bytes of every weight row (128 FP4 or
64 FP8 elements). Triton loads a [BN, 64] byte tile with 4 threads per row (16 bytes each) and 8 rows per warp;
each thread decodes its 16 bytes into elements in natural order (FP4: the low then the high nibble of every byte,
so each bf16x2 register holds two elements adjacent in x as well). The MMA A operand wants rows lane/4 + 8h + 16w in
a thread and, per 16-wide k block, in thread c = lane % 4 either Triton's relabelled k = 4c .. 4c+3 (kWidth 4,
Triton <= 3.7) or the instruction's own 2c, 2c+1, 2c+8, 2c+9 (kWidth 2, Triton >= 3.8; `MMA_K_WIDTH`). A dot does
not care in which order K is summed, and output rows may be stored anywhere, so `_to_mma` re-indexes the decoded
tile (rows and K) so that each thread already holds its operand fragment - register renaming only - and x is
loaded in the same K order (`_x_kmajor`; docs/tuning.md#k-order). Each PTX decoder instance takes one 32-bit word
of one row (`pack=1`): with `pack > 1` Triton groups consecutive registers, which in the operand layout mix rows r
and r + 32. The decoders (`decode.py`) give exact bf16 values (FP4 times its block multiplier, FP8 times 2^120 with
its 128x128 block scale applied to the fp32 partial of each 128-K block); the FP4 prescale is undone once in the
epilogue.

Group columns (`GCOL`; the MoE launches, whose units each read one x row): with FP4 weights, column m of the MMA's
x operand holds only the 16 x values of the sub-step's scale group m (times 2^64), so the 8 columns of the MMA's
output are the 8 groups' partial sums; the weights enter unscaled (E2M1 * 2^-126) and one FFMA per group applies
the block scales (`decode._group_scales`); the unit's partial is the column sum. Every product stays exact and in
fp32's normal range for |x| < 2^64. The scale words are loaded a loop iteration ahead into registers: they feed no
dot operand, so the pipeliner would not stage them (docs/tuning.md#group-columns).

Launch under programmatic dependent launch (`PDL`, sm_90+): the kernel lets the next one launch at its start and
waits (`griddepcontrol.wait`) for the previous one before it touches anything another kernel writes; before the
wait it only L2-prefetches the first weight bytes of its first dense unit. The MoE gate/up launch after
`moe.route` (`X_READY`) waits per unit instead: its shared-expert units, first in its unit order, read x and their
weights while the routing kernel still runs, and wait only before they write.

Work: units (row block, N tile, K split), one program each; split-K partials go to an fp32 workspace and the last
arriving unit of an output tile sums them in split order (deterministic, one launch; semaphores from the Ops
table's `Scratch`, re-armed by the kernel). The MMA's N (x rows per unit, `MMA_N`) is 8 up to 8 rows, else 16.
Row modes:
* ROWS_DENSE: up to 16 rows of x, one weight; GROUP_R > 0 makes it block-diagonal (wo_a: weight rows
  [g*R, (g+1)*R) read x columns [g*Kg, (g+1)*Kg)).
* ROWS_PAIR: one row per (token, slot) pair, weight ids[pair] (MoE gate/up, GATED = SwiGLU epilogue).
* ROWS_TOKEN: one token per unit, its k experts are extra K splits: the routing weight and each expert's
  factor scale the partials, whose ordered sum is the MoE output (the top-k sum fused, deterministic).
The MoE's shared expert rides in the ROWS_PAIR / ROWS_TOKEN launches: as one more row block (slot) per token, or
(`COLS`) as row blocks whose MMA columns are 8 tokens each, so that each of its weight tiles is read and decoded
once per 8 tokens. Gated FP4 units stream gate and up in one K loop, a sub-step of each per iteration (`PAIRED`).
The MoE pair (gate/up ROWS_PAIR, then down ROWS_TOKEN) can run as one launch (`moe_pair.py`): every unit is
`_gemv_unit`, as in its own launch, whose SIGNAL / AWAIT / TICKET switches are that launch's only.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .decode import _fp4_decode, _fp8_decode, _group_multipliers, _group_scales
from .policy import COLS_TOKENS, ROWS_PAIR
from .sync import SYNC_LINE, _await_row, _prefetch_unit_l2, _signal_row
from .tiles import TILE_BYTES_C, _sum_split_partials, byte_offsets, epilogue_factor, scale_chunk_c

# k elements per thread and register group in the mma.sync bf16 operand layout Triton picks: 4 up to 3.7, the
# instruction's own 2 from 3.8 (SASS of Triton 3.6, 3.7.1, 3.8.0, 3.9.0; `_k_order` follows it)
MMA_K_WIDTH = tl.constexpr(4 if tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 8) else 2)
COLS_TOKENS_C = tl.constexpr(COLS_TOKENS)


@triton.constexpr_function
def waits_per_unit(x_ready: bool, rows: int, shared: bool) -> bool:
    """Whether a launch's units wait for the previous kernel one by one (under PDL) instead of all at its start: the
    MoE gate/up launch after routing (`launch(x_ready=True)`), whose shared-expert units run while routing does."""
    return bool(x_ready and rows == ROWS_PAIR and shared)


# ------------------------------------------------------------------------------ operand re-indexing

@triton.jit
def _k_order(t, R: tl.constexpr, KS: tl.constexpr):
    """[R, KS] rows whose element KS/4 c + i belongs to thread c (load order) -> the MMA's K order, the same
    for the weights (`_to_mma`) and x (`_x_kmajor`), matching the mma.sync operand layout Triton picks for bf16
    (`MMA_K_WIDTH`, from its version). kWidth 4 (4 consecutive k per thread; Triton <= 3.7):
    KS/4 c + 8j + 4g + 2h + e -> 32j + 16h + 4c + 2g + e; the two words of one k block then lie 8 bytes apart
    in x, which is where a 16-byte shared-memory load of x puts the MMA's operand pair (the plain 16b + 4c
    order cost ptxas 54 register moves per loop iteration). kWidth 2 (the instruction's own fragment, k = 2c,
    2c+1, 2c+8, 2c+9; Triton >= 3.8): KS/4 c + 4b + 2h + e -> 16b + 8h + 2c + e. Any order gives the same
    result (both operands get it); the wrong one costs shuffles (docs/tuning.md#k-order)."""
    K_BLOCKS: tl.constexpr = KS // 16
    if MMA_K_WIDTH == 2:
        return tl.permute(t.reshape(R, 4, K_BLOCKS, 2, 2), (0, 2, 3, 1, 4)).reshape(R, KS)
    return tl.permute(t.reshape(R, 4, K_BLOCKS // 2, 2, 2, 2), (0, 2, 4, 1, 3, 5)).reshape(R, KS)


@triton.jit
def _to_mma(t, BN: tl.constexpr, W: tl.constexpr, KS: tl.constexpr):
    """A decoded [BN, KS] tile (KS = 64 FP8 / 128 FP4 elements per row, thread c of a row holding elements
    KS/4 c .. KS/4 (c + 1) - 1) from load order to MMA A-operand order (register renaming, see the module
    docstring); W warps. Rows: load row l + 8w + 8W r0 + 16W r1 -> l + 8 r0 + 16 w + 16W r1; K: `_k_order`."""
    t = tl.permute(t.reshape(BN // (16 * W), 2, W, 8, KS), (0, 2, 1, 3, 4)).reshape(BN, KS)
    return _k_order(t, BN, KS)


@triton.jit
def _x_kmajor(x, MMA_N: tl.constexpr, KS: tl.constexpr):
    """x [MMA_N, KS] in natural order -> [KS, MMA_N] in the K order `_to_mma` gives the weights."""
    return tl.trans(_k_order(x, MMA_N, KS))


@triton.jit
def _mma_rows(offs, BN: tl.constexpr, W: tl.constexpr):
    """The memory row of every row of a `_to_mma` tile, given the rows in load order [BN]."""
    t = offs.reshape(BN // (16 * W), 2, W, 8)
    return tl.permute(t, (0, 2, 1, 3)).reshape(BN)


@triton.jit
def _x_subtile(x_ptr, xrow, rmask, k0, stride_xm, MMA_N: tl.constexpr, KS: tl.constexpr, DOT: tl.constexpr,
               GROUP: tl.constexpr):
    """x columns k0 .. k0 + KS - 1 of one sub-step as the dot's B operand [KS, MMA_N], in the K order of
    `_to_mma` tiles. GROUP > 0 (the group columns, module docstring): column m holds only scale group m's GROUP
    columns of the single x row (xrow uniform), times 2^64."""
    k = tl.arange(0, KS)[None, :]
    if GROUP > 0:
        mask = rmask[:, None] & (k // GROUP == tl.arange(0, MMA_N)[:, None])
    else:
        mask = rmask[:, None]
    x = tl.load(x_ptr + xrow.to(tl.int64)[:, None] * stride_xm + k0 + k, mask=mask, other=0.0)
    if GROUP > 0:
        x = x.to(tl.float32) * (2.0 ** 64)   # exact; keeps every product in fp32's normal range
    return _x_kmajor(x.to(DOT), MMA_N, KS)


# ------------------------------------------------------------------------------------ one sub-step

@triton.jit
def _load_sub(wbase, sbase, wrow, srow, step, wk, sk, FMT: tl.constexpr, SCALES: tl.constexpr = True):
    """Raw bytes of one sub-step: weights as 32-bit words [BN, 16] (4 bytes of one row each) and (FP4, SCALES)
    the block-scale words of `_load_scales` (else the weights again). `wrow` / `srow`: the byte offset of every
    row's sub-step 0, `wk` / `sk`: bytes from one sub-step to the next.
    Wide loads let the software pipeliner (num_stages > 1) stage both through shared memory; unmasked: the
    caller clamps rows past N to a real row (never stored)."""
    jj = tl.arange(0, 16)[None, :]
    b = tl.load((wbase + wrow[:, None] + step * wk).to(tl.pointer_type(tl.uint32)) + jj)
    s = b
    if SCALES and FMT >= 2:
        s = _load_scales(sbase, srow, step, sk, FMT)
    return b, s


@triton.jit
def _load_scales(sbase, srow, step, sk, FMT: tl.constexpr):
    """FP4 block-scale bytes of one sub-step as [BN, 2] words (NVFP4: 8 scales) or half-words (MXFP4: 4)."""
    if FMT == 3:
        s = tl.load((sbase + srow[:, None] + step * sk).to(tl.pointer_type(tl.uint32)) + tl.arange(0, 2)[None, :])
    else:
        s = tl.load((sbase + srow[:, None] + step * sk).to(tl.pointer_type(tl.uint16))
                    + tl.arange(0, 2)[None, :]).to(tl.uint32)
    return s


@triton.jit
def _mma_sub(acc, b, s, xs, FMT: tl.constexpr, BN: tl.constexpr, W: tl.constexpr, DOT: tl.constexpr,
             ASM: tl.constexpr, GCOL: tl.constexpr, CODED: tl.constexpr):
    """acc [BN, MMA_N] += decoded sub-step tile @ xs (the sub-step's x, from `_x_subtile`); CODED: FP4 words as tiled
    weights store them (`formats.wordcode`)."""
    if GCOL:
        d = tl.dot(_to_mma(_fp4_decode(b, 2.0 ** -126, BN, ASM, False, CODED).to(DOT), BN, W, 128), xs)
        acc += d * _group_scales(s, FMT, BN, W)
    elif FMT >= 2:
        w = _fp4_decode(b, _group_multipliers(s, FMT, BN, ASM), BN, ASM, True, CODED)
        acc = tl.dot(_to_mma(w.to(DOT), BN, W, 128), xs, acc)
    else:
        w = _fp8_decode(b, BN, ASM)
        acc = tl.dot(_to_mma(w.to(DOT), BN, W, 64), xs, acc)
    return acc


@triton.jit
def _fp8_block_scale(sbase, rows_mma, nmask_mma, kblock, stride_sn, SCALE_F32: tl.constexpr):
    srow = sbase + (rows_mma // 128).to(tl.int64) * stride_sn + kblock
    if SCALE_F32:
        sv = tl.load(srow, mask=nmask_mma, other=0.0)
    else:  # UE8M0 byte -> 2^(byte - 127)
        sv = (tl.load(srow, mask=nmask_mma, other=0).to(tl.int32) << 23).to(tl.float32, bitcast=True)
    return sv


@triton.jit
def _unit_acc(xs, wt, at, s0, s1, F: tl.constexpr, L: tl.constexpr, GROUP_COLS: tl.constexpr,
              PAIRED: tl.constexpr = False):
    """fp32 [BN, MMA_N] partial of one weight over sub-steps [s0, s1), two per iteration (an FP8 iteration is one
    128-K scale block, s0 even; a missing second step re-reads the first's weights against zero x). Returns
    (partial, partial again). xs = (x, x rows, their mask, first x column, x row stride); wt = (weight base, scale
    base, their row strides, their gate-to-up strides); at = (rows, their MMA order, its mask) of the N tile.
    PAIRED (FP4 gate/up): (gate, up) partials, an iteration being one sub-step of each against the same x - one
    loop, so the pipeline fills once per unit; each accumulator sees its sub-steps in the unpaired order (the same
    bits). Weight loads: without prefetch both of an iteration are issued before its first decode (the pipeliner,
    num_stages > 1, stages them and x through shared memory); with prefetch (`L.PREFETCH` bit 0 FP8, bit 1 FP4) a
    sub-step's registers are refilled two sub-steps on as soon as they are decoded, so the loads stay in flight
    across the next decode. GROUP_COLS with FP4 weights (one uniform x row): the group columns, the partial in
    column 0 (module docstring)."""
    x_ptr, xrow, rmask, xcol, stride_xm = xs
    wbase, sbase, stride_wn, stride_sn, stride_wg, stride_sg = wt
    rows, rows_mma, nmask_mma = at
    FMT: tl.constexpr = F.FMT
    BN: tl.constexpr = L.BN
    MMA_N: tl.constexpr = L.MMA_N
    tl.static_assert(not PAIRED or FMT >= 2, "paired weights are FP4")
    acc = tl.zeros((BN, MMA_N), dtype=tl.float32)
    acc2 = tl.zeros((BN, MMA_N), dtype=tl.float32)
    KS: tl.constexpr = 128 if FMT >= 2 else 64
    STEP: tl.constexpr = 1 if PAIRED else 2   # sub-steps of one weight per iteration
    GC: tl.constexpr = GROUP_COLS and FMT >= 2
    XG: tl.constexpr = 16 if GC else 0
    if GC:
        rmask = xrow * 0 == 0   # one x row, read by every MMA column (each its own scale groups)
    PREFETCH: tl.constexpr = (L.PREFETCH >> (1 if FMT >= 2 else 0)) & 1
    # each row's sub-step 0 and the bytes from one sub-step to the next, row-major or tiled (`formats.tiling`)
    SSTEP: tl.constexpr = scale_chunk_c(FMT)
    zero = tl.full((), 0, tl.int32)   # a 0-d tensor, not 0: the interpreter has no int % constexpr
    wrow = byte_offsets(rows, zero, stride_wn, TILE_BYTES_C, F.TILED)
    wk = byte_offsets(zero, zero + TILE_BYTES_C, stride_wn, TILE_BYTES_C, F.TILED)
    srow = byte_offsets(rows, zero, stride_sn, SSTEP, F.TILED and FMT >= 2)
    sk = byte_offsets(zero, zero + SSTEP, stride_sn, SSTEP, F.TILED and FMT >= 2)
    # the second operand of an iteration: the next sub-step, or (PAIRED) the same sub-step of the up weight
    wbase1 = wbase + stride_wg if PAIRED else wbase
    sbase1 = sbase + stride_sg if PAIRED else sbase
    if PREFETCH:
        b0, c0 = _load_sub(wbase, sbase, wrow, srow, s0, wk, sk, FMT)
        b1, c1 = _load_sub(wbase1, sbase1, wrow, srow, s0 if PAIRED else tl.minimum(s0 + 1, s1 - 1), wk, sk, FMT)
    elif GC:   # the scales feed no dot operand, so the pipeliner would not stage them: a loop iteration ahead
        n0 = _load_scales(sbase, srow, s0, sk, FMT)
        n1 = _load_scales(sbase1, srow, s0 if PAIRED else tl.minimum(s0 + 1, s1 - 1), sk, FMT)
    for step in range(s0, s1, STEP):
        step1 = step if PAIRED else tl.minimum(step + 1, s1 - 1)
        if not PREFETCH:
            b0, c0 = _load_sub(wbase, sbase, wrow, srow, step, wk, sk, FMT, not GC)
            b1, c1 = _load_sub(wbase1, sbase1, wrow, srow, step1, wk, sk, FMT, not GC)
            if GC:
                c0 = n0
                c1 = n1
                n0 = _load_scales(sbase, srow, tl.minimum(step + STEP, s1 - 1), sk, FMT)
                n1 = _load_scales(sbase1, srow, tl.minimum(step1 + STEP, s1 - 1), sk, FMT)
        x0 = _x_subtile(x_ptr, xrow, rmask, xcol + step * KS, stride_xm, MMA_N, KS, L.DOT, XG)
        if PAIRED:
            x1 = x0
        else:
            x1 = _x_subtile(x_ptr, xrow, rmask & (xrow * 0 + step + 1 < s1), xcol + step1 * KS, stride_xm, MMA_N,
                            KS, L.DOT, XG)
        blk = _mma_sub(acc if FMT >= 2 else tl.zeros((BN, MMA_N), dtype=tl.float32), b0, c0, x0, FMT, BN, L.WARPS,
                       L.DOT, L.ASM, GC, F.TILED)
        if PREFETCH:
            b0, c0 = _load_sub(wbase, sbase, wrow, srow, tl.minimum(step + STEP, s1 - 1), wk, sk, FMT)
        if PAIRED:
            acc2 = _mma_sub(acc2, b1, c1, x1, FMT, BN, L.WARPS, L.DOT, L.ASM, GC, F.TILED)
        else:
            blk = _mma_sub(blk, b1, c1, x1, FMT, BN, L.WARPS, L.DOT, L.ASM, GC, F.TILED)
        if PREFETCH:
            b1, c1 = _load_sub(wbase1, sbase1, wrow, srow, tl.minimum(step1 + STEP, s1 - 1), wk, sk, FMT)
        if FMT >= 2:
            acc = blk
        else:
            acc += blk * _fp8_block_scale(sbase, rows_mma, nmask_mma, step // 2, stride_sn, F.SCALE_F32)[:, None]
    if GC:   # the group columns' sum, and the 2^53 that `decode._group_scales` leaves out
        acc = tl.where(tl.arange(0, MMA_N)[None, :] == 0, tl.sum(acc, axis=1)[:, None] * (2.0 ** 53), 0.0)
        if PAIRED:
            acc2 = tl.where(tl.arange(0, MMA_N)[None, :] == 0, tl.sum(acc2, axis=1)[:, None] * (2.0 ** 53), 0.0)
    return acc, acc2 if PAIRED else acc


# ------------------------------------------------------------------------------------------ one unit

@triton.jit
def _weight_unit(xs, w, e64, at, s0, s1, rw, F: tl.constexpr, L: tl.constexpr, GROUP_COLS: tl.constexpr):
    """One unit's partial(s) of expert e64 of weight operand w (`host.Operand`): (acc, acc_u, factor,
    factor_u); acc_u is the up projection when gated (else acc again). The factors undo the decode prescale and
    apply the routing weight `rw`."""
    wbase = w.w + e64 * w.stride_we
    sbase = w.s + e64 * w.stride_se
    s2base = w.s2 + e64 * w.stride_s2e
    PAIRED: tl.constexpr = L.GATED and F.FMT >= 2   # FP4 gate and up in one loop (`_unit_acc`)
    acc, acc_u = _unit_acc(xs, (wbase, sbase, w.stride_wn, w.stride_sn, w.stride_wg, w.stride_sg), at, s0, s1, F,
                           L, GROUP_COLS, PAIRED)
    f = epilogue_factor(s2base, F.FMT) * rw
    f_u = f
    if L.GATED:
        if not PAIRED:
            acc_u, _ = _unit_acc(xs, (wbase + w.stride_wg, sbase + w.stride_sg, w.stride_wn, w.stride_sn, 0, 0),
                                 at, s0, s1, F, L, GROUP_COLS)
        f_u = epilogue_factor(s2base + w.stride_s2g, F.FMT)
    return acc, acc_u, f, f_u


@triton.jit
def _launch_layout(N, units, L: tl.constexpr):
    """(units, splits per output tile, N tiles, shared units, first shared unit, first routed unit) of one launch:
    the unit numbering `_unit_tile` decodes. The shared expert's units (SPLIT_S per N tile of each of its row
    blocks: one per token, or with COLS one per COLS_TOKENS tokens) form their own range in ROWS_PAIR, first when
    X_READY, and in ROWS_TOKEN with COLS, first; without COLS, ROWS_TOKEN gives them the splits j >= TOPK *
    SPLIT of every token's tiles. BLOCKS: the routed units are SPLIT per N tile of each of the N_BLOCKS rows of the
    expert-block table."""
    R, SPLIT, TOPK, PAIRS, SPLIT_S, N_BLOCKS = units.R, units.SPLIT, units.TOPK, units.PAIRS, units.SPLIT_S, \
        units.N_BLOCKS
    num_n = tl.cdiv(N, L.BN)
    splits = SPLIT * TOPK + (SPLIT_S if L.SHARED else 0) if L.ROWS == 2 else SPLIT
    total = (N_BLOCKS * num_n * SPLIT) if L.BLOCKS else R * num_n * splits
    shared_units = total * 0
    first_shared = total * 0
    first_routed = total * 0
    if L.SHARED and (L.ROWS == 1 or L.COLS):
        shared_units = (tl.cdiv(R - PAIRS if L.ROWS == 1 else R, COLS_TOKENS_C) if L.COLS else R - PAIRS) * num_n \
            * SPLIT_S
        routed = (N_BLOCKS * SPLIT if L.BLOCKS else PAIRS * SPLIT if L.ROWS == 1 else R * SPLIT * TOPK) * num_n
        total = routed + shared_units
        shared_first = L.X_READY or L.ROWS == 2   # ROWS_TOKEN: so that the tiles' last arrivals spread over routed
        first_shared = 0 if shared_first else routed
        first_routed = shared_units if shared_first else 0
    return total, splits, num_n, shared_units, first_shared, first_routed


@triton.jit
def _block_unit(v, SPLIT):
    """ROWS_TOKEN with BLOCKS: routed unit v -> (tile, split) as `_unit_tile` decodes them: tile = block * num_n + N
    tile, split = the K split (units numbered (block, N tile, K split), K split fastest)."""
    return v // SPLIT, v % SPLIT


@triton.jit
def _unit_tile(u, lay, units, L: tl.constexpr):
    """Unit u's (output tile, split j within the tile, splits summed into the tile)."""
    _, splits, num_n, shared_units, first_shared, first_routed = lay
    SPLIT, SPLIT_S, TOPK, PAIRS = units.SPLIT, units.SPLIT_S, units.TOPK, units.PAIRS
    nsplit = splits + u * 0   # partials of this unit's output tile (a scalar of the unit's type)
    j = u % splits
    tile = u // splits
    if L.BLOCKS and L.ROWS == 2 and not L.SHARED:
        tile, j = _block_unit(u, SPLIT)
    if L.SHARED and (L.ROWS == 1 or L.COLS):
        if u >= first_shared and u < first_shared + shared_units:
            if L.ROWS == 1:
                nsplit = SPLIT_S + u * 0
                j = (u - first_shared) % SPLIT_S
                tile = PAIRS * num_n + (u - first_shared) // SPLIT_S
            else:   # COLS: token block g's first tile stands for its tokens' (`_unit_output`); the slot TOPK
                j = TOPK * SPLIT + (u - first_shared) % SPLIT_S
                tile = (u - first_shared) // SPLIT_S
        else:
            routed_splits = SPLIT if L.ROWS == 1 else SPLIT * TOPK   # units per routed output tile
            j = (u - first_routed) % routed_splits
            tile = (u - first_routed) // routed_splits
            if L.BLOCKS and L.ROWS == 2:
                tile, j = _block_unit(tile * routed_splits + j, SPLIT)
    return tile, j, nsplit


@triton.jit
def _block_row(table_ptr, b, n_blocks, MMA_N: tl.constexpr):
    """Row b of the expert-block table (`moe.expert_blocks`, n_blocks rows): (expert, columns, pair of each MMA column
    [MMA_N]); b >= n_blocks (a shared-expert unit, which may run before the table is written) reads nothing:
    (0, 0, zeros)."""
    row = table_ptr + tl.minimum(b, n_blocks - 1) * (2 + MMA_N)
    ncols = tl.load(row + 1, mask=b < n_blocks, other=0)
    pc = tl.load(row + 2 + tl.arange(0, MMA_N), mask=tl.arange(0, MMA_N) < ncols, other=0)
    return tl.load(row, mask=b < n_blocks, other=0), ncols, pc


@triton.jit
def _dense_rows(r, j, ks, units, L: tl.constexpr):
    """ROWS_DENSE: the unit's x rows, their mask and y rows, expert, routing weight, shared flag, K split and
    (columns, their pairs, their partials' planes) - the last three for the expert blocks only."""
    offs_r = tl.arange(0, L.MMA_N)
    xrow = offs_r if not L.GROUP_COLS else offs_r * 0   # group columns: M == 1, every column reads x row 0
    return offs_r < units.M, xrow, offs_r, r * 0, 1.0, r < 0, ks, (1, offs_r, j)


@triton.jit
def _pair_rows(r, j, ks, io, units, L: tl.constexpr):
    """ROWS_PAIR (`_dense_rows`' values): row block r is pair r (x row r // x_div) or, from PAIRS on, the shared
    expert's row of token r - PAIRS; BLOCKS: block r's pairs, column c writing h row pc[c] from x row pc[c] // x_div."""
    PAIRS = units.PAIRS
    offs_r = tl.arange(0, L.MMA_N)
    rmask = offs_r == 0
    yrow = r + offs_r * 0
    xrow = yrow // io.x_div
    on_shared = r < 0   # a false scalar of the unit's type
    if L.SHARED:
        on_shared = r >= PAIRS
        xrow = tl.where(on_shared, yrow - PAIRS, xrow)
    ncols = 1
    pc = offs_r
    if L.BLOCKS:
        e, ncols, pc = _block_row(io.ids, r, units.N_BLOCKS, L.MMA_N)
        ncols = tl.where(on_shared, 1, ncols)
        rmask = tl.where(on_shared, rmask, offs_r < ncols)
        yrow = tl.where(on_shared, yrow, pc)
        xrow = tl.where(on_shared, xrow, pc // io.x_div)
        pc = tl.where(on_shared, r, pc)   # the h row a shared-expert unit signals (one pass: ncols 1)
    elif L.SHARED:
        e = tl.load(io.ids + tl.minimum(r, PAIRS - 1), mask=r < PAIRS, other=0).to(tl.int32)
    else:
        e = tl.load(io.ids + r).to(tl.int32)
    return rmask, xrow, yrow, e, 1.0, on_shared, ks, (ncols, pc, j)


@triton.jit
def _token_rows(r, j, ks, io, units, L: tl.constexpr):
    """ROWS_TOKEN (`_dense_rows`' values; the pair in place of the columns' pairs without BLOCKS): token r's split j
    is slot j // SPLIT's K split (slot TOPK: the shared expert, x row PAIRS + r); BLOCKS: block r's pairs, column c
    reading h row pc[c] into token pc[c] // TOPK's partial of plane (slot, K split)."""
    SPLIT, TOPK = units.SPLIT, units.TOPK
    offs_r = tl.arange(0, L.MMA_N)
    rmask = offs_r == 0
    slot = tl.minimum(j // SPLIT, TOPK)
    on_shared = r < 0
    if L.SHARED:
        on_shared = slot == TOPK
        ks = tl.where(on_shared, j - TOPK * SPLIT, ks)
    pair = r * TOPK + tl.minimum(slot, TOPK - 1)
    yrow = r + offs_r * 0
    xrow = tl.where(on_shared, units.PAIRS + r, pair) + offs_r * 0
    if L.BLOCKS:
        e, ncols, pc = _block_row(io.ids, tl.where(on_shared, units.N_BLOCKS, r), units.N_BLOCKS, L.MMA_N)
        ncols = tl.where(on_shared, 1, ncols)
        rmask = tl.where(on_shared, rmask, offs_r < ncols)
        yrow = tl.where(on_shared, yrow, pc // TOPK)
        xrow = tl.where(on_shared, xrow, pc)
        jcol = tl.where(on_shared, j, (pc % TOPK) * SPLIT + ks)   # each column's partial (slot, K split)
        rw = tl.where(on_shared, 1.0, tl.load(io.rw + pc, mask=offs_r < ncols, other=0.0).to(tl.float32))
    else:
        e = tl.load(io.ids + pair).to(tl.int32)
        rw = tl.where(on_shared, 1.0, tl.load(io.rw + pair).to(tl.float32))
        ncols = 1
        pc = pair
        jcol = j
    return rmask, xrow, yrow, e, rw, on_shared, ks, (ncols, pc, jcol)


@triton.jit
def _col_tokens(r, units, L: tl.constexpr):
    """COLS: (the token of each MMA column of the shared expert's row block r, the tokens there are)."""
    tl.static_assert(not L.COLS or L.MMA_N == COLS_TOKENS_C, "token columns: COLS_TOKENS tokens per MMA")
    col_token = (r - units.PAIRS if L.ROWS == 1 else r) * COLS_TOKENS_C + tl.arange(0, L.MMA_N)
    return col_token, units.R - units.PAIRS if L.ROWS == 1 else units.R


@triton.jit
def _unit_partials(r, e64, ks, xs, at, rw, shared_unit, cols, col_tokens, io, units, w, sw, sync, L: tl.constexpr,
                   F: tl.constexpr, FS: tl.constexpr, AWAIT: tl.constexpr):
    """The unit's partial(s) (`_weight_unit`) of K split ks: of the routed weight's expert e64, of its block's
    expert, or of the shared expert's weight (`col_tokens`: `_col_tokens`' with COLS). AWAIT (ROWS_TOKEN in the
    one-launch pair): first wait until gate/up has written the h row(s) the unit reads."""
    x_ptr, xrow, rmask, xcol, stride_xm = xs
    ncols, pc = cols[0], cols[1]
    if AWAIT:   # h row `pair` (routed slot), the block's pairs' rows, or PAIRS + r (the shared expert's)
        if shared_unit:
            _await_row(sync[0] + (units.PAIRS + r) * SYNC_LINE, sync[1], L.ASM)
        elif L.BLOCKS:
            for c in range(0, ncols):
                _await_row(sync[0] + tl.sum(tl.where(tl.arange(0, L.MMA_N) == c, pc, 0)) * SYNC_LINE, sync[1],
                           L.ASM)
        else:
            _await_row(sync[0] + pc * SYNC_LINE, sync[1], L.ASM)
    if shared_unit:
        s0 = ks * units.CHUNK_S
        xrow_s = xrow
        rmask_s = rmask
        if L.COLS:   # column c reads x row col_token[c] (gate/up) or h row PAIRS + col_token[c] (down)
            col_token, tokens = col_tokens
            xrow_s = col_token + (0 if L.ROWS == 1 else units.PAIRS)
            rmask_s = col_token < tokens
        acc, acc_u, f, f_u = _weight_unit((x_ptr, xrow_s, rmask_s, xcol, stride_xm), sw, 0, at, s0,
                                          tl.minimum(s0 + units.CHUNK_S, units.n_steps_s), rw, FS, L,
                                          L.GROUP_COLS and not L.COLS)
    elif L.BLOCKS:
        # a block of one pair: the group columns (as without blocks: the same bits); several: one column each; an
        # empty block (past the last expert): two sub-steps of expert 0, all columns masked, nothing stored
        s0 = ks * units.CHUNK
        s1 = tl.minimum(s0 + units.CHUNK, io.n_steps)
        s1 = tl.where(ncols > 0, s1, tl.minimum(s0 + 2, s1))
        if L.GROUP_COLS and ncols == 1:
            xrow1 = tl.sum(tl.where(tl.arange(0, L.MMA_N) == 0, xrow, 0)) + tl.arange(0, L.MMA_N) * 0
            acc, acc_u, f, f_u = _weight_unit((x_ptr, xrow1, rmask, xcol, stride_xm), w, e64, at, s0, s1, rw, F, L,
                                              L.GROUP_COLS)
        else:
            acc, acc_u, f, f_u = _weight_unit(xs, w, e64, at, s0, s1, rw, F, L, False)
    else:
        s0 = ks * units.CHUNK
        acc, acc_u, f, f_u = _weight_unit(xs, w, e64, at, s0, tl.minimum(s0 + units.CHUNK, io.n_steps), rw, F, L,
                                          L.GROUP_COLS)
    return acc, acc_u, f, f_u


@triton.jit
def _unit_output(acc, acc_u, f, f_u, yrow, rmask, at, tile, j, pid_n, nsplit, num_n, shared_unit, r, cols, io,
                 units, sync, L: tl.constexpr, SIGNAL: tl.constexpr):
    """Writes the unit's output tile y[yrow, rows] = acc^T through the epilogue or, with K splits, parks its scaled
    partial in the workspace and counts it in; the last arrival of an output tile sums the partials in split order
    (deterministic) and re-arms the semaphore. A token-column or expert-block unit of ROWS_TOKEN holds partials of
    several tokens' tiles: it counts into each and sums those it completes. SIGNAL (gate/up in the one-launch
    pair): count the written tile into its h row(s)' flags."""
    rows_mma, nmask_mma = at[1], at[2]
    ncols, pc, jcol = cols
    M, N, GATED = units.M, io.N, L.GATED
    offs_y = yrow.to(tl.int64)[None, :] * io.stride_y + rows_mma[:, None]
    omask = rmask[None, :] & nmask_mma[:, None]
    if nsplit > 1:
        offs_ws = yrow.to(tl.int64)[None, :] * N + rows_mma[:, None]
        plane = M.to(tl.int64) * N
        if L.BLOCKS and L.ROWS == 2:   # each column's partial in its own (slot, K split) plane
            part = io.ws + (jcol.to(tl.int64) * plane)[None, :]
        else:
            part = io.ws + j.to(tl.int64) * (2 * plane if GATED else plane)
        tl.store(part + offs_ws, acc * f, mask=omask)
        if GATED:
            tl.store(part + plane + offs_ws, acc_u * f_u, mask=omask)
        tl.debug_barrier()
        cnt = io.cnt + tile
        multi = shared_unit if L.COLS else False   # a unit whose columns are partials of several tokens' tiles
        if L.BLOCKS:
            multi = True
        if L.ROWS == 2 and multi:
            cnts = io.cnt + yrow * num_n + pid_n
            last = rmask & (tl.atomic_add(cnts, 1, mask=rmask, sem="acq_rel", scope="gpu") == nsplit - 1)
            if tl.max(last.to(tl.int32), axis=0) > 0:
                lmask = omask & last[None, :]
                acc, _ = _sum_split_partials(io.ws, plane, plane, offs_ws, lmask, nsplit, L.BN, L.MMA_N, False)
                tl.atomic_xchg(cnts, 0, mask=last, sem="relaxed", scope="gpu")
                _epilogue(io.y, offs_y, lmask, acc, acc, 1.0, 1.0, io.limit, False)
            arrived = nsplit * 0   # not the last for tile `tile` below
        else:
            arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
        if arrived == nsplit - 1:
            acc, acc_u = _sum_split_partials(io.ws, 2 * plane if GATED else plane, plane, offs_ws, omask, nsplit,
                                             L.BN, L.MMA_N, GATED)
            tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")
            _epilogue(io.y, offs_y, omask, acc, acc_u if GATED else acc, 1.0, 1.0, io.limit, GATED)
            if SIGNAL:
                _signal_unit_rows(sync[0], r, pc if L.BLOCKS else r, ncols if L.BLOCKS else 1, L.MMA_N, L.BLOCKS)
    else:
        _epilogue(io.y, offs_y, omask, acc, acc_u if GATED else acc, f, f_u if GATED else f, io.limit, GATED)
        if SIGNAL:
            _signal_unit_rows(sync[0], r, pc if L.BLOCKS else r, ncols if L.BLOCKS else 1, L.MMA_N, L.BLOCKS)


@triton.jit
def _signal_unit_rows(ready_ptr, r, pc, ncols, MMA_N: tl.constexpr, BLOCKS: tl.constexpr):
    """SIGNAL: one more tile of the unit's h row r written or, BLOCKS, of the h row of each of its ncols columns'
    pairs pc (a shared-expert unit has ncols 1 and pc its row r)."""
    if BLOCKS:
        for c in range(0, ncols):
            _signal_row(ready_ptr + tl.sum(tl.where(tl.arange(0, MMA_N) == c, pc, 0)) * SYNC_LINE)
    else:
        _signal_row(ready_ptr + r * SYNC_LINE)


@triton.jit
def _gemv_unit(u, lay, io, units, w, sw, sync, L: tl.constexpr, F: tl.constexpr, FS: tl.constexpr,
               SIGNAL: tl.constexpr = False, AWAIT: tl.constexpr = False, TICKET: tl.constexpr = False):
    """Unit u of a launch (`_gemv_kernel`'s docstring; `_launch_layout` gives the numbering, `lay`): its rows by row
    mode, its partials, its output. io / units / w / sw: `gemv_launch.Io`, `Units`, `host.Operand` (routed weight,
    shared expert's); L, F, FS: `gemv_launch.Layout`, `Stored` (routed, shared).

    BLOCKS (ROWS_PAIR / ROWS_TOKEN): io.ids is the expert-block table (`moe.expert_blocks`); the routed units are
    (block b < N_BLOCKS, N tile, K split) and each streams its block's expert once for all of the block's (token,
    slot) pairs, one MMA column each (a block of one pair runs the group columns, if on).

    The one-launch MoE pair (`moe_pair._moe_pair_kernel`; sync = (row flags, target count, ticket counter)): SIGNAL
    (gate/up) counts every output tile written into its h row's flag; AWAIT (down) waits, before it reads its h row,
    until that row holds the target count of tiles. TICKET: draws the program's next ticket (returned) once its
    weights are read, so that the atomic's round trip overlaps the unit's stores; else returns 0."""
    num_n, first_routed = lay[2], lay[5]
    WAIT_PER_UNIT: tl.constexpr = L.PDL and waits_per_unit(L.X_READY, L.ROWS, L.SHARED)
    tile, j, nsplit = _unit_tile(u, lay, units, L)
    if WAIT_PER_UNIT:
        if u >= first_routed:
            gdc_wait()   # a routed unit reads the expert ids
    pid_n = tile % num_n
    r = tile // num_n
    ks = j if L.ROWS == 1 else j % units.SPLIT   # ROWS_PAIR: j < SPLIT (routed) or < SPLIT_S (shared)
    if L.ROWS == 0:
        rmask, xrow, yrow, e, rw, on_shared, ks, cols = _dense_rows(r, j, ks, units, L)
    elif L.ROWS == 1:
        rmask, xrow, yrow, e, rw, on_shared, ks, cols = _pair_rows(r, j, ks, io, units, L)
    else:
        rmask, xrow, yrow, e, rw, on_shared, ks, cols = _token_rows(r, j, ks, io, units, L)
    n0 = pid_n * L.BN
    offs_b = tl.arange(0, L.BN)
    rows_mma = _mma_rows(n0 + offs_b, L.BN, L.WARPS)
    at = (tl.minimum(n0 + offs_b, io.N - 1), rows_mma, rows_mma < io.N)   # rows past N re-read row N - 1; not stored
    xcol = (n0 // tl.maximum(io.group_r, 1)) * io.x_gstride   # block-diagonal (wo_a): this tile's x columns
    shared_unit = on_shared if L.SHARED else False   # (a compile-time False without a shared expert: no branch)
    col_token, tokens = _col_tokens(r, units, L)
    acc, acc_u, f, f_u = _unit_partials(r, e.to(tl.int64), ks, (io.x, xrow, rmask, xcol, io.stride_x), at, rw,
                                        shared_unit, cols, (col_token, tokens), io, units, w, sw, sync, L, F, FS,
                                        AWAIT)
    if L.SHARED and L.COLS:   # token columns: h row PAIRS + col_token[c] (gate/up) or out row col_token[c] (down)
        rmask = tl.where(on_shared, col_token < tokens, rmask)
        yrow = tl.where(on_shared, col_token + (units.PAIRS if L.ROWS == 1 else 0), yrow)
    if WAIT_PER_UNIT:
        gdc_wait()   # before any write: h and the workspace may reuse memory the previous kernel reads
    ticket = u * 0
    if TICKET:
        ticket = tl.atomic_add(sync[2], 1, sem="relaxed", scope="gpu")
    _unit_output(acc, acc_u, f, f_u, yrow, rmask, at, tile, j, pid_n, nsplit, num_n, shared_unit, r, cols, io, units,
                 sync, L, SIGNAL)
    return ticket


@triton.jit(do_not_specialize=["units"])
def _gemv_kernel(io, units, w, sw, L: tl.constexpr, F: tl.constexpr, FS: tl.constexpr):
    """Units u = (row block r, N tile, split j), j fastest. Row blocks: ROWS_DENSE one block of M rows;
    ROWS_PAIR R pairs; ROWS_TOKEN R tokens whose splits are (slot, K split) = (j // SPLIT, j % SPLIT).

    SHARED (the MoE's shared expert in the same launch: sw, its own format FS, its own SPLIT_S K splits of CHUNK_S
    sub-steps, so that its units stream about as many bytes as a routed one): ROWS_PAIR pairs PAIRS .. R - 1 are the
    shared expert's rows (x row r - PAIRS), their units after all routed ones; ROWS_TOKEN tokens get SPLIT_S more
    splits j >= TOPK * SPLIT, the slot TOPK, which reads h row PAIRS + token with routing weight 1. COLS: the shared
    expert's units are a row block per COLS_TOKENS of the R - PAIRS (ROWS_PAIR) or R tokens, MMA column c of block g
    being token 8 g + c (its h row PAIRS + 8 g + c); in ROWS_TOKEN they come first and each counts into its tokens'
    output tiles (`_unit_output`); in the one-launch pair, block g's gate/up tiles count into the flag of h row
    PAIRS + g, on which its down units wait.

    X_READY (ROWS_PAIR with SHARED: x was written before the previous kernel started, which is `moe.route`'s): the
    shared expert's units come first, and under PDL a unit waits for the previous kernel only before it reads the
    expert ids (routed units) or writes anything (every unit), so the shared expert streams while the routing kernel
    runs. Split partials are summed in split order whoever computes them, so the result is the same bits."""
    lay = _launch_layout(io.N, units, L)
    if L.PDL:
        # programmatic dependent launch: the next kernel may take SM slots as this one's CTAs finish; this one
        # waits for the previous kernel before it reads x, ids or scratch, or writes anything. Before the wait
        # it only prefetches its first dense unit's weights into L2 (no kernel writes them)
        gdc_launch_dependents()
        if L.PDL_L2 > 0 and L.ROWS == 0 and F.TILED:
            _prefetch_unit_l2(w, tl.minimum(tl.program_id(0), lay[0] - 1), lay[1], lay[2], units.SPLIT, units.CHUNK,
                              io.n_steps, F.FMT, L.GATED, L.BN, L.PDL_L2)
        if not waits_per_unit(L.X_READY, L.ROWS, L.SHARED):
            gdc_wait()
    for u in range(tl.program_id(0), lay[0], tl.num_programs(0)):
        _gemv_unit(u, lay, io, units, w, sw, (io.cnt, 0, io.cnt), L, F, FS)


@triton.jit
def _epilogue(y_ptr, offs_y, omask, acc, acc_u, f, f_u, limit, GATED: tl.constexpr):
    if GATED:
        g = tl.minimum(acc * f, limit)
        u = tl.minimum(tl.maximum(acc_u * f_u, -limit), limit)
        e = tl.exp(-tl.abs(g))  # sigmoid without overflow for large |g|
        h = g * tl.where(g >= 0, 1.0 / (1.0 + e), e / (1.0 + e)) * u
        tl.store(y_ptr + offs_y, h.to(y_ptr.dtype.element_ty), mask=omask)
    else:
        tl.store(y_ptr + offs_y, (acc * f).to(y_ptr.dtype.element_ty), mask=omask)
