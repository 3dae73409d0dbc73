"""Decode GEMV (at most 16 activation rows per weight): y = x @ W^T computed as y^T = W x^T (swap-AB).

The weight tile is the A operand of the MMA (mma.sync, 2 warps by default), streamed from global memory into
registers - directly (LDG.128; FP8 by default, prefetched a loop iteration ahead, see `_unit_acc`) or, with
`num_stages=2`, through cp.async and one LDS.128 per 16 bytes already in the operand layout (FP4 by default);
x (small) is the B operand. Decoded weights never go through shared memory and are never shuffled between
threads.

Weights row-major or tile-major (`QWeight.tiled`, `formats.tiling`: on CUDA the loader stores them tiled, so
that one sub-step of a 64-row tile is one contiguous 4 KB run instead of 64 runs of 64 bytes;
`tiles.byte_offsets`). Tiled FP4 weights also store each 32-bit word XOR-coded (`formats.wordcode`), so that a
pair of values decodes in a shift and one LOP3.

Layout trick (no byte moves within a row). A K step ("sub-step") covers 64 bytes of every weight row
(128 FP4 or 64 FP8 elements). Triton loads a [BN, 64] byte tile with 4 threads per row (16 bytes each) and
8 rows per warp; each thread decodes its 16 bytes into elements in natural order (FP4: the low then the high
nibble of every byte, so each bf16x2 register holds two elements that are adjacent in x as well). The MMA A
operand wants rows lane/4 + 8h + 16w in a thread and, per 16-wide k block, in thread c = lane % 4 either
Triton's relabelled k = 4c .. 4c+3 (kWidth 4, Triton <= 3.7) or the instruction's own 2c, 2c+1, 2c+8, 2c+9
(kWidth 2, Triton >= 3.8; `MMA_K_WIDTH`). A dot does not care in which order K is summed, and output rows
may be stored anywhere, so `_to_mma` re-indexes the decoded tile (rows and K) so that each thread already
holds exactly its operand fragment - the reshape/permute is register renaming only (checked in SASS:
bench/lab/sass.py) - and x is loaded in the same K order (`_x_kmajor`). The weights are loaded as 32-bit words
(4 bytes of one row) and each PTX decoder instance takes one word (`pack=1`): with `pack > 1` Triton groups
consecutive *registers*, which in the operand layout mix rows r and r + 32 (seen on the H200: garbage
results, 2026-11-30).

The decoders (`decode.py`) turn each word into exact bf16 values (FP4 times its block multiplier, FP8 times
2^120 with its 128x128 block scale applied to the fp32 partial of each 128-K block); the FP4 prescale is
undone once in the epilogue.

Group columns (`GemvConfig.group_cols`; by default in the MoE launches, whose units each read one x row): with FP4
weights, column m of the MMA's x operand holds only the 16 x values of the sub-step's scale group m (times 2^64), so
the 8 columns of D = decoded tile @ x are the 8 groups' partial sums; the weights enter unscaled (E2M1 * 2^-126:
no multiply: `tiles.FP4_CODED_PTX_RAW` / `FP4_PTX_RAW`) and one FFMA per group applies the block scales
to D (`decode._group_scales`); the unit's partial is the column sum. All products stay exact and in fp32's normal
range for |x| < 2^64 (the 2^64 is exact in bf16). SASS per NVFP4 iteration: 702 instead of 773 instructions (Triton
3.6, plain words; coded words, tiled: 561 instead of 631); the scale words are loaded a loop iteration ahead into
registers (they feed no dot operand, so the pipeliner would not stage them). Measured (bench/RESULTS.md runs 55-62,
186): MoE pair up to 5 % faster, dense V4-Pro wq_b / wo_b at M = 1 up to 22 % slower, hence off for dense calls.
Staging the scale words with the weights (carried through the decoder's asm into the dot's operand chain, run 186)
measured level, loading them through inline PTX or prefetching them into L2 slower; ncu (run 187) puts the dense
loss outside the K loops, in the prologue and the column sum of units only 6 iterations long (V4-Pro wq_b).

Launch: with programmatic dependent launch (`GemvConfig.pdl`, sm_90+) the kernel lets the next one launch at
its start and waits (`griddepcontrol.wait`) for the previous one before it touches anything another kernel
writes; before the wait it only L2-prefetches the first weight bytes of its first dense unit. The MoE gate/up
launch after `moe.route` (`x_ready`) waits per unit instead: its shared-expert units, first in its unit order,
read x and their weights while the routing kernel still runs, and wait only before they write.

Work: units (row block, N tile, K split), one program each (`GemvConfig.persistent`); split-K partials go
to an fp32 workspace and the last arriving unit of an output tile sums them in split order (deterministic,
one launch; semaphores from `gemm.Scratch`, re-armed by the kernel).
The MMA's N (x rows per unit, `MP`) is 8 for up to 8 rows (half the MMAs and x registers of N = 16) and
16 above. Row modes:
* ROWS_DENSE: up to 16 rows of x, one weight; GROUP_R > 0 makes it block-diagonal (wo_a: weight rows
  [g*R, (g+1)*R) read x columns [g*Kg, (g+1)*Kg)).
* ROWS_PAIR: one row per (token, slot) pair, weight ids[pair] (MoE gate/up, GATED = SwiGLU epilogue).
* ROWS_TOKEN: one token per unit, its k experts are extra K splits: the routing weight and each expert's
  factor scale the partials, whose ordered sum is the MoE output (the top-k sum fused, deterministic).
The MoE's shared expert rides in the ROWS_PAIR / ROWS_TOKEN launches: as one more row block (slot) per token,
or, from 4 tokens (`shared_cols`, `COLS`), as row blocks whose MMA columns are 8 tokens each, so that each of
its weight tiles is read and decoded once per 8 tokens instead of once per token.
Gated FP4 units stream gate and up in one K loop, a sub-step of each per iteration (`_unit_acc`, PAIRED).

The MoE pair (gate/up ROWS_PAIR, then down ROWS_TOKEN) can run as one launch (`moe_pair.py`): every unit is
`_gemv_unit`, as in its own launch, whose SIGNAL / AWAIT / TICKET switches are that launch's only.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..formats import FP4_FORMATS, QWeight
from .decode import _fp4_decode, _fp8_decode, _group_multipliers, _group_scales
from .host import has_pdl, interpreting, lead_strides, num_sms, scale_views
from .sync import SYNC_LINE, _await_row, _prefetch_unit_l2, _signal_row
from .tiles import FMT_CODES, TILE_BYTES_C, _sum_split_partials, byte_offsets, epilogue_factor, scale_chunk_c

ROWS_DENSE, ROWS_PAIR, ROWS_TOKEN = 0, 1, 2
# k elements per thread and register group in the mma.sync bf16 operand layout Triton picks: 4 up to 3.7, the
# instruction's own 2 from 3.8 (SASS of Triton 3.6, 3.7.1, 3.8.0, 3.9.0; `_k_order` follows it)
MMA_K_WIDTH = tl.constexpr(4 if tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 8) else 2)
COLS_TOKENS = 8         # tokens per row block of the shared expert's token columns (`COLS`): the MMA's N
COLS_TOKENS_C = tl.constexpr(COLS_TOKENS)
MAX_ROWS = 16           # x rows per unit (the MMA N dimension); at 32 the x sub-tiles in registers spill
                        # (255 registers, sm_90, Triton 3.6), so 17..64 rows run gemm's fused tiles


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
    result (both operands get it); the wrong one costs shuffles: 1181-1330 instead of ~770 SASS instructions
    per NVFP4 loop iteration (bench/lab/sass.py)."""
    NB: tl.constexpr = KS // 16
    if MMA_K_WIDTH == 2:
        return tl.permute(t.reshape(R, 4, NB, 2, 2), (0, 2, 3, 1, 4)).reshape(R, KS)
    return tl.permute(t.reshape(R, 4, NB // 2, 2, 2, 2), (0, 2, 4, 1, 3, 5)).reshape(R, KS)


@triton.jit
def _to_mma(t, BN: tl.constexpr, W: tl.constexpr, KS: tl.constexpr):
    """A decoded [BN, KS] tile (KS = 64 FP8 / 128 FP4 elements per row, thread c of a row holding elements
    KS/4 c .. KS/4 (c + 1) - 1) from load order to MMA A-operand order (register renaming, see the module
    docstring); W warps. Rows: load row l + 8w + 8W r0 + 16W r1 -> l + 8 r0 + 16 w + 16W r1; K: `_k_order`."""
    t = tl.permute(t.reshape(BN // (16 * W), 2, W, 8, KS), (0, 2, 1, 3, 4)).reshape(BN, KS)
    return _k_order(t, BN, KS)


@triton.jit
def _x_kmajor(x, MP: tl.constexpr, KS: tl.constexpr):
    """x [MP, KS] in natural order -> [KS, MP] in the K order `_to_mma` gives the weights."""
    return tl.trans(_k_order(x, MP, KS))


@triton.jit
def _mma_rows(offs, BN: tl.constexpr, W: tl.constexpr):
    """The memory row of every row of a `_to_mma` tile, given the rows in load order [BN]."""
    t = offs.reshape(BN // (16 * W), 2, W, 8)
    return tl.permute(t, (0, 2, 1, 3)).reshape(BN)


@triton.jit
def _x_subtile(x_ptr, xrow, rmask, k0, stride_xm, MP: tl.constexpr, KS: tl.constexpr, DOT: tl.constexpr,
               GROUP: tl.constexpr):
    """x columns k0 .. k0 + KS - 1 of one sub-step as the dot's B operand [KS, MP], in the K order of
    `_to_mma` tiles. GROUP > 0 (the group columns, module docstring): column m holds only scale group m's GROUP
    columns of the single x row (xrow uniform), times 2^64."""
    k = tl.arange(0, KS)[None, :]
    if GROUP > 0:
        mask = rmask[:, None] & (k // GROUP == tl.arange(0, MP)[:, None])
    else:
        mask = rmask[:, None]
    x = tl.load(x_ptr + xrow.to(tl.int64)[:, None] * stride_xm + k0 + k, mask=mask, other=0.0)
    if GROUP > 0:
        x = x.to(tl.float32) * (2.0 ** 64)   # exact; keeps every product in fp32's normal range
    return _x_kmajor(x.to(DOT), MP, KS)


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
    """acc [BN, MP] += decoded sub-step tile @ xs (the sub-step's x, from `_x_subtile`); CODED: FP4 words as tiled
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
def _unit_acc(x_ptr, xrow, rmask, xcol, wbase, sbase, rows, rows_mma, nmask_mma, s0, s1,
              stride_xm, stride_wn, stride_sn,
              FMT: tl.constexpr, SCALE_F32: tl.constexpr, BN: tl.constexpr, MP: tl.constexpr, W: tl.constexpr,
              DOT: tl.constexpr, ASM: tl.constexpr, PF: tl.constexpr, TILED: tl.constexpr, GCOL: tl.constexpr,
              stride_wg=0, stride_sg=0, PAIRED: tl.constexpr = False):
    """fp32 [BN, MP] partial of one weight over sub-steps [s0, s1), two per iteration (an FP8 iteration is one
    128-K scale block, s0 even). A missing second step (odd count) re-reads the first step's weights against
    zero x. Returns (partial, partial again).

    PAIRED (FP4 gate/up): the partials (gate, up) of two weights stride_wg / stride_sg bytes apart, an iteration
    being one sub-step of each against the same x: one loop, so the pipeline fills once per unit instead of
    once per weight, with twice the bytes in flight per x sub-tile. Each accumulator sees its sub-steps in the
    same order as unpaired: the same bits.

    Weight loads: without prefetch both of an iteration are issued before its first decode (Triton's
    pipeliner, num_stages > 1, stages them and x through shared memory but waits for them at the top of the
    next iteration). With prefetch (PF bit 0 for FP8, bit 1 for FP4 weights) a sub-step's registers are
    refilled with the weights two sub-steps on as soon as they are decoded, so the loads stay in flight across
    the next decode (the last prefetches re-read step s1 - 1).

    GCOL with FP4 weights (one x row, xrow uniform): the group columns (module docstring); the partial is
    returned in column 0."""
    tl.static_assert(not PAIRED or FMT >= 2, "paired weights are FP4")
    acc = tl.zeros((BN, MP), dtype=tl.float32)
    acc2 = tl.zeros((BN, MP), dtype=tl.float32)
    KS: tl.constexpr = 128 if FMT >= 2 else 64
    STEP: tl.constexpr = 1 if PAIRED else 2   # sub-steps of one weight per iteration
    GC: tl.constexpr = GCOL and FMT >= 2
    XG: tl.constexpr = 16 if GC else 0
    if GC:
        rmask = xrow * 0 == 0   # one x row, read by every MMA column (each its own scale groups)
    PREFETCH: tl.constexpr = (PF >> (1 if FMT >= 2 else 0)) & 1
    # each row's sub-step 0 (byte column 0) and the distance from one sub-step to the next (byte column
    # STEP of row 0) in the weight and FP4 scale arrays, row-major or tiled (`formats.tiling`)
    SSTEP: tl.constexpr = scale_chunk_c(FMT)
    zero = tl.full((), 0, tl.int32)   # a 0-d tensor, not 0: the interpreter has no int % constexpr
    wrow = byte_offsets(rows, zero, stride_wn, TILE_BYTES_C, TILED)
    wk = byte_offsets(zero, zero + TILE_BYTES_C, stride_wn, TILE_BYTES_C, TILED)
    srow = byte_offsets(rows, zero, stride_sn, SSTEP, TILED and FMT >= 2)
    sk = byte_offsets(zero, zero + SSTEP, stride_sn, SSTEP, TILED and FMT >= 2)
    # the second operand of an iteration: the next sub-step, or (PAIRED) the same sub-step of the up weight
    wbase1 = wbase + stride_wg if PAIRED else wbase
    sbase1 = sbase + stride_sg if PAIRED else sbase
    if PREFETCH:
        b0, c0 = _load_sub(wbase, sbase, wrow, srow, s0, wk, sk, FMT)
        b1, c1 = _load_sub(wbase1, sbase1, wrow, srow, s0 if PAIRED else tl.minimum(s0 + 1, s1 - 1), wk, sk, FMT)
    elif GC:
        # the scales feed no dot operand here, so the pipeliner would leave their loads unstaged: they are
        # loaded a loop iteration ahead into registers instead
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
        x0 = _x_subtile(x_ptr, xrow, rmask, xcol + step * KS, stride_xm, MP, KS, DOT, XG)
        if PAIRED:
            x1 = x0
        else:
            x1 = _x_subtile(x_ptr, xrow, rmask & (xrow * 0 + step + 1 < s1), xcol + step1 * KS, stride_xm, MP,
                            KS, DOT, XG)
        blk = _mma_sub(acc if FMT >= 2 else tl.zeros((BN, MP), dtype=tl.float32), b0, c0, x0, FMT, BN, W,
                       DOT, ASM, GC, TILED)
        if PREFETCH:
            b0, c0 = _load_sub(wbase, sbase, wrow, srow, tl.minimum(step + STEP, s1 - 1), wk, sk, FMT)
        if PAIRED:
            acc2 = _mma_sub(acc2, b1, c1, x1, FMT, BN, W, DOT, ASM, GC, TILED)
        else:
            blk = _mma_sub(blk, b1, c1, x1, FMT, BN, W, DOT, ASM, GC, TILED)
        if PREFETCH:
            b1, c1 = _load_sub(wbase1, sbase1, wrow, srow, tl.minimum(step1 + STEP, s1 - 1), wk, sk, FMT)
        if FMT >= 2:
            acc = blk
        else:
            acc += blk * _fp8_block_scale(sbase, rows_mma, nmask_mma, step // 2, stride_sn, SCALE_F32)[:, None]
    if GC:   # the group columns' sum, and the 2^53 that `decode._group_scales` leaves out
        acc = tl.where(tl.arange(0, MP)[None, :] == 0, tl.sum(acc, axis=1)[:, None] * (2.0 ** 53), 0.0)
        if PAIRED:
            acc2 = tl.where(tl.arange(0, MP)[None, :] == 0, tl.sum(acc2, axis=1)[:, None] * (2.0 ** 53), 0.0)
    return acc, acc2 if PAIRED else acc


# ------------------------------------------------------------------------------------------ kernel

@triton.jit
def _weight_unit(x_ptr, xrow, rmask, xcol, wbase, sbase, s2base, rows, rows_mma, nmask_mma, s0, s1, rw,
                 stride_xm, stride_wg, stride_wn, stride_sg, stride_sn, stride_s2g,
                 FMT: tl.constexpr, SCALE_F32: tl.constexpr, GATED: tl.constexpr, BN: tl.constexpr,
                 MP: tl.constexpr, W: tl.constexpr, DOT: tl.constexpr, ASM: tl.constexpr,
                 PF: tl.constexpr, TILED: tl.constexpr, GCOL: tl.constexpr):
    """One unit's partial(s) of one weight: (acc, acc_u, factor, factor_u); acc_u is the up projection when
    GATED (else acc again). The factors undo the decode prescale and apply the routing weight `rw`."""
    PAIRED: tl.constexpr = GATED and FMT >= 2   # FP4 gate and up in one loop (`_unit_acc`)
    acc, acc_u = _unit_acc(x_ptr, xrow, rmask, xcol, wbase, sbase, rows, rows_mma, nmask_mma, s0, s1,
                           stride_xm, stride_wn, stride_sn, FMT, SCALE_F32, BN, MP, W, DOT, ASM, PF, TILED, GCOL,
                           stride_wg, stride_sg, PAIRED)
    f = epilogue_factor(s2base, FMT) * rw
    f_u = f
    if GATED:
        if not PAIRED:
            acc_u, _ = _unit_acc(x_ptr, xrow, rmask, xcol, wbase + stride_wg, sbase + stride_sg, rows, rows_mma,
                                 nmask_mma, s0, s1, stride_xm, stride_wn, stride_sn, FMT, SCALE_F32, BN, MP, W,
                                 DOT, ASM, PF, TILED, GCOL)
        f_u = epilogue_factor(s2base + stride_s2g, FMT)
    return acc, acc_u, f, f_u


@triton.jit
def _launch_layout(N, R, SPLIT, TOPK, P, SPLIT_S, NB, ROWS: tl.constexpr, BN: tl.constexpr, SHARED: tl.constexpr,
                   X_READY: tl.constexpr, COLS: tl.constexpr = False, BLOCKS: tl.constexpr = False):
    """(units, splits per output tile, N tiles, shared units, first shared unit, first routed unit) of one launch:
    the unit numbering `_gemv_unit` decodes. The shared expert's units (SPLIT_S per N tile of each of its row
    blocks: one per token, or with COLS one per COLS_TOKENS tokens) form their own range in ROWS_PAIR, first when
    X_READY, and in ROWS_TOKEN with COLS, first; without COLS, ROWS_TOKEN gives them the splits j >= TOPK *
    SPLIT of every token's tiles. BLOCKS: the routed units are SPLIT per N tile of each of the NB rows of the
    expert-block table."""
    num_n = tl.cdiv(N, BN)
    splits = SPLIT * TOPK + (SPLIT_S if SHARED else 0) if ROWS == 2 else SPLIT
    total = (NB * num_n * SPLIT) if BLOCKS else R * num_n * splits
    shared_units = total * 0
    first_shared = total * 0
    first_routed = total * 0
    if SHARED and (ROWS == 1 or COLS):
        shared_units = (tl.cdiv(R - P if ROWS == 1 else R, COLS_TOKENS_C) if COLS else R - P) * num_n * SPLIT_S
        routed = (NB * SPLIT if BLOCKS else P * SPLIT if ROWS == 1 else R * SPLIT * TOPK) * num_n
        total = routed + shared_units
        shared_first = X_READY or ROWS == 2   # ROWS_TOKEN: so that the tiles' last arrivals spread over routed units
        first_shared = 0 if shared_first else routed
        first_routed = shared_units if shared_first else 0
    return total, splits, num_n, shared_units, first_shared, first_routed


@triton.jit
def _block_unit(v, SPLIT):
    """ROWS_TOKEN with BLOCKS: routed unit v -> (tile, split) as `_gemv_unit` decodes them: tile = block * num_n + N
    tile, split = the K split (units numbered (block, N tile, K split), K split fastest)."""
    return v // SPLIT, v % SPLIT


@triton.jit
def _block_row(table_ptr, b, NB, MP: tl.constexpr):
    """Row b of the expert-block table (`moe.expert_blocks`, NB rows): (expert, columns, pair of each MMA column
    [MP]); b >= NB (a shared-expert unit, which may run before the table is written) reads nothing: (0, 0, zeros)."""
    row = table_ptr + tl.minimum(b, NB - 1) * (2 + MP)
    ncols = tl.load(row + 1, mask=b < NB, other=0)
    pc = tl.load(row + 2 + tl.arange(0, MP), mask=tl.arange(0, MP) < ncols, other=0)
    return tl.load(row, mask=b < NB, other=0), ncols, pc


@triton.jit
def _signal_unit_rows(ready_ptr, r, pc, ncols, MP: tl.constexpr, BLOCKS: tl.constexpr):
    """SIGNAL: one more tile of the unit's h row r written or, BLOCKS, of the h row of each of its ncols columns'
    pairs pc (a shared-expert unit has ncols 1 and pc its row r)."""
    if BLOCKS:
        for c in range(0, ncols):
            _signal_row(ready_ptr + tl.sum(tl.where(tl.arange(0, MP) == c, pc, 0)) * SYNC_LINE)
    else:
        _signal_row(ready_ptr + r * SYNC_LINE)


@triton.jit
def _gemv_unit(
    u, splits, num_n, shared_units, first_shared, first_routed,
    x_ptr, w_ptr, s_ptr, s2_ptr, y_ptr, ids_ptr, rw_ptr, ws_ptr, cnt_ptr,
    M, N, R, SPLIT, TOPK, CHUNK, n_steps, limit, X_DIV, GROUP_R, X_GSTRIDE,
    stride_xm, stride_we, stride_wg, stride_wn, stride_se, stride_sg, stride_sn, stride_s2e, stride_s2g,
    stride_ym,
    sw_ptr, ss_ptr, ss2_ptr, P, NB, CHUNK_S, SPLIT_S, n_steps_s, stride_swg, stride_swn, stride_ssg, stride_ssn,
    stride_ss2g,
    ready_ptr, ready_target, ticket_ptr,
    FMT: tl.constexpr, SCALE_F32: tl.constexpr, ROWS: tl.constexpr, GATED: tl.constexpr, BN: tl.constexpr,
    MP: tl.constexpr, DOT: tl.constexpr, ASM: tl.constexpr, W: tl.constexpr,
    SHARED: tl.constexpr, FMT_S: tl.constexpr, SCALE_F32_S: tl.constexpr, PF: tl.constexpr, TILED: tl.constexpr,
    TILED_S: tl.constexpr, PDL: tl.constexpr, GCOL: tl.constexpr, X_READY: tl.constexpr,
    SIGNAL: tl.constexpr, AWAIT: tl.constexpr, AWAIT_L2: tl.constexpr, TICKET: tl.constexpr,
    COLS: tl.constexpr = False, BLOCKS: tl.constexpr = False,
):
    """Unit u of a launch (`_gemv_kernel`'s docstring; `_launch_layout` gives its numbering).

    BLOCKS (ROWS_PAIR / ROWS_TOKEN): ids_ptr is the expert-block table (`moe.expert_blocks`); the routed units are
    (block b < NB, the table's rows, N tile, K split) and each streams its block's expert once for all of the
    block's (token, slot) pairs, one MMA column each (a block of one pair runs the group columns, if on); in the
    fused pair a gate/up block unit signals the h row of each of its pairs and a down block unit waits for all of
    them.

    The fused MoE pair (`moe_pair._moe_pair_kernel`): SIGNAL (gate/up) counts every output tile written into
    ready[h row]; AWAIT (down) waits, before it reads its h row, until that row holds ready_target tiles,
    L2-prefetching up to AWAIT_L2 sub-steps of its tile-major weights first if it has to wait. TICKET: draws
    the program's next ticket (returned) once its weights are read, so that the atomic's round trip overlaps
    the unit's stores; else returns 0."""
    WAIT_PER_UNIT: tl.constexpr = PDL and waits_per_unit(X_READY, ROWS, SHARED)
    offs_r = tl.arange(0, MP)
    offs_b = tl.arange(0, BN)
    nsplit = splits + u * 0   # partials of this unit's output tile (a scalar of the unit's type)
    j = u % splits
    tile = u // splits
    if BLOCKS and ROWS == 2 and not SHARED:
        tile, j = _block_unit(u, SPLIT)
    if SHARED and (ROWS == 1 or COLS):
        if u >= first_shared and u < first_shared + shared_units:
            if ROWS == 1:
                nsplit = SPLIT_S + u * 0
                j = (u - first_shared) % SPLIT_S
                tile = P * num_n + (u - first_shared) // SPLIT_S
            else:   # COLS: token block g's first tile stands for its tokens' (rows below); the slot TOPK
                j = TOPK * SPLIT + (u - first_shared) % SPLIT_S
                tile = (u - first_shared) // SPLIT_S
        else:
            routed_splits = SPLIT if ROWS == 1 else SPLIT * TOPK   # units per routed output tile
            j = (u - first_routed) % routed_splits
            tile = (u - first_routed) // routed_splits
            if BLOCKS and ROWS == 2:
                tile, j = _block_unit(tile * routed_splits + j, SPLIT)
        if WAIT_PER_UNIT:
            if u >= first_routed:
                gdc_wait()   # a routed unit reads the expert ids
    pid_n = tile % num_n
    r = tile // num_n
    ks = j if ROWS == 1 else j % SPLIT   # ROWS_PAIR: j < SPLIT (routed) or < SPLIT_S (shared)
    on_shared = r < 0   # a false scalar of the unit's type
    # rows of x this unit reads, rows of y it writes, and the weight (expert) it streams
    if ROWS == 0:
        rmask = offs_r < M
        xrow = offs_r if not GCOL else offs_r * 0   # GCOL: M == 1, every MMA column reads x row 0
        yrow = offs_r
        e = r * 0
        rw = 1.0
    elif ROWS == 1:
        rmask = offs_r == 0
        yrow = r + offs_r * 0
        xrow = yrow // X_DIV
        if SHARED:
            on_shared = r >= P
            xrow = tl.where(on_shared, yrow - P, xrow)
        rw = 1.0
        if BLOCKS:   # block r's pairs: column c writes h row pc[c] from x row (token) pc[c] // X_DIV
            e, ncols, pc = _block_row(ids_ptr, r, NB, MP)
            ncols = tl.where(on_shared, 1, ncols)
            rmask = tl.where(on_shared, rmask, offs_r < ncols)
            yrow = tl.where(on_shared, yrow, pc)
            xrow = tl.where(on_shared, xrow, pc // X_DIV)
            pc = tl.where(on_shared, r, pc)   # the h row a shared-expert unit signals (one pass: ncols 1)
        elif SHARED:
            e = tl.load(ids_ptr + tl.minimum(r, P - 1), mask=r < P, other=0).to(tl.int32)
        else:
            e = tl.load(ids_ptr + r).to(tl.int32)
    else:
        rmask = offs_r == 0
        slot = tl.minimum(j // SPLIT, TOPK)
        if SHARED:
            on_shared = slot == TOPK
            ks = tl.where(on_shared, j - TOPK * SPLIT, ks)
        pair = r * TOPK + tl.minimum(slot, TOPK - 1)
        yrow = r + offs_r * 0
        xrow = tl.where(on_shared, P + r, pair) + offs_r * 0
        if BLOCKS:   # block r's pairs: column c reads h row pc[c], its partial is token pc[c] // TOPK's
            e, ncols, pc = _block_row(ids_ptr, tl.where(on_shared, NB, r), NB, MP)
            ncols = tl.where(on_shared, 1, ncols)
            rmask = tl.where(on_shared, rmask, offs_r < ncols)
            yrow = tl.where(on_shared, yrow, pc // TOPK)
            xrow = tl.where(on_shared, xrow, pc)
            jcol = tl.where(on_shared, j, (pc % TOPK) * SPLIT + ks)   # each column's partial (slot, K split)
            rw = tl.where(on_shared, 1.0, tl.load(rw_ptr + pc, mask=offs_r < ncols, other=0.0).to(tl.float32))
        else:
            e = tl.load(ids_ptr + pair).to(tl.int32)
            rw = tl.where(on_shared, 1.0, tl.load(rw_ptr + pair).to(tl.float32))
    n0 = pid_n * BN
    rows = tl.minimum(n0 + offs_b, N - 1)   # rows past N re-read row N - 1; never stored
    rows_mma = _mma_rows(n0 + offs_b, BN, W)
    nmask_mma = rows_mma < N
    xcol = (n0 // tl.maximum(GROUP_R, 1)) * X_GSTRIDE   # block-diagonal (wo_a): this tile's x columns
    e64 = e.to(tl.int64)
    s0 = ks * CHUNK
    # the shared expert's unit (SHARED only; a compile-time False otherwise, so no branch is emitted)
    shared_unit = on_shared if SHARED else False
    tokens = R - P if ROWS == 1 else R
    # COLS: MMA column c of the shared unit of token block g (r - P in gate/up, r in down) is token 8 g + c
    tl.static_assert(not COLS or MP == COLS_TOKENS_C, "token columns: COLS_TOKENS tokens per MMA")
    col_token = ((r - P if ROWS == 1 else r) * COLS_TOKENS_C + offs_r) if COLS else offs_r
    if AWAIT:   # ROWS_TOKEN: x row `pair` (routed slot) or P + r (the shared expert's), written by gate/up units
        if shared_unit:
            s0 = ks * CHUNK_S
            _await_row(ready_ptr + (P + r) * SYNC_LINE, ready_target, sw_ptr, ss_ptr, n0, s0,
                       tl.minimum(CHUNK_S, n_steps_s - s0), stride_swn, stride_ssn, FMT_S, TILED_S, ASM, AWAIT_L2)
        elif BLOCKS:   # the h rows of all the block's pairs
            for c in range(0, ncols):
                _await_row(ready_ptr + tl.sum(tl.where(offs_r == c, pc, 0)) * SYNC_LINE, ready_target,
                           w_ptr + e64 * stride_we, s_ptr + e64 * stride_se, n0, s0, tl.minimum(CHUNK, n_steps - s0),
                           stride_wn, stride_sn, FMT, TILED, ASM, AWAIT_L2)
        else:
            _await_row(ready_ptr + pair * SYNC_LINE, ready_target, w_ptr + e64 * stride_we, s_ptr + e64 * stride_se,
                       n0, s0, tl.minimum(CHUNK, n_steps - s0), stride_wn, stride_sn, FMT, TILED, ASM, AWAIT_L2)
    if shared_unit:
        s0 = ks * CHUNK_S
        xrow_s = xrow
        rmask_s = rmask
        if COLS:   # column c reads x row col_token[c] (gate/up) or h row P + col_token[c] (down)
            xrow_s = col_token + (0 if ROWS == 1 else P)
            rmask_s = col_token < tokens
        acc, acc_u, f, f_u = _weight_unit(
            x_ptr, xrow_s, rmask_s, xcol, sw_ptr, ss_ptr, ss2_ptr, rows, rows_mma, nmask_mma, s0,
            tl.minimum(s0 + CHUNK_S, n_steps_s), rw, stride_xm, stride_swg, stride_swn, stride_ssg,
            stride_ssn, stride_ss2g, FMT_S, SCALE_F32_S, GATED, BN, MP, W, DOT, ASM, PF, TILED_S,
            GCOL and not COLS)
    elif BLOCKS:
        # a block of one pair: the group columns (as without blocks: the same bits); several: one column each; an
        # empty block (past the last expert): two sub-steps of expert 0, all columns masked, nothing stored
        s1 = tl.minimum(s0 + CHUNK, n_steps)
        s1 = tl.where(ncols > 0, s1, tl.minimum(s0 + 2, s1))
        if GCOL and ncols == 1:
            acc, acc_u, f, f_u = _weight_unit(
                x_ptr, tl.sum(tl.where(offs_r == 0, xrow, 0)) + offs_r * 0, rmask, xcol, w_ptr + e64 * stride_we,
                s_ptr + e64 * stride_se, s2_ptr + e64 * stride_s2e, rows, rows_mma, nmask_mma, s0, s1, rw,
                stride_xm, stride_wg, stride_wn, stride_sg, stride_sn, stride_s2g, FMT, SCALE_F32, GATED, BN, MP,
                W, DOT, ASM, PF, TILED, GCOL)
        else:
            acc, acc_u, f, f_u = _weight_unit(
                x_ptr, xrow, rmask, xcol, w_ptr + e64 * stride_we, s_ptr + e64 * stride_se,
                s2_ptr + e64 * stride_s2e, rows, rows_mma, nmask_mma, s0, s1, rw,
                stride_xm, stride_wg, stride_wn, stride_sg, stride_sn, stride_s2g, FMT, SCALE_F32, GATED, BN, MP,
                W, DOT, ASM, PF, TILED, False)
    else:
        acc, acc_u, f, f_u = _weight_unit(
            x_ptr, xrow, rmask, xcol, w_ptr + e64 * stride_we, s_ptr + e64 * stride_se,
            s2_ptr + e64 * stride_s2e, rows, rows_mma, nmask_mma, s0, tl.minimum(s0 + CHUNK, n_steps), rw,
            stride_xm, stride_wg, stride_wn, stride_sg, stride_sn, stride_s2g, FMT, SCALE_F32, GATED, BN, MP,
            W, DOT, ASM, PF, TILED, GCOL)
    if SHARED and COLS:   # ... and writes h row P + col_token[c] (gate/up) or out row col_token[c] (down)
        rmask = tl.where(on_shared, col_token < tokens, rmask)
        yrow = tl.where(on_shared, col_token + (P if ROWS == 1 else 0), yrow)
    if WAIT_PER_UNIT:
        gdc_wait()   # before any write: h and the workspace may reuse memory the previous kernel reads
    ticket = u * 0
    if TICKET:
        ticket = tl.atomic_add(ticket_ptr, 1, sem="relaxed", scope="gpu")
    # y[yrow, rows_mma] = acc^T (rows of the MMA tile are memory rows rows_mma)
    offs_y = yrow.to(tl.int64)[None, :] * stride_ym + rows_mma[:, None]
    omask = rmask[None, :] & nmask_mma[:, None]
    if nsplit > 1:
        # park the scaled partial, count arrivals; the last unit of the tile sums all in split order
        offs_ws = yrow.to(tl.int64)[None, :] * N + rows_mma[:, None]
        plane = M.to(tl.int64) * N
        if BLOCKS and ROWS == 2:   # each column's partial in its own (slot, K split) plane
            part = ws_ptr + (jcol.to(tl.int64) * plane)[None, :]
        else:
            part = ws_ptr + j.to(tl.int64) * (2 * plane if GATED else plane)
        tl.store(part + offs_ws, acc * f, mask=omask)
        if GATED:
            tl.store(part + plane + offs_ws, acc_u * f_u, mask=omask)
        tl.debug_barrier()
        cnt = cnt_ptr + tile
        multi = shared_unit if COLS else False   # a unit whose columns are partials of several tokens' tiles
        if BLOCKS:
            multi = True
        if ROWS == 2 and multi:
            # one partial for every token's tile (N tile pid_n of row block t): count into each, and sum the
            # tiles this unit completes
            cnts = cnt_ptr + yrow * num_n + pid_n
            last = rmask & (tl.atomic_add(cnts, 1, mask=rmask, sem="acq_rel", scope="gpu") == nsplit - 1)
            if tl.max(last.to(tl.int32), axis=0) > 0:
                lmask = omask & last[None, :]
                acc, _ = _sum_split_partials(ws_ptr, plane, plane, offs_ws, lmask, nsplit, BN, MP, False)
                tl.atomic_xchg(cnts, 0, mask=last, sem="relaxed", scope="gpu")
                _epilogue(y_ptr, offs_y, lmask, acc, acc, 1.0, 1.0, limit, False)
            arrived = nsplit * 0   # not the last for tile `tile` below
        else:
            arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
        if arrived == nsplit - 1:
            acc, acc_u = _sum_split_partials(ws_ptr, 2 * plane if GATED else plane, plane, offs_ws, omask, nsplit,
                                             BN, MP, GATED)
            tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")
            _epilogue(y_ptr, offs_y, omask, acc, acc_u if GATED else acc, 1.0, 1.0, limit, GATED)
            if SIGNAL:
                _signal_unit_rows(ready_ptr, r, pc if BLOCKS else r, ncols if BLOCKS else 1, MP, BLOCKS)
    else:
        _epilogue(y_ptr, offs_y, omask, acc, acc_u if GATED else acc, f, f_u if GATED else f, limit, GATED)
        if SIGNAL:
            _signal_unit_rows(ready_ptr, r, pc if BLOCKS else r, ncols if BLOCKS else 1, MP, BLOCKS)
    return ticket


@triton.jit(do_not_specialize=["M", "R", "SPLIT", "TOPK", "CHUNK", "P", "NB", "CHUNK_S", "SPLIT_S", "n_steps_s"])
def _gemv_kernel(
    x_ptr, w_ptr, s_ptr, s2_ptr, y_ptr, ids_ptr, rw_ptr, ws_ptr, cnt_ptr,
    M, N, R, SPLIT, TOPK, CHUNK, n_steps, limit, X_DIV, GROUP_R, X_GSTRIDE,
    stride_xm, stride_we, stride_wg, stride_wn, stride_se, stride_sg, stride_sn, stride_s2e, stride_s2g,
    stride_ym,
    sw_ptr, ss_ptr, ss2_ptr, P, NB, CHUNK_S, SPLIT_S, n_steps_s, stride_swg, stride_swn, stride_ssg, stride_ssn,
    stride_ss2g,
    FMT: tl.constexpr, SCALE_F32: tl.constexpr, ROWS: tl.constexpr, GATED: tl.constexpr, BN: tl.constexpr,
    MP: tl.constexpr, DOT: tl.constexpr, ASM: tl.constexpr, W: tl.constexpr,
    SHARED: tl.constexpr, FMT_S: tl.constexpr, SCALE_F32_S: tl.constexpr, PF: tl.constexpr, TILED: tl.constexpr,
    TILED_S: tl.constexpr, PDL: tl.constexpr, PDL_L2: tl.constexpr, GCOL: tl.constexpr,
    X_READY: tl.constexpr = False, COLS: tl.constexpr = False, BLOCKS: tl.constexpr = False,
):
    """Units u = (row block r, N tile, split j), j fastest. Row blocks: ROWS_DENSE one block of M rows;
    ROWS_PAIR R pairs; ROWS_TOKEN R tokens whose splits are (slot, K split) = (j // SPLIT, j % SPLIT).

    SHARED (the MoE's shared expert in the same launch, its own format FMT_S and pointers sw/ss/ss2, its own
    SPLIT_S K splits of CHUNK_S sub-steps, so that its units stream about as many bytes as a routed one):
    ROWS_PAIR pairs P .. R - 1 are the shared expert's rows (x row r - P), their units after all routed ones;
    ROWS_TOKEN tokens get SPLIT_S more splits j >= TOPK * SPLIT, the slot TOPK, which reads h row P + token
    with routing weight 1. COLS: the shared expert's units are a row block per COLS_TOKENS of the R - P
    (ROWS_PAIR) or R tokens, MMA column c of block g being token 8 g + c (its h row P + 8 g + c); in ROWS_TOKEN
    they come first and each counts into its tokens' output tiles (`_gemv_unit`); in the fused pair, block g's
    gate/up tiles count into the flag of h row P + g, on which its down units wait.

    X_READY (ROWS_PAIR with SHARED; `launch(x_ready=True)`: x was written before the previous kernel started,
    which is `moe.route`): the shared expert's units come first, and with PDL a unit waits for the previous
    kernel only before it reads the expert ids (routed units) or writes anything (every unit), so the shared
    expert streams while the routing kernel runs. Split partials are summed in split order whoever computes
    them, so the result is the same bits."""
    total, splits, num_n, shared_units, first_shared, first_routed = _launch_layout(
        N, R, SPLIT, TOPK, P, SPLIT_S, NB, ROWS, BN, SHARED, X_READY, COLS, BLOCKS)
    if PDL:
        # programmatic dependent launch: the next kernel may take SM slots as this one's CTAs finish; this one
        # waits for the previous kernel before it reads x, ids or scratch, or writes anything. Before the wait
        # it only prefetches its first dense unit's weights into L2 (no kernel writes them)
        gdc_launch_dependents()
        if PDL_L2 > 0 and ROWS == 0 and TILED:
            _prefetch_unit_l2(w_ptr, s_ptr, tl.minimum(tl.program_id(0), total - 1), splits, num_n, SPLIT, CHUNK,
                              n_steps, stride_wn, stride_sn, stride_wg, stride_sg, FMT, GATED, BN, PDL_L2)
        if not waits_per_unit(X_READY, ROWS, SHARED):
            gdc_wait()
    for u in range(tl.program_id(0), total, tl.num_programs(0)):
        _gemv_unit(u, splits, num_n, shared_units, first_shared, first_routed,
                   x_ptr, w_ptr, s_ptr, s2_ptr, y_ptr, ids_ptr, rw_ptr, ws_ptr, cnt_ptr,
                   M, N, R, SPLIT, TOPK, CHUNK, n_steps, limit, X_DIV, GROUP_R, X_GSTRIDE,
                   stride_xm, stride_we, stride_wg, stride_wn, stride_se, stride_sg, stride_sn, stride_s2e,
                   stride_s2g, stride_ym,
                   sw_ptr, ss_ptr, ss2_ptr, P, NB, CHUNK_S, SPLIT_S, n_steps_s, stride_swg, stride_swn, stride_ssg,
                   stride_ssn, stride_ss2g, cnt_ptr, 0, cnt_ptr,
                   FMT, SCALE_F32, ROWS, GATED, BN, MP, DOT, ASM, W, SHARED, FMT_S, SCALE_F32_S, PF, TILED, TILED_S,
                   PDL, GCOL, X_READY, False, False, 0, False, COLS, BLOCKS)


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


# ------------------------------------------------------------------------------------------ launching

@dataclass(frozen=True)
class GemvConfig:
    """Measured on the H200 (bench/RESULTS.md, rounds two and three): two warps on mma.sync tiles of 64 rows
    beat one warpgroup's wgmma on 128 rows for FP8 and tie for FP4 (128 rows on 2 warps win only for large FP4
    weights at 9-16 rows: `default_config`). With 16 x rows (MMA N = 16) registers bound the resident warps, so
    the kernel is capped at 128 (16 warps per SM, no spills; the gated one would spill and keeps its registers).
    With N = 8 it needs ~98 registers; caps of 96 / 88 / 80 / 72 and BN 32
    measured no faster (80 and below slower: spills), nor did 3 pipeline stages (run 10). Register prefetch of
    the weights (round four, runs 14 and 18): FP8 V4-Pro wo_b 51 -> 42 us; FP4 slower in every variant tried (more
    live registers for the same 16 warps per SM), so it is on for FP8 only.

    Programmatic dependent launch (round six, runs 41-44): back to back, dense GEMVs are 2-4 % faster on
    V4-Pro shapes and 8-11 % on V4-Flash's (launch latency and the first DRAM round trip overlap the previous
    kernel's tail); an L2 prefetch of 1-2 sub-steps before the wait helps, 8 hurts. The MoE pair measured level
    to 5 % slower with it at 4-8 tokens, so `kernels.moe` launches it without, except the gate/up launch right
    after the routing kernel (`launch(x_ready=True)`): streaming the shared expert while routing runs made the
    MoE layer 1.5-2 % faster at 1 token, level to 5 % at 4-8 (round eight, runs 65-69; with the persistent grid it
    measured up to 9 % at 8 tokens, most of which hardware scheduling now gives every launch, run 68), and the down
    launch after that one at 1-2 tokens (`moe.DOWN_PDL_TOKENS`; run 193: V4-Flash's layer 1.4 % faster)."""
    BN: int = 64
    split: int = 0            # K splits per output tile (ROWS_TOKEN: per slot); 0 = chosen at launch
    num_warps: int = 2        # mma.sync; with 4 and BN 128 Triton picks wgmma (correct, not laid out for: slow)
    max_ctas_per_sm: int = 0  # slots = SMs x resident CTAs (from the compiled kernel), which the split plan
                              # fills; > 0 caps it
    persistent: bool = False  # True: a grid of min(units, slots) programs, each looping over units u = pid + k *
                              # grid; False: one program per unit, the hardware scheduling them. The same for
                              # one wave; with more (the MoE pair at 4-8 tokens) the persistent grid's units
                              # sat unevenly on the SMs: 2-8 % slower (round eight, runs 68-69)
    maxnreg: int = -1         # register cap per thread: -1 = 128 unless gated with 16 rows (it would spill); 0 = none
    num_stages: int = 2       # software pipelining of the weight loads (cp.async into shared memory, then
                              # LDS.128 in the operand layout: the next K step is in flight while one decodes)
    asm: bool | None = None   # None: ASM wherever the operands are bf16 on a GPU
    prefetch: int = 1         # register prefetch of the weights (see _unit_acc), a bit mask: 1 FP8, 2 FP4
    pdl: bool = True          # programmatic dependent launch where the GPU has it (sm_90+; never interpreted)
    pdl_l2: int = 2           # with pdl: sub-steps (4 KB each, a power of 2) of the first dense unit of tile-major
                              # weights prefetched into L2 before the wait; 0 = none
    group_cols: bool | None = None   # FP4 weights, one x row per unit: the MMA's columns carry the scale
                              # groups (module docstring) instead of a multiply per weight pair. None: in the MoE
                              # row modes only (runs 55-62: MoE pair up to 5 % faster, dense V4-Pro wq_b /
                              # wo_b at M = 1 7-13 % slower); True: dense calls of one row too

    def __post_init__(self):
        if self.pdl_l2 < 0 or self.pdl_l2 & (self.pdl_l2 - 1):
            raise ValueError(f"GemvConfig.pdl_l2 must be 0 or a power of two (sub-steps), got {self.pdl_l2}")


UNIT_OVERHEAD_STEPS = 3   # per-unit fixed cost (index math, pipeline fill, epilogue) in sub-steps, from SASS


# Where the GEMV is the default (H200, bench/RESULTS.md run 10): for at most 8 rows (the MMA's N = 8) it beats
# round one's fused tiles on every benchmark shape, small matrices included (V4-Flash expert w1/w3 NVFP4, 4.7 MB:
# 7.6 vs 10.3 us at M = 1; V4-Pro wq_b NVFP4: 24.7 vs 30.4 us), and the MoE pair at 1..8 tokens (V4-Flash routed,
# 8 tokens: 257 vs 307 us). At 9..16 rows (N = 16) each unit's fixed cost loses to round one's kernel on
# matrices of a few MB (V4-Pro expert w1/w3 M = 16: 16.9 vs 14.5 us), so there the weight bytes decide.
PREFERRED_BYTES = MappingProxyType({"fp8": 20e6, "mxfp4": 30e6, "nvfp4": 30e6})
ALWAYS_ROWS = 8
MOE_TOKENS = 8


def preferred(w: QWeight, x: torch.Tensor, rows: int) -> bool:
    """`supported`, and measured faster than round one's kernel: at most ALWAYS_ROWS rows, or a large enough
    weight (always under the interpreter)."""
    if not supported(w, x, rows):
        return False
    return interpreting() or rows <= ALWAYS_ROWS or w.nbytes() >= PREFERRED_BYTES[w.fmt]


def steps_of(fmt: str, K: int) -> int:
    return K // (128 if fmt in FP4_FORMATS else 64)


def supported(w: QWeight, x: torch.Tensor, rows: int) -> bool:
    """Formats, shapes and dtypes this kernel takes (anything else goes to `gemm`): FP4 / FP8 weights, K a
    multiple of 128, bf16 activations on a GPU (fp32 only under the interpreter), at most MAX_ROWS rows."""
    if w.fmt not in ("fp8", "mxfp4", "nvfp4") or rows > MAX_ROWS or w.in_features % 128:
        return False
    if w.weight.stride(-1) != 1 or w.scale is None or w.scale.stride(-1) != 1 or w.weight.device != x.device:
        return False
    if w.fmt == "nvfp4" and w.scale_2 is None:
        return False
    if interpreting():
        return x.dtype in (torch.float32, torch.bfloat16)
    return x.device.type == "cuda" and x.dtype == torch.bfloat16


def choose_split(units_per_split: int, n_steps: int, slots: int, max_split: int | None = None) -> int:
    """K splits minimizing waves x (steps per unit + fixed cost per unit): splitting fills idle CTAs, but every
    unit pays its own prologue, epilogue and partial store; splits keep whole step pairs."""
    best, best_cost = 1, None
    for split in range(1, max(1, min(max_split or 64, n_steps // 2)) + 1):
        chunk = triton.cdiv(n_steps, split)
        chunk += chunk % 2
        used = triton.cdiv(n_steps, chunk)
        cost = triton.cdiv(units_per_split * used, slots) * (chunk + UNIT_OVERHEAD_STEPS)
        if best_cost is None or cost < best_cost:
            best, best_cost = used, cost
    return best


def mma_n(rows: int) -> int:
    """The MMA's N (`MP`, x rows per unit) for `rows` rows of x: 8 up to 8 rows, else 16."""
    return max(8, triton.next_power_of_2(max(1, rows)))


def group_cols_on(cfg: GemvConfig, rows: int, M: int, w: QWeight, shared: QWeight | None) -> bool:
    """The group columns (module docstring): where every unit reads one x row (the MoE row modes, or a dense call
    of one row; the MMA's N is then 8) and the routed or shared weight is FP4; `cfg.group_cols` None = in the MoE
    row modes only."""
    wanted = rows != ROWS_DENSE if cfg.group_cols is None else cfg.group_cols
    fp4 = w.fmt in FP4_FORMATS or (shared is not None and shared.fmt in FP4_FORMATS)
    return wanted and fp4 and (rows != ROWS_DENSE or M == 1)


SHARED_COLS_TOKENS = 4   # from this many tokens the shared expert's units read COLS_TOKENS tokens each ...
# ... up to this many (above, `moe` adds it beside the pair: `mlp_op`). Against `mlp_op` beside the pair over expert
# blocks, the MoE layer (H200, bench/RESULTS.md run 141): V4-Flash NVFP4 0.940 / 0.962 of the time at 12 / 16 tokens,
# 0.975-0.979 at 24-32 (3-4 row blocks, each decoding the shared weights again); V4-Pro 0.998 at 12-16, 1.016 at 32
SHARED_COLS_MAX = 16


def shared_cols(rows: int, R: int, pairs: int, shared: QWeight | None) -> bool:
    """Whether the MoE's shared expert runs as row blocks whose MMA columns are 8 tokens each (`COLS`) instead of
    one row block per token: each of its weight tiles is then read and decoded once per 8 tokens, and its
    units get K splits as long as the routed ones' (`plan_splits`). What the shared expert adds to the pair
    (bench/lab/profile_shared.py, run 88, FP8 shared beside NVFP4 experts): V4-Pro 33 / 41 us at 4 / 8 tokens
    against 45 / 75 per token, level at 2; V4-Flash 24 against 25 us at 8 tokens, 1-2 us more at 2 and 4."""
    tokens = R - pairs if rows == ROWS_PAIR else R
    return (shared is not None and rows in (ROWS_PAIR, ROWS_TOKEN)
            and SHARED_COLS_TOKENS <= tokens <= SHARED_COLS_MAX)


def pdl_enabled(cfg: GemvConfig, device: torch.device) -> bool:
    """Programmatic dependent launch: asked for, on a CUDA GPU with `griddepcontrol` (sm_90+), not interpreted."""
    return cfg.pdl and has_pdl(device)


def plan_splits(rows: int, R: int, routed_rows: int, topk: int, num_n: int, n_steps: int, n_steps_s: int,
                slots: int, forced: int = 0, cols: bool = False,
                blocks: int = 0) -> tuple[int, int, int, int, int, int]:
    """(units, partials per output tile, split, chunk, split_s, chunk_s) of one launch: R row blocks (of which
    `routed_rows` stream the routed weight, the rest the shared expert's with n_steps_s sub-steps; 0 = none),
    ROWS_TOKEN slots of `topk` routed experts plus the shared one. Chunks are whole step pairs. `cols`
    (`shared_cols`): the shared expert has one row block per COLS_TOKENS tokens. `blocks` (> 0: over expert
    blocks): the routed row blocks are the rows of the expert-block table.

    The routed split is `forced` or `choose_split`'s, and the shared expert gets the same. A sub-step is 64
    bytes of a row in every format, so an FP8 shared expert beside FP4 experts then has twice their sub-steps
    per unit and sets the launch's tail: plans whose shared units are as long as the routed ones replace it
    where one fits in one wave and costs less (cost = waves x (longest unit + UNIT_OVERHEAD_STEPS)). V4-Flash
    MoE at 1 token: 49.2 -> 45.5 us; with more waves the extra units and partials measured slower
    (bench/RESULTS.md, round six), so those are not tried. With `cols` the shared units are few (one row
    block), so an FP8 shared expert always gets twice the routed split."""
    shared = n_steps_s > 0
    # row blocks (ROWS_TOKEN: (token, slot) blocks) of the routed weights and of the shared expert per N tile
    routed_blocks = blocks or (R * topk if rows == ROWS_TOKEN else routed_rows)
    shared_tokens = (R if rows == ROWS_TOKEN else R - routed_rows) if shared else 0
    # one row block per token, or with `cols` one per COLS_TOKENS tokens
    shared_blocks = triton.cdiv(shared_tokens, COLS_TOKENS) if cols else shared_tokens

    def plan(split, split_s):
        chunk = triton.cdiv(n_steps, split)
        chunk += chunk % 2   # even: FP8 splits hold whole 128-K scale blocks, FP4 splits whole step pairs
        split = triton.cdiv(n_steps, chunk)
        chunk_s = triton.cdiv(max(n_steps_s, 1), split_s)
        chunk_s += chunk_s % 2
        split_s = triton.cdiv(max(n_steps_s, 1), chunk_s)
        if rows == ROWS_TOKEN:
            parts = split * topk + (split_s if shared else 0)
        else:
            parts = max(split, split_s) if shared else split
        units = num_n * (routed_blocks * split + shared_blocks * split_s)
        longest = max(chunk, chunk_s) if shared else chunk
        cost = triton.cdiv(units, slots) * (longest + UNIT_OVERHEAD_STEPS)
        return (units, parts, split, chunk, split_s, chunk_s), cost

    split = forced or choose_split((routed_blocks + shared_blocks) * num_n, n_steps, slots)
    ratio = n_steps_s // n_steps
    if cols and ratio > 1 and not forced:   # few shared units: always as long as the routed ones
        return plan(split, split * ratio)[0]
    best, best_cost = plan(split, split)
    if ratio > 1 and not forced:
        for s in range(1, max(1, n_steps // 2) + 1):
            balanced, cost = plan(s, s * ratio)
            if balanced[0] > slots:
                break   # units only grow with the split
            if cost < best_cost:
                best, best_cost = balanced, cost
    return best


def resident_ctas(kernel, num_warps: int, device: torch.device) -> int:
    """CTAs of a compiled kernel that fit on one SM at once (registers, shared memory, threads)."""
    props = torch.cuda.get_device_properties(device)
    kernel._init_handles()
    regs = max(1, -(-kernel.n_regs // 8) * 8) * 32 * num_warps
    smem = kernel.metadata.shared + 1024
    by_smem = getattr(props, "shared_memory_per_multiprocessor", 233472) // smem
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // regs
    return max(1, min(by_regs, by_smem, props.max_threads_per_multi_processor // (32 * num_warps), 32))


@dataclass(frozen=True)
class _Prepared:
    """One launch's `_gemv_kernel` arguments and constexprs, its units, the programs it runs and the CTAs that fit
    on the GPU at once (its split plan's slots)."""
    args: tuple
    consts: dict
    units: int
    programs: int
    slots: int


def launch(x: torch.Tensor, w: QWeight, y: torch.Tensor, cfg: GemvConfig, *, M: int, rows: int = ROWS_DENSE,
           R: int = 1, gated: bool = False, topk: int = 1, x_div: int = 1, ids=None, rw=None, limit: float = 0.0,
           group_r: int = 0, x_gstride: int = 0, shared: QWeight | None = None, pairs: int = 0, scratch=None,
           x_ready: bool = False, blocks: torch.Tensor | None = None):
    """One launch over a (possibly stacked) QWeight. x rows: M (dense), pairs (ROWS_PAIR: R = M = pairs), or
    pairs of R tokens (ROWS_TOKEN: M = R = tokens, x has tokens * topk rows). y: [M, N] (row stride any).

    `shared` (ROWS_PAIR / ROWS_TOKEN): the MoE's shared expert, any supported format, same N and K, streamed in
    the same launch. ROWS_PAIR: R = M = pairs + tokens, rows from `pairs` on are the shared expert's (x row
    r - pairs); ROWS_TOKEN: x has pairs + R rows, each token's extra slot reads row pairs + token. From
    SHARED_COLS_TOKENS tokens each of its units covers COLS_TOKENS tokens (`shared_cols`); the same rows are written.

    `x_ready` (ROWS_PAIR with `shared`): the caller promises that x was written before the previous kernel on
    the stream started and that that kernel writes neither x nor the weights (it is `moe.route`'s); the shared
    expert's units then run first and, with `cfg.pdl`, before that kernel has finished (`X_READY`).

    `blocks` (ROWS_PAIR / ROWS_TOKEN; the shared expert, if any, as token columns): the expert-block table of the
    pairs (`moe.expert_blocks`, in place of ids): each distinct expert is streamed once for all its pairs
    (`BLOCKS`)."""
    p = _prepare(x, w, y, cfg, M=M, rows=rows, R=R, gated=gated, topk=topk, x_div=x_div, ids=ids, rw=rw, limit=limit,
                 group_r=group_r, x_gstride=x_gstride, shared=shared, pairs=pairs, scratch=scratch, x_ready=x_ready,
                 blocks=blocks)
    _gemv_kernel[(p.programs,)](*p.args, **p.consts)


def _prepare(x, w: QWeight, y, cfg: GemvConfig, *, M: int, rows: int, R: int, gated: bool, topk: int, x_div: int, ids,
             rw, limit: float, group_r: int, x_gstride: int, shared: QWeight | None, pairs: int, scratch,
             x_ready: bool, cnt: torch.Tensor | None = None, blocks: torch.Tensor | None = None) -> _Prepared:
    """`launch`'s work but the launch itself; `cnt`: the split-K semaphores to use (default: the scratch's)."""
    N, K = w.out_features, w.in_features
    lead = w.leading
    wt = w.weight.view(torch.uint8)
    scale, scale_f32, s2 = scale_views(w)
    swe, swg = lead_strides(wt, lead, gated)
    sse, ssg = lead_strides(scale, lead, gated)
    s2e, s2g = lead_strides(s2, lead, gated)
    n_steps = steps_of(w.fmt, K if group_r == 0 else x_gstride)
    num_n = triton.cdiv(N, cfg.BN)
    interp = interpreting()
    if shared is not None:
        if rows == ROWS_DENSE or (shared.out_features, shared.in_features) != (N, K) or \
                shared.leading != lead[1:] or not supported(shared, x, 1):
            raise ValueError(f"shared expert {shared.fmt} {tuple(shared.leading)} [{shared.out_features}, "
                             f"{shared.in_features}] does not fit this launch ({w.fmt} {tuple(lead)} [{N}, {K}])")
        swt = shared.weight.view(torch.uint8)
        sscale, sscale_f32, ss2 = scale_views(shared)
        shared_strides = (lead_strides(swt, shared.leading, gated)[1], swt.stride(-2),
                          lead_strides(sscale, shared.leading, gated)[1], sscale.stride(-2),
                          lead_strides(ss2, shared.leading, gated)[1])
        n_steps_s = steps_of(shared.fmt, K)
    else:
        swt, sscale, sscale_f32, ss2, shared_strides, n_steps_s = wt, scale, scale_f32, s2, (0,) * 5, n_steps
    dot = tl.float32 if (interp or x.dtype == torch.float32) else tl.bfloat16
    asm = (not interp) and dot == tl.bfloat16 and (cfg.asm is None or cfg.asm)
    MP = mma_n(M if rows == ROWS_DENSE else 1)
    consts = dict(FMT=FMT_CODES[w.fmt], SCALE_F32=scale_f32, ROWS=rows, GATED=gated, BN=cfg.BN, MP=MP, DOT=dot,
                  ASM=asm, W=cfg.num_warps,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages, SHARED=shared is not None,
                  FMT_S=FMT_CODES[shared.fmt if shared is not None else w.fmt], SCALE_F32_S=sscale_f32,
                  PF=cfg.prefetch, TILED=w.tiled, TILED_S=shared is not None and shared.tiled,
                  PDL=pdl_enabled(cfg, x.device), PDL_L2=cfg.pdl_l2, GCOL=group_cols_on(cfg, rows, M, w, shared),
                  X_READY=x_ready and shared is not None and rows == ROWS_PAIR,
                  COLS=shared_cols(rows, R, pairs, shared))
    n_blocks = 0
    if blocks is not None:
        P = pairs
        if rows not in (ROWS_PAIR, ROWS_TOKEN) or (shared is not None and not consts["COLS"]) or \
                blocks.dim() != 2 or not 0 < blocks.shape[0] <= P or blocks.shape[1] != 2 + mma_n(1) or \
                blocks.dtype != torch.int32:
            raise ValueError(f"expert blocks {tuple(blocks.shape)} {blocks.dtype} do not fit this launch (rows {rows}, "
                             f"{P} pairs, shared expert as token columns: {consts['COLS']}); expected int32 "
                             f"[1..{P}, {2 + mma_n(1)}]")
        consts["BLOCKS"] = True
        ids, n_blocks = blocks, blocks.shape[0]
    if consts["PDL"]:
        consts["launch_pdl"] = True
    maxnreg = (128 if (MP == 8 or not gated) else 0) if cfg.maxnreg < 0 else cfg.maxnreg
    if maxnreg and not interp:
        consts["maxnreg"] = maxnreg
    if cnt is None:
        cnt = scratch.counters(x.device, R * num_n) if scratch is not None else \
            torch.zeros(R * num_n, dtype=torch.int32, device=x.device)

    def kernel_args(split, chunk, split_s, chunk_s, ws):
        return (x, wt, scale, s2 if s2 is not None else wt, y, ids if ids is not None else wt,
                rw if rw is not None else wt, ws, cnt,
                M, N, R, split, topk, chunk, n_steps, float(limit), x_div, group_r, x_gstride,
                x.stride(0), swe, swg, wt.stride(-2), sse, ssg, scale.stride(-2), s2e, s2g, y.stride(0),
                swt, sscale, ss2 if ss2 is not None else swt, max(1, pairs), max(1, n_blocks), chunk_s, split_s,
                n_steps_s,
                *shared_strides)

    if interp:
        per_sm = 1
    else:
        key = (x.device, tuple(sorted((k, str(v)) for k, v in consts.items())))
        per_sm = scratch.resident(key, lambda: resident_ctas(
            _gemv_kernel.warmup(*kernel_args(1, n_steps, 1, n_steps_s, cnt.view(torch.float32)), grid=(1,),
                                **consts),
            cfg.num_warps, x.device)) if scratch is not None else 4
    if cfg.max_ctas_per_sm:
        per_sm = min(per_sm, cfg.max_ctas_per_sm)
    slots = num_sms(x.device) * per_sm
    routed_rows = pairs if rows == ROWS_PAIR and shared is not None else R
    units, parts, split, chunk, split_s, chunk_s = plan_splits(
        rows, R, routed_rows, topk, num_n, n_steps, n_steps_s if shared is not None else 0, slots, cfg.split,
        consts["COLS"], n_blocks)
    ws = cnt.view(torch.float32)   # unused without splits (the kernel still needs typed pointers)
    if parts > 1:
        ws = torch.empty(parts * (2 if gated else 1) * M * N, dtype=torch.float32, device=x.device)
    nprog = units if (interp or not cfg.persistent) else max(1, min(units, slots))
    return _Prepared(kernel_args(split, chunk, split_s, chunk_s, ws), consts, units, nprog, slots)


# FP4 weights of at least this many bytes (scales included) stream with 3 pipeline stages: with programmatic
# dependent launch, V4-Pro wq_b / wo_b NVFP4 (56 / 66 MB) at up to 8 rows 21.4 -> 20.4 and 27.5 -> 26.6 us; V4-Flash
# wq_b / wo_b (19 MB) 2-3 % slower, FP8 level (bench/RESULTS.md, runs 51-52). With 9-16 rows (MMA N = 16) each x
# sub-tile is as many bytes as the FP4 weight tile it multiplies, and units of 128 rows (`LARGE_FP4_16_ROWS`: 2 warps,
# 190 registers uncapped) halve that traffic; with 3 stages V4-Pro wq_b / wo_b NVFP4 26.2 -> 23.4 and 36.3 -> 33.3
# us, MXFP4 25.4 -> 22.6 and 35.3 -> 32.1 at 16 rows, the same at 9 and 12 (runs 100-101); with 2 stages, or on
# 19 MB weights, 128 rows measured level or slower, and 64-row units with 3 stages take two waves (run 70)
THREE_STAGE_FP4_BYTES = 40e6
LARGE_FP4_8_ROWS = GemvConfig(num_stages=3)
LARGE_FP4_16_ROWS = GemvConfig(BN=128, maxnreg=0, num_stages=3)


def default_config(w: QWeight, rows: int = 1) -> GemvConfig:
    """The dense GEMV's configuration for a weight and `rows` rows of x: GemvConfig() but, for large FP4 weights,
    3 stages (MMA N 8: up to 8 rows) and, from 9 rows (N 16), units of 128 rows."""
    if w.fmt in FP4_FORMATS and w.nbytes() >= THREE_STAGE_FP4_BYTES:
        return LARGE_FP4_8_ROWS if mma_n(rows) == 8 else LARGE_FP4_16_ROWS
    return GemvConfig()


def linear(x: torch.Tensor, w: QWeight, cfg: GemvConfig | None = None, out: torch.Tensor | None = None,
           scratch=None) -> torch.Tensor:
    """y = x @ W^T for x [M <= 64, K] (the caller checked `supported`); `cfg` None: `default_config(w, M)`."""
    M, N = x.shape[0], w.out_features
    cfg = cfg or default_config(w, M)
    y = out if out is not None else torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M:
        launch(x, w, y, cfg, M=M, scratch=scratch)
    return y
