"""Decode GEMV (at most 16 activation rows per weight): y = x @ W^T computed as y^T = W x^T (swap-AB).

The weight tile is the A operand of the MMA (mma.sync, 2 warps by default), streamed from global memory into
registers - directly (LDG.128; FP8 by default, prefetched a loop iteration ahead, see `_unit_acc`) or, with
`num_stages=2`, through cp.async and one LDS.128 per 16 bytes already in the operand layout (FP4 by default);
x (small) is the B operand. Decoded weights never go through shared memory and are never shuffled between
threads.

Weights row-major or tile-major (`QWeight.tiled`, `formats.tiling`: on CUDA the loader stores them tiled, so
that one sub-step of a 64-row tile is one contiguous 4 KB run instead of 64 runs of 64 bytes;
`tiles.byte_offsets`).

Layout trick (no repack within a row's bytes). A K step ("sub-step") covers 64 bytes of every weight row
(128 FP4 or 64 FP8 elements). Triton loads a [BN, 64] byte tile with 4 threads per row (16 bytes each) and
8 rows per warp; each thread decodes its 16 bytes into elements in natural order (FP4: the low then the high
nibble of every byte, so each bf16x2 register holds two elements that are adjacent in x as well). The MMA A
operand wants rows lane/4 + 8h + 16w in a thread and, per 16-wide k block, in thread c = lane % 4 either
Triton's relabelled k = 4c .. 4c+3 (kWidth 4, Triton <= 3.7) or the instruction's own 2c, 2c+1, 2c+8, 2c+9
(kWidth 2, Triton >= 3.8; `MMA_K_WIDTH`). A dot does not care in which order K is summed, and output rows
may be stored anywhere, so `_to_mma` re-indexes the decoded tile (rows and K) so that each thread already
holds exactly its operand fragment - the reshape/permute is register renaming only (checked in SASS:
bench/sass.py) - and x is loaded in the same K order (`_x_kmajor`). The weights are loaded as 32-bit words
(4 bytes of one row) and each PTX decoder instance takes one word (`pack=1`): with `pack > 1` Triton groups
consecutive *registers*, which in the operand layout mix rows r and r + 32 (seen on the H200: garbage
results, 2026-11-30).

Decode cost per 32-bit word (SASS, sm_90): FP4 8 values = 1 shift + 4 x (prmt, shift, and, bf16x2 mul);
FP8 4 values = 2 x (prmt, shift, and, bf16x2 mul). FP4 block-scale multipliers are formed once per scale
group. NVFP4: e2m1 as a bf16 subnormal (value * 2^-126) times bf16(scale * 2^117); MXFP4: times
bf16(2^(e - 17)) (exact for block scales 2^-116 .. 2^17, as round one); FP8: e4m3 as bf16 value * 2^-120 times
2^120 (an e4m3 NaN byte decodes to a finite value), its 128x128 block scale applied to the fp32 partial of
each 128-K block. Every value reaching the MMA is exact; the FP4 prescale is undone once in the epilogue.

Group columns (`GemvConfig.group_cols`; by default in the MoE launches, whose units each read one x row): with FP4
weights, column m of the MMA's x operand holds only the 16 x values of the sub-step's scale group m (times 2^64),
so the 8 columns of D = decoded tile @ x are the 8 groups' partial sums; the weights enter unscaled (E2M1 *
2^-126: `prmt`, shift and AND per pair, no multiply: `FP4_PTX_RAW`) and one FFMA per group applies the block
scales to D (`_group_scales`); the unit's partial is the column sum. All products stay exact and in fp32's normal
range for |x| < 2^64 (the 2^64 is exact in bf16). SASS per NVFP4 iteration: 702 instead of 773 instructions
(Triton 3.6); the scale words are loaded a loop iteration ahead into registers (they feed no dot operand, so the
pipeliner would not stage them). Measured (bench/RESULTS.md runs 55-62): MoE pair up to 5 % faster, dense V4-Pro
wq_b / wo_b at M = 1 7-13 % slower, hence off for dense calls. There the scale words are not back in time (ncu: 17
% of stall samples on them); staging them with the weights, loading them through inline PTX or prefetching them
into L2 measured slower still.

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
Gated FP4 units stream gate and up in one K loop, a sub-step of each per iteration (`_unit_acc`, PAIRED).

The MoE pair (gate/up ROWS_PAIR, then down ROWS_TOKEN) can run as one launch (`launch_pair`,
`_moe_pair_kernel`): every unit is `_gemv_unit`, as in its own launch; programs draw units in order from a
ticket, and a down unit waits for the gate/up tiles of its h row (counted per row, release/acquire), so down's
first wave overlaps the tail of gate/up.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..formats import FP4_FORMATS, QWeight
from .host import has_pdl, interpreting, lead_strides, num_sms, scale_views
from .tiles import (FMT_CODES, TILE_BYTES_C, TILE_ROWS_C, _e2m1_values, byte_offsets, epilogue_factor,
                    scale_chunk_c)

ROWS_DENSE, ROWS_PAIR, ROWS_TOKEN = 0, 1, 2
# k elements per thread and register group in the mma.sync bf16 operand layout Triton picks: 4 up to 3.7, the
# instruction's own 2 from 3.8 (SASS of Triton 3.6, 3.7.1, 3.8.0, 3.9.0; `_k_order` follows it)
MMA_K_WIDTH = tl.constexpr(4 if tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 8) else 2)
# int32 counters of the fused MoE pair (`_moe_pair_kernel`) one 128-byte line apart: each flag on its own L2 line
SYNC_LINE = tl.constexpr(32)
MAX_ROWS = 16           # x rows per unit (the MMA N dimension); at 32 the x sub-tiles in registers spill
                        # (255 registers, sm_90, Triton 3.6), so 17..64 rows run gemm's fused tiles


# ------------------------------------------------------------------------------------------ decoding

@triton.jit
def _bf16_pair(p):
    """A uint32 holding a bf16x2 -> its (low, high) halves as bf16 tensors (the compiler re-packs them into one
    register for the MMA operand: no instruction)."""
    lo = (p & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    hi = (p >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return lo, hi


@triton.jit
def _join4(a, b, c, d, BN: tl.constexpr):
    """Four [BN, 16] tensors (elements 0..3 of every group of 4) -> [BN, 64] in natural order."""
    j = tl.join(tl.join(a, b), tl.join(c, d))                 # [BN, 16, 2 (a|c), 2 (first|second)]
    return tl.permute(j, (0, 1, 3, 2)).reshape(BN, 64)


@triton.jit
def _join8(e0, e1, e2, e3, e4, e5, e6, e7, BN: tl.constexpr):
    """Eight [BN, 16] tensors (elements 0..7 of every group of 8) -> [BN, 128] in natural order."""
    q = tl.join(tl.join(tl.join(e0, e1), tl.join(e2, e3)), tl.join(tl.join(e4, e5), tl.join(e6, e7)))
    return tl.permute(q, (0, 1, 4, 3, 2)).reshape(BN, 128)      # [BN, 16, e, pair, half] -> natural


def _fp4_ptx(scaled: bool) -> str:
    """The PTX of `_fp4_decode` (operands: $0..$3 out, $4 the word, $5 the multiplier when `scaled`): per byte i,
    `prmt` (selector 0xC480 + 0x1111 i), << 2, the sign + magnitude mask, then the multiply or not."""
    lines = ["{", ".reg .b32 u, t;", "shl.b32 u, $4, 4;"]
    for i in range(4):
        lines += [f"prmt.b32 t, u, $4, 0x{0xC480 + 0x1111 * i:04X};", "shl.b32 t, t, 2;"]
        lines += ["and.b32 t, t, 0x81C081C0;", f"mul.rn.bf16x2 ${i}, t, $5;"] if scaled else \
            [f"and.b32 ${i}, t, 0x81C081C0;"]
    return "\n".join(lines + ["}"])


FP4_PTX = tl.constexpr(_fp4_ptx(True))
FP4_PTX_RAW = tl.constexpr(_fp4_ptx(False))   # no multiply: the group columns (module docstring)


@triton.jit
def _fp4_decode(b, mult, BN: tl.constexpr, ASM: tl.constexpr, SCALED: tl.constexpr = True):
    """Packed FP4 weights [BN, 16] uint32 (four adjacent bytes of one row each) and their block multipliers ->
    [BN, 128] in natural order (bf16 with ASM, else fp32): element 2j / 2j + 1 is the low / high nibble of
    byte j times its multiplier. Not SCALED (the group columns, module docstring): E2M1 value * 2^-126 (with ASM
    no multiply at all, a bf16 subnormal for +-0.5; else times `mult`, which the caller sets to 2^-126).

    ASM, one 32-bit word per instance, one bf16x2 per byte i (elements 2i, 2i + 1, adjacent in x too, so x
    fragments are plain words): `prmt` builds [S(w_i) w_i S(u_i) u_i] from the word w and u = w << 4 (mode 8
    replicates a byte's sign bit), so after << 2 and the mask the low nibble sits in the low half and the high
    nibble in the high half as bf16 subnormals (sign at bit 15 / 31, magnitude bits at 8..6 / 24..22). One
    mul.bf16x2 applies the multiplier (a word never straddles a scale group). Element positions come from
    memory (a uint32 is four bytes of one row), never from Triton's register order, on which `pack > 1`
    would depend (`FP4_PTX`, `FP4_PTX_RAW`).
    """
    if ASM:
        if SCALED:
            p0, p1, p2, p3 = tl.inline_asm_elementwise(FP4_PTX, "=r,=r,=r,=r,r,r", [b, mult],
                                                       dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32),
                                                       is_pure=True, pack=1)
        else:
            p0, p1, p2, p3 = tl.inline_asm_elementwise(FP4_PTX_RAW, "=r,=r,=r,=r,r", [b],
                                                       dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32),
                                                       is_pure=True, pack=1)
        e0, e1 = _bf16_pair(p0)
        e2, e3 = _bf16_pair(p1)
        e4, e5 = _bf16_pair(p2)
        e6, e7 = _bf16_pair(p3)
    else:
        e0 = _e2m1_values(b & 15) * mult
        e1 = _e2m1_values((b >> 4) & 15) * mult
        e2 = _e2m1_values((b >> 8) & 15) * mult
        e3 = _e2m1_values((b >> 12) & 15) * mult
        e4 = _e2m1_values((b >> 16) & 15) * mult
        e5 = _e2m1_values((b >> 20) & 15) * mult
        e6 = _e2m1_values((b >> 24) & 15) * mult
        e7 = _e2m1_values(b >> 28) * mult
    return _join8(e0, e1, e2, e3, e4, e5, e6, e7, BN)


@triton.jit
def _fp8_decode(b, BN: tl.constexpr, ASM: tl.constexpr):
    """E4M3 weights [BN, 16] uint32 (four adjacent bytes each) -> exact values [BN, 64] (bf16 with ASM, else
    fp32). ASM: [S(b1) b1 S(b0) b0] << 4, masked to sign + 7 bits, is e4m3 * 2^-120 as bf16 (subnormals
    included); one mul.bf16x2 by 2^120 restores it."""
    if ASM:
        p01, p23 = tl.inline_asm_elementwise(
            """
            {
            .reg .b32 t, c;
            mov.b32 c, 0x7B807B80;
            prmt.b32 t, $2, 0, 0x9180;
            shl.b32 t, t, 4;
            and.b32 t, t, 0x87F087F0;
            mul.rn.bf16x2 $0, t, c;
            prmt.b32 t, $2, 0, 0xB3A2;
            shl.b32 t, t, 4;
            and.b32 t, t, 0x87F087F0;
            mul.rn.bf16x2 $1, t, c;
            }
            """,
            "=r,=r,r",
            [b],
            dtype=(tl.uint32, tl.uint32),
            is_pure=True,
            pack=1,
        )
        w0, w1 = _bf16_pair(p01)
        w2, w3 = _bf16_pair(p23)
    else:
        w0 = (b & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        w1 = ((b >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        w2 = ((b >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        w3 = (b >> 24).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return _join4(w0, w1, w2, w3, BN)


@triton.jit
def _fp4_multipliers(s, FMT: tl.constexpr, ASM: tl.constexpr):
    """Stored block-scale bytes (any shape) -> the multiplier `_fp4_decode` applies: with ASM (MXFP4 only; NVFP4
    builds its own in `_group_multipliers`) a uint32 holding the bf16 multiplier in both halves, else fp32
    (NVFP4: e4m3 * 2^-9; MXFP4: 2^(e - 143))."""
    if ASM:
        tl.static_assert(FMT == 2, "the asm NVFP4 multiplier is _group_multipliers'")
        m = tl.inline_asm_elementwise(
            "{ .reg .b32 a, c; mov.b32 a, 0x00800080; mov.b32 c, 0x37003700; mad.lo.u32 $0, $1, a, c; }", "=r,r",
            [s.to(tl.uint32)], dtype=tl.uint32, is_pure=True, pack=1)
    else:
        if FMT == 3:
            m = s.to(tl.float8e4nv, bitcast=True).to(tl.float32) * (2.0 ** -9)
        else:
            e = s.to(tl.int32)
            m = tl.where(e > 16, (e - 16) << 23, 0).to(tl.float32, bitcast=True)
    return m


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
    per NVFP4 loop iteration (bench/sass.py)."""
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
def _group_multipliers(s, FMT: tl.constexpr, BN: tl.constexpr, ASM: tl.constexpr):
    """Scale words of a sub-step -> the multiplier of every weight word [BN, 16], formed once per scale group
    (NVFP4: 8 groups of 16 elements, 2 words each; MXFP4: 4 groups of 32, 4 words each) and broadcast.

    NVFP4 with ASM, exact for every scale byte (subnormals and zero included): `prmt` mode 8 builds
    [S(b) b S(b) b] from the group's byte b; << 4 and the mask leave e4m3 * 2^-120 as bf16 in both halves (the
    FP8 decoder's trick), and two exact bf16x2 products by 2^120 and 2^117 give e4m3 * 2^117 (5 instructions
    per group; converting through fp32 cost about 11 per pair of words). An e4m3 NaN byte gives a finite
    multiplier, as in the FP8 decoder."""
    G: tl.constexpr = 8 if FMT == 3 else 4
    PER: tl.constexpr = 16 // G
    if FMT == 3:
        byte = tl.arange(0, 8) % 4                       # group g's byte within scale word g // 4
        sw = tl.broadcast_to(s[:, :, None], (BN, 2, 4)).reshape(BN, 8)
        if ASM:
            sel = ((byte | 8) * 0x1010 + byte * 0x0101).to(tl.uint32)
            m = tl.inline_asm_elementwise(
                """
                {
                .reg .b32 t, c, d;
                mov.b32 c, 0x7B807B80;
                mov.b32 d, 0x7A007A00;
                prmt.b32 t, $1, 0, $2;
                shl.b32 t, t, 4;
                and.b32 t, t, 0x87F087F0;
                mul.rn.bf16x2 t, t, c;
                mul.rn.bf16x2 $0, t, d;
                }
                """,
                "=r,r,r", [sw, tl.broadcast_to(sel[None, :], (BN, 8))], dtype=tl.uint32, is_pure=True, pack=1)
        else:
            m = _fp4_multipliers(((sw >> (byte * 8)[None, :]) & 0xFF).to(tl.uint8), FMT, ASM)
    else:
        sw = tl.broadcast_to(s[:, :, None], (BN, 2, 2)).reshape(BN, 4)
        m = _fp4_multipliers(((sw >> ((tl.arange(0, 4) % 2) * 8)[None, :]) & 0xFF).to(tl.uint8), FMT, ASM)
    return tl.broadcast_to(m[:, :, None], (BN, G, PER)).reshape(BN, 16)


@triton.jit
def _group_scales(s, FMT: tl.constexpr, BN: tl.constexpr, W: tl.constexpr):
    """Scale words of a sub-step [BN, 2] -> fp32 [BN, 8] in `_to_mma` row order: column g is the factor from
    the group columns' partials of K columns 16g .. 16g + 15 (x * 2^64 times E2M1 * 2^-126) to the tile prescale
    that `tiles.epilogue_factor` undoes, less the 2^53 that `_unit_acc` applies to the column sum. NVFP4 (a
    group per column): the e4m3 scale; MXFP4 (a group per two columns): 2^(e - 134), a normal fp32 for exponent
    bytes 8 .. 254 (block scales 2^-119 .. 2^127)."""
    # built like `_group_multipliers`: the scale word of every weight word [BN, 16] (thread c of a row holds
    # words 4c .. 4c + 3, groups 2c and 2c + 1: the D columns it holds), then one value per group
    sw = tl.broadcast_to(s[:, :, None], (BN, 2, 8)).reshape(BN, 16)
    if FMT == 3:
        byte = ((sw >> (((tl.arange(0, 16) // 2) % 4) * 8)[None, :]) & 0xFF).to(tl.uint8)
        per_word = byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        e = ((sw >> (((tl.arange(0, 16) // 4) % 2) * 8)[None, :]) & 0xFF).to(tl.int32)
        per_word = ((e - 7) << 23).to(tl.float32, bitcast=True)
    f, _ = tl.split(per_word.reshape(BN, 8, 2))
    return tl.permute(f.reshape(BN // (16 * W), 2, W, 8, 8), (0, 2, 1, 3, 4)).reshape(BN, 8)


@triton.jit
def _mma_sub(acc, b, s, xs, FMT: tl.constexpr, BN: tl.constexpr, W: tl.constexpr, DOT: tl.constexpr,
             ASM: tl.constexpr, GCOL: tl.constexpr):
    """acc [BN, MP] += decoded sub-step tile @ xs (the sub-step's x, from `_x_subtile`)."""
    if GCOL:
        d = tl.dot(_to_mma(_fp4_decode(b, 2.0 ** -126, BN, ASM, False).to(DOT), BN, W, 128), xs)
        acc += d * _group_scales(s, FMT, BN, W)
    elif FMT >= 2:
        w = _fp4_decode(b, _group_multipliers(s, FMT, BN, ASM), BN, ASM)
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
                       DOT, ASM, GC)
        if PREFETCH:
            b0, c0 = _load_sub(wbase, sbase, wrow, srow, tl.minimum(step + STEP, s1 - 1), wk, sk, FMT)
        if PAIRED:
            acc2 = _mma_sub(acc2, b1, c1, x1, FMT, BN, W, DOT, ASM, GC)
        else:
            blk = _mma_sub(blk, b1, c1, x1, FMT, BN, W, DOT, ASM, GC)
        if PREFETCH:
            b1, c1 = _load_sub(wbase1, sbase1, wrow, srow, tl.minimum(step1 + STEP, s1 - 1), wk, sk, FMT)
        if FMT >= 2:
            acc = blk
        else:
            acc += blk * _fp8_block_scale(sbase, rows_mma, nmask_mma, step // 2, stride_sn, SCALE_F32)[:, None]
    if GC:   # the group columns' sum, and the 2^53 that `_group_scales` leaves out
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
def _launch_layout(N, R, SPLIT, TOPK, P, SPLIT_S, ROWS: tl.constexpr, BN: tl.constexpr, SHARED: tl.constexpr,
                   X_READY: tl.constexpr):
    """(units, splits per output tile, N tiles, shared units, first shared unit, first routed unit) of one launch:
    the unit numbering `_gemv_unit` decodes."""
    num_n = tl.cdiv(N, BN)
    splits = SPLIT * TOPK + (SPLIT_S if SHARED else 0) if ROWS == 2 else SPLIT
    total = R * num_n * splits
    shared_units = total * 0
    first_shared = total * 0
    first_routed = total * 0
    if ROWS == 1 and SHARED:   # SPLIT units per routed tile, SPLIT_S per shared tile
        shared_units = (R - P) * num_n * SPLIT_S
        total = P * num_n * SPLIT + shared_units
        first_shared = 0 if X_READY else total - shared_units
        first_routed = shared_units if X_READY else 0
    return total, splits, num_n, shared_units, first_shared, first_routed


@triton.jit
def _gemv_unit(
    u, splits, num_n, shared_units, first_shared, first_routed,
    x_ptr, w_ptr, s_ptr, s2_ptr, y_ptr, ids_ptr, rw_ptr, ws_ptr, cnt_ptr,
    M, N, R, SPLIT, TOPK, CHUNK, n_steps, limit, X_DIV, GROUP_R, X_GSTRIDE,
    stride_xm, stride_we, stride_wg, stride_wn, stride_se, stride_sg, stride_sn, stride_s2e, stride_s2g,
    stride_ym,
    sw_ptr, ss_ptr, ss2_ptr, P, CHUNK_S, SPLIT_S, n_steps_s, stride_swg, stride_swn, stride_ssg, stride_ssn,
    stride_ss2g,
    ready_ptr, ready_target, ticket_ptr,
    FMT: tl.constexpr, SCALE_F32: tl.constexpr, ROWS: tl.constexpr, GATED: tl.constexpr, BN: tl.constexpr,
    MP: tl.constexpr, DOT: tl.constexpr, ASM: tl.constexpr, W: tl.constexpr,
    SHARED: tl.constexpr, FMT_S: tl.constexpr, SCALE_F32_S: tl.constexpr, PF: tl.constexpr, TILED: tl.constexpr,
    TILED_S: tl.constexpr, PDL: tl.constexpr, GCOL: tl.constexpr, X_READY: tl.constexpr,
    SIGNAL: tl.constexpr, AWAIT: tl.constexpr, AWAIT_L2: tl.constexpr, TICKET: tl.constexpr,
):
    """Unit u of a launch (`_gemv_kernel`'s docstring; `_launch_layout` gives its numbering).

    The fused MoE pair (`_moe_pair_kernel`): SIGNAL (gate/up) counts every output tile written into
    ready[h row]; AWAIT (down) waits, before it reads its h row, until that row holds ready_target tiles,
    L2-prefetching up to AWAIT_L2 sub-steps of its tile-major weights first if it has to wait. TICKET: draws
    the program's next ticket (returned) once its weights are read, so that the atomic's round trip overlaps
    the unit's stores; else returns 0."""
    WAIT_PER_UNIT: tl.constexpr = PDL and X_READY and ROWS == 1 and SHARED
    offs_r = tl.arange(0, MP)
    offs_b = tl.arange(0, BN)
    nsplit = splits + u * 0   # partials of this unit's output tile (a scalar of the unit's type)
    j = u % splits
    tile = u // splits
    if ROWS == 1 and SHARED:
        if u >= first_shared and u < first_shared + shared_units:
            nsplit = SPLIT_S + u * 0
            j = (u - first_shared) % SPLIT_S
            tile = P * num_n + (u - first_shared) // SPLIT_S
        else:
            j = (u - first_routed) % SPLIT
            tile = (u - first_routed) // SPLIT
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
            e = tl.load(ids_ptr + tl.minimum(r, P - 1), mask=r < P, other=0).to(tl.int32)
        else:
            e = tl.load(ids_ptr + r).to(tl.int32)
        rw = 1.0
    else:
        rmask = offs_r == 0
        slot = tl.minimum(j // SPLIT, TOPK)
        if SHARED:
            on_shared = slot == TOPK
            ks = tl.where(on_shared, j - TOPK * SPLIT, ks)
        pair = r * TOPK + tl.minimum(slot, TOPK - 1)
        yrow = r + offs_r * 0
        xrow = tl.where(on_shared, P + r, pair) + offs_r * 0
        e = tl.load(ids_ptr + pair).to(tl.int32)
        rw = tl.where(on_shared, 1.0, tl.load(rw_ptr + pair).to(tl.float32))
    n0 = pid_n * BN
    rows = tl.minimum(n0 + offs_b, N - 1)   # rows past N re-read row N - 1; never stored
    rows_mma = _mma_rows(n0 + offs_b, BN, W)
    nmask_mma = rows_mma < N
    xcol = (n0 // tl.maximum(GROUP_R, 1)) * X_GSTRIDE   # block-diagonal (wo_a): this tile's x columns
    e64 = e.to(tl.int64)
    s0 = ks * CHUNK
    if AWAIT:   # ROWS_TOKEN: x row `pair` (routed slot) or P + r (the shared expert's), written by gate/up units
        if SHARED:
            if on_shared:
                s0 = ks * CHUNK_S
                _await_row(ready_ptr + (P + r) * SYNC_LINE, ready_target, sw_ptr, ss_ptr, n0, s0,
                           tl.minimum(CHUNK_S, n_steps_s - s0), stride_swn, stride_ssn, FMT_S, TILED_S, ASM, AWAIT_L2)
            else:
                _await_row(ready_ptr + pair * SYNC_LINE, ready_target, w_ptr + e64 * stride_we, s_ptr + e64 * stride_se, n0,
                           s0, tl.minimum(CHUNK, n_steps - s0), stride_wn, stride_sn, FMT, TILED, ASM, AWAIT_L2)
        else:
            _await_row(ready_ptr + pair * SYNC_LINE, ready_target, w_ptr + e64 * stride_we, s_ptr + e64 * stride_se, n0, s0,
                       tl.minimum(CHUNK, n_steps - s0), stride_wn, stride_sn, FMT, TILED, ASM, AWAIT_L2)
    if SHARED:
        if on_shared:
            s0 = ks * CHUNK_S
            acc, acc_u, f, f_u = _weight_unit(
                x_ptr, xrow, rmask, xcol, sw_ptr, ss_ptr, ss2_ptr, rows, rows_mma, nmask_mma, s0,
                tl.minimum(s0 + CHUNK_S, n_steps_s), rw, stride_xm, stride_swg, stride_swn, stride_ssg,
                stride_ssn, stride_ss2g, FMT_S, SCALE_F32_S, GATED, BN, MP, W, DOT, ASM, PF, TILED_S, GCOL)
        else:
            acc, acc_u, f, f_u = _weight_unit(
                x_ptr, xrow, rmask, xcol, w_ptr + e64 * stride_we, s_ptr + e64 * stride_se,
                s2_ptr + e64 * stride_s2e, rows, rows_mma, nmask_mma, s0, tl.minimum(s0 + CHUNK, n_steps), rw,
                stride_xm, stride_wg, stride_wn, stride_sg, stride_sn, stride_s2g, FMT, SCALE_F32, GATED, BN,
                MP, W, DOT, ASM, PF, TILED, GCOL)
    else:
        acc, acc_u, f, f_u = _weight_unit(
            x_ptr, xrow, rmask, xcol, w_ptr + e64 * stride_we, s_ptr + e64 * stride_se,
            s2_ptr + e64 * stride_s2e, rows, rows_mma, nmask_mma, s0, tl.minimum(s0 + CHUNK, n_steps), rw,
            stride_xm, stride_wg, stride_wn, stride_sg, stride_sn, stride_s2g, FMT, SCALE_F32, GATED, BN, MP,
            W, DOT, ASM, PF, TILED, GCOL)
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
        part = ws_ptr + j.to(tl.int64) * (2 * plane if GATED else plane)
        tl.store(part + offs_ws, acc * f, mask=omask)
        if GATED:
            tl.store(part + plane + offs_ws, acc_u * f_u, mask=omask)
        tl.debug_barrier()
        cnt = cnt_ptr + tile
        arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
        if arrived == nsplit - 1:
            acc = tl.zeros((BN, MP), dtype=tl.float32)
            if GATED:
                acc_u = tl.zeros((BN, MP), dtype=tl.float32)
            for i in range(0, nsplit):
                part = ws_ptr + i * (2 * plane if GATED else plane)
                acc += tl.load(part + offs_ws, mask=omask, other=0.0, cache_modifier=".cg")
                if GATED:
                    acc_u += tl.load(part + plane + offs_ws, mask=omask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")
            _epilogue(y_ptr, offs_y, omask, acc, acc_u if GATED else acc, 1.0, 1.0, limit, GATED)
            if SIGNAL:
                _signal_row(ready_ptr + r * SYNC_LINE)
    else:
        _epilogue(y_ptr, offs_y, omask, acc, acc_u if GATED else acc, f, f_u if GATED else f, limit, GATED)
        if SIGNAL:
            _signal_row(ready_ptr + r * SYNC_LINE)
    return ticket


@triton.jit(do_not_specialize=["M", "R", "SPLIT", "TOPK", "CHUNK", "P", "CHUNK_S", "SPLIT_S", "n_steps_s"])
def _gemv_kernel(
    x_ptr, w_ptr, s_ptr, s2_ptr, y_ptr, ids_ptr, rw_ptr, ws_ptr, cnt_ptr,
    M, N, R, SPLIT, TOPK, CHUNK, n_steps, limit, X_DIV, GROUP_R, X_GSTRIDE,
    stride_xm, stride_we, stride_wg, stride_wn, stride_se, stride_sg, stride_sn, stride_s2e, stride_s2g,
    stride_ym,
    sw_ptr, ss_ptr, ss2_ptr, P, CHUNK_S, SPLIT_S, n_steps_s, stride_swg, stride_swn, stride_ssg, stride_ssn,
    stride_ss2g,
    FMT: tl.constexpr, SCALE_F32: tl.constexpr, ROWS: tl.constexpr, GATED: tl.constexpr, BN: tl.constexpr,
    MP: tl.constexpr, DOT: tl.constexpr, ASM: tl.constexpr, W: tl.constexpr,
    SHARED: tl.constexpr, FMT_S: tl.constexpr, SCALE_F32_S: tl.constexpr, PF: tl.constexpr, TILED: tl.constexpr,
    TILED_S: tl.constexpr, PDL: tl.constexpr, PDL_L2: tl.constexpr, GCOL: tl.constexpr,
    X_READY: tl.constexpr = False,
):
    """Units u = (row block r, N tile, split j), j fastest. Row blocks: ROWS_DENSE one block of M rows;
    ROWS_PAIR R pairs; ROWS_TOKEN R tokens whose splits are (slot, K split) = (j // SPLIT, j % SPLIT).

    SHARED (the MoE's shared expert in the same launch, its own format FMT_S and pointers sw/ss/ss2, its own
    SPLIT_S K splits of CHUNK_S sub-steps, so that its units stream about as many bytes as a routed one):
    ROWS_PAIR pairs P .. R - 1 are the shared expert's rows (x row r - P), their units after all routed ones;
    ROWS_TOKEN tokens get SPLIT_S more splits j >= TOPK * SPLIT, the slot TOPK, which reads h row P + token
    with routing weight 1.

    X_READY (ROWS_PAIR with SHARED; `launch(x_ready=True)`: x was written before the previous kernel started,
    which is `moe.route`): the shared expert's units come first, and with PDL a unit waits for the previous
    kernel only before it reads the expert ids (routed units) or writes anything (every unit), so the shared
    expert streams while the routing kernel runs. Split partials are summed in split order whoever computes
    them, so the result is the same bits."""
    total, splits, num_n, shared_units, first_shared, first_routed = _launch_layout(
        N, R, SPLIT, TOPK, P, SPLIT_S, ROWS, BN, SHARED, X_READY)
    if PDL:
        # programmatic dependent launch: the next kernel may take SM slots as this one's CTAs finish; this one
        # waits for the previous kernel before it reads x, ids or scratch, or writes anything. Before the wait
        # it only prefetches its first dense unit's weights into L2 (no kernel writes them)
        gdc_launch_dependents()
        if PDL_L2 > 0 and ROWS == 0 and TILED:
            _prefetch_unit_l2(w_ptr, s_ptr, tl.minimum(tl.program_id(0), total - 1), splits, num_n, SPLIT, CHUNK,
                              n_steps, stride_wn, stride_sn, stride_wg, stride_sg, FMT, GATED, BN, PDL_L2)
        if not (X_READY and ROWS == 1 and SHARED):
            gdc_wait()
    for u in range(tl.program_id(0), total, tl.num_programs(0)):
        _gemv_unit(u, splits, num_n, shared_units, first_shared, first_routed,
                   x_ptr, w_ptr, s_ptr, s2_ptr, y_ptr, ids_ptr, rw_ptr, ws_ptr, cnt_ptr,
                   M, N, R, SPLIT, TOPK, CHUNK, n_steps, limit, X_DIV, GROUP_R, X_GSTRIDE,
                   stride_xm, stride_we, stride_wg, stride_wn, stride_se, stride_sg, stride_sn, stride_s2e,
                   stride_s2g, stride_ym,
                   sw_ptr, ss_ptr, ss2_ptr, P, CHUNK_S, SPLIT_S, n_steps_s, stride_swg, stride_swn, stride_ssg,
                   stride_ssn, stride_ss2g, cnt_ptr, 0, cnt_ptr,
                   FMT, SCALE_F32, ROWS, GATED, BN, MP, DOT, ASM, W, SHARED, FMT_S, SCALE_F32_S, PF, TILED, TILED_S,
                   PDL, GCOL, X_READY, False, False, 0, False)


@triton.jit
def _prefetch_l2(ptrs):
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _prefetch_unit_l2(w_ptr, s_ptr, u, splits, num_n, SPLIT, CHUNK, n_steps, stride_wn, stride_sn, stride_wg,
                      stride_sg, FMT: tl.constexpr, GATED: tl.constexpr, BN: tl.constexpr, STEPS: tl.constexpr):
    """Prefetch into L2 the first STEPS sub-steps of dense unit u's tile-major weights (clamped to the unit's
    own sub-steps) and, for FP4, their block scales (tiled alongside)."""
    j = u % splits
    n0 = ((u // splits) % num_n) * BN
    s0 = (j % SPLIT) * CHUNK
    steps = tl.minimum(tl.minimum(CHUNK, n_steps - s0), STEPS)
    _prefetch_tiled_run(w_ptr, n0, s0, steps, stride_wn, stride_wg, TILE_BYTES_C, STEPS, GATED)
    if FMT >= 2:
        _prefetch_tiled_run(s_ptr, n0, s0, steps, stride_sn, stride_sg, scale_chunk_c(FMT), STEPS, GATED)


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
def _await_row(flag_ptr, target, wbase, sbase, n0, s0, steps, stride_wn, stride_sn, FMT: tl.constexpr,
               TILED: tl.constexpr, ASM: tl.constexpr, STEPS: tl.constexpr):
    """Wait until the counter at flag_ptr reaches target, each thread with acquire semantics (ASM, the GPU; the
    interpreter runs programs one after another, so the count is always there). If it has not yet, first
    prefetch into L2 up to STEPS sub-steps [s0, s0 + steps) of tile row n0 of the unit's tile-major weights (and
    FP4 scales), which do not depend on what it waits for."""
    if ASM:
        seen = _load_acquire(flag_ptr)
        if seen < target:
            if STEPS > 0 and TILED:
                run = tl.minimum(steps, STEPS)
                _prefetch_tiled_run(wbase, n0, s0, run, stride_wn, 0, TILE_BYTES_C, STEPS, False)
                if FMT >= 2:
                    _prefetch_tiled_run(sbase, n0, s0, run, stride_sn, 0, scale_chunk_c(FMT), STEPS, False)
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


@triton.jit
def _pair_down_unit(v, R, num_n, splits, SPLIT, SPLIT_S, TOPK, SHARED: tl.constexpr, SHARED_FIRST: tl.constexpr):
    """The down launch's unit (`_launch_layout`'s numbering, ROWS_TOKEN) for the fused pair's v-th down unit, in the
    order gate/up completes h rows: pair by pair (token, slot), the shared expert's rows first when its gate/up
    units come first (X_READY), else last."""
    routed = R * num_n * SPLIT * TOPK
    w = v - R * num_n * SPLIT_S if SHARED and SHARED_FIRST else v
    pair = w // (num_n * SPLIT)
    rem = w % (num_n * SPLIT)
    u = ((pair // TOPK) * num_n + rem // SPLIT) * splits + (pair % TOPK) * SPLIT + rem % SPLIT
    if SHARED:
        s = v if SHARED_FIRST else v - routed
        u = tl.where((w < 0) | (w >= routed), (s // SPLIT_S) * splits + TOPK * SPLIT + s % SPLIT_S, u)
    return u


@triton.jit(do_not_specialize=["M", "R", "SPLIT", "TOPK", "CHUNK", "P", "CHUNK_S", "SPLIT_S", "n_steps_s",
                               "d_M", "d_R", "d_SPLIT", "d_TOPK", "d_CHUNK", "d_P", "d_CHUNK_S", "d_SPLIT_S",
                               "d_n_steps_s", "h_rows"])
def _moe_pair_kernel(
    x_ptr, w_ptr, s_ptr, s2_ptr, y_ptr, ids_ptr, rw_ptr, ws_ptr, cnt_ptr,
    M, N, R, SPLIT, TOPK, CHUNK, n_steps, limit, X_DIV, GROUP_R, X_GSTRIDE,
    stride_xm, stride_we, stride_wg, stride_wn, stride_se, stride_sg, stride_sn, stride_s2e, stride_s2g,
    stride_ym,
    sw_ptr, ss_ptr, ss2_ptr, P, CHUNK_S, SPLIT_S, n_steps_s, stride_swg, stride_swn, stride_ssg, stride_ssn,
    stride_ss2g,
    d_x_ptr, d_w_ptr, d_s_ptr, d_s2_ptr, d_y_ptr, d_ids_ptr, d_rw_ptr, d_ws_ptr, d_cnt_ptr,
    d_M, d_N, d_R, d_SPLIT, d_TOPK, d_CHUNK, d_n_steps, d_limit, d_X_DIV, d_GROUP_R, d_X_GSTRIDE,
    d_stride_xm, d_stride_we, d_stride_wg, d_stride_wn, d_stride_se, d_stride_sg, d_stride_sn, d_stride_s2e,
    d_stride_s2g, d_stride_ym,
    d_sw_ptr, d_ss_ptr, d_ss2_ptr, d_P, d_CHUNK_S, d_SPLIT_S, d_n_steps_s, d_stride_swg, d_stride_swn,
    d_stride_ssg, d_stride_ssn, d_stride_ss2g,
    sync_ptr, h_rows,
    FMT: tl.constexpr, SCALE_F32: tl.constexpr, ROWS: tl.constexpr, GATED: tl.constexpr, BN: tl.constexpr,
    MP: tl.constexpr, DOT: tl.constexpr, ASM: tl.constexpr, W: tl.constexpr,
    SHARED: tl.constexpr, FMT_S: tl.constexpr, SCALE_F32_S: tl.constexpr, PF: tl.constexpr, TILED: tl.constexpr,
    TILED_S: tl.constexpr, PDL: tl.constexpr, GCOL: tl.constexpr, X_READY: tl.constexpr,
    D_FMT: tl.constexpr, D_SCALE_F32: tl.constexpr, D_BN: tl.constexpr, D_FMT_S: tl.constexpr,
    D_SCALE_F32_S: tl.constexpr, D_TILED: tl.constexpr, D_TILED_S: tl.constexpr, D_GCOL: tl.constexpr,
    AWAIT_L2: tl.constexpr, PAIR_ORDER: tl.constexpr = True,
):
    """The MoE decode pair in one launch: the gate/up launch's units (the `_gemv_kernel` arguments, ROWS_PAIR,
    GATED) then the down launch's (the same arguments prefixed d_, ROWS_TOKEN, constexprs prefixed D_ where they
    may differ). A program's first unit is its own id; each later one comes from a ticket (the sync line 0),
    drawn near the end of the unit before, units in that order until none is left. A down unit only waits for
    gate/up units of lower numbers: first units of programs that are resident (`launch_pair` starts no more
    programs than fit on the GPU at once, and the hardware starts them in id order) or units running programs
    drew. Every gate/up output tile written counts into its h row's flag (line 2 + row, one 128-byte line
    each); a down unit waits for its row's count (L2-prefetching AWAIT_L2 sub-steps of its weights meanwhile),
    so down's first wave runs while gate/up finishes - no launch gap. The last program out (line 1 counts
    them) re-arms every flag. Split partials are summed in split order as in two launches: the same bits."""
    tl.static_assert(ROWS == 1 and GATED, "the first part of the pair is the gate/up launch")
    up_total, up_splits, up_n, up_shared, up_first_shared, up_first_routed = _launch_layout(
        N, R, SPLIT, TOPK, P, SPLIT_S, 1, BN, SHARED, X_READY)
    dn_total, dn_splits, dn_n, dn_shared, dn_first_shared, dn_first_routed = _launch_layout(
        d_N, d_R, d_SPLIT, d_TOPK, d_P, d_SPLIT_S, 2, D_BN, SHARED, False)
    total = up_total + dn_total
    done_ptr = sync_ptr + SYNC_LINE
    ready_ptr = sync_ptr + 2 * SYNC_LINE
    if PDL:   # as `_gemv_kernel`; the tickets are this kernel's own scratch, which the routing kernel never touches
        gdc_launch_dependents()
        if not (X_READY and SHARED):
            gdc_wait()
    t = tl.program_id(0)   # the first unit: the program's own; later ones: tickets
    while t < total:
        if t < up_total:
            nxt = _gemv_unit(t, up_splits, up_n, up_shared, up_first_shared, up_first_routed,
                       x_ptr, w_ptr, s_ptr, s2_ptr, y_ptr, ids_ptr, rw_ptr, ws_ptr, cnt_ptr,
                       M, N, R, SPLIT, TOPK, CHUNK, n_steps, limit, X_DIV, GROUP_R, X_GSTRIDE,
                       stride_xm, stride_we, stride_wg, stride_wn, stride_se, stride_sg, stride_sn, stride_s2e,
                       stride_s2g, stride_ym,
                       sw_ptr, ss_ptr, ss2_ptr, P, CHUNK_S, SPLIT_S, n_steps_s, stride_swg, stride_swn, stride_ssg,
                       stride_ssn, stride_ss2g, ready_ptr, 0, sync_ptr,
                       FMT, SCALE_F32, 1, True, BN, MP, DOT, ASM, W, SHARED, FMT_S, SCALE_F32_S, PF, TILED, TILED_S,
                       PDL, GCOL, X_READY, True, False, 0, True)
        else:
            if PDL:
                gdc_wait()   # reads the expert ids
            u = t - up_total
            if PAIR_ORDER:
                u = _pair_down_unit(u, d_R, dn_n, dn_splits, d_SPLIT, d_SPLIT_S, d_TOPK, SHARED, X_READY)
            nxt = _gemv_unit(u, dn_splits, dn_n, dn_shared, dn_first_shared, dn_first_routed,
                       d_x_ptr, d_w_ptr, d_s_ptr, d_s2_ptr, d_y_ptr, d_ids_ptr, d_rw_ptr, d_ws_ptr, d_cnt_ptr,
                       d_M, d_N, d_R, d_SPLIT, d_TOPK, d_CHUNK, d_n_steps, d_limit, d_X_DIV, d_GROUP_R, d_X_GSTRIDE,
                       d_stride_xm, d_stride_we, d_stride_wg, d_stride_wn, d_stride_se, d_stride_sg, d_stride_sn,
                       d_stride_s2e, d_stride_s2g, d_stride_ym,
                       d_sw_ptr, d_ss_ptr, d_ss2_ptr, d_P, d_CHUNK_S, d_SPLIT_S, d_n_steps_s, d_stride_swg,
                       d_stride_swn, d_stride_ssg, d_stride_ssn, d_stride_ss2g, ready_ptr, up_n, sync_ptr,
                       D_FMT, D_SCALE_F32, 2, False, D_BN, MP, DOT, ASM, W, SHARED, D_FMT_S, D_SCALE_F32_S, PF,
                       D_TILED, D_TILED_S, PDL, D_GCOL, False, False, True, AWAIT_L2, True)
        # the next unit, drawn near the end of this one: a ticket drawn at its start would fix the assignment
        # early, like a persistent grid's round robin (measured slower: units sat unevenly on the SMs)
        t = tl.num_programs(0) + nxt
    if PDL:
        gdc_wait()   # (a program that drew no unit) nothing below runs before the previous kernel is done
    if tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        # the last program out: every unit is done and every ticket drawn; re-arm for the next launch
        for c in range(0, h_rows, 128):
            offs = c + tl.arange(0, 128)
            tl.store(ready_ptr + offs * SYNC_LINE, tl.zeros((128,), dtype=tl.int32), mask=offs < h_rows)
        tl.store(sync_ptr, 0)
        tl.store(done_ptr, 0)


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
    beat one warpgroup's wgmma on 128 rows for FP8 and tie for FP4. With 16 x rows (MMA N = 16) registers
    bound the resident warps, so the kernel is capped at 128 (16 warps per SM, no spills; the gated one would
    spill and keeps its registers). With N = 8 it needs ~98 registers; caps of 96 / 88 / 80 / 72 and BN 32
    measured no faster (80 and below slower: spills), nor did 3 pipeline stages (run 10). Register prefetch of
    the weights (round four, runs 14 and 18): FP8 V4-Pro wo_b 51 -> 42 us; FP4 slower in every variant tried (more
    live registers for the same 16 warps per SM), so it is on for FP8 only.

    Programmatic dependent launch (round six, runs 41-44): back to back, dense GEMVs are 2-4 % faster on
    V4-Pro shapes and 8-11 % on V4-Flash's (launch latency and the first DRAM round trip overlap the previous
    kernel's tail); an L2 prefetch of 1-2 sub-steps before the wait helps, 8 hurts. The MoE pair measured level
    to 5 % slower with it at 4-8 tokens, so `kernels.moe` launches it without, except the gate/up launch right
    after the routing kernel (`launch(x_ready=True)`): streaming the shared expert while routing runs made the
    MoE layer 1.5-2 % faster at 1 token, level to 5 % at 4-8 (round eight, runs 65-69; with the persistent grid it
    measured up to 9 % at 8 tokens, most of which hardware scheduling now gives every launch, run 68)."""
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


def pdl_enabled(cfg: GemvConfig, device: torch.device) -> bool:
    """Programmatic dependent launch: asked for, on a CUDA GPU with `griddepcontrol` (sm_90+), not interpreted."""
    return cfg.pdl and has_pdl(device)


def plan_splits(rows: int, R: int, routed_rows: int, topk: int, num_n: int, n_steps: int, n_steps_s: int,
                slots: int, forced: int = 0) -> tuple[int, int, int, int, int, int]:
    """(units, partials per output tile, split, chunk, split_s, chunk_s) of one launch: R row blocks (of which
    `routed_rows` stream the routed weight, the rest the shared expert's with n_steps_s sub-steps; 0 = none),
    ROWS_TOKEN slots of `topk` routed experts plus the shared one. Chunks are whole step pairs.

    The routed split is `forced` or `choose_split`'s, and the shared expert gets the same. A sub-step is 64
    bytes of a row in every format, so an FP8 shared expert beside FP4 experts then has twice their sub-steps
    per unit and sets the launch's tail: plans whose shared units are as long as the routed ones replace it
    where one fits in one wave and costs less (cost = waves x (longest unit + UNIT_OVERHEAD_STEPS)). V4-Flash
    MoE at 1 token: 49.2 -> 45.5 us; with more waves the extra units and partials measured slower
    (bench/RESULTS.md, round six), so those are not tried."""
    shared = n_steps_s > 0
    slots_per_row = topk + shared if rows == ROWS_TOKEN else 1

    def plan(split, split_s):
        chunk = triton.cdiv(n_steps, split)
        chunk += chunk % 2   # even: FP8 splits hold whole 128-K scale blocks, FP4 splits whole step pairs
        split = triton.cdiv(n_steps, chunk)
        chunk_s = triton.cdiv(max(n_steps_s, 1), split_s)
        chunk_s += chunk_s % 2
        split_s = triton.cdiv(max(n_steps_s, 1), chunk_s)
        if rows == ROWS_TOKEN:
            parts = split * topk + (split_s if shared else 0)
            units = R * num_n * parts
        else:
            parts = max(split, split_s) if shared else split
            units = num_n * (routed_rows * split + (R - routed_rows) * split_s)
        longest = max(chunk, chunk_s) if shared else chunk
        cost = triton.cdiv(units, slots) * (longest + UNIT_OVERHEAD_STEPS)
        return (units, parts, split, chunk, split_s, chunk_s), cost

    split = forced or choose_split(R * num_n * slots_per_row, n_steps, slots)
    best, best_cost = plan(split, split)
    ratio = n_steps_s // n_steps
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
           x_ready: bool = False):
    """One launch over a (possibly stacked) QWeight. x rows: M (dense), pairs (ROWS_PAIR: R = M = pairs), or
    pairs of R tokens (ROWS_TOKEN: M = R = tokens, x has tokens * topk rows). y: [M, N] (row stride any).

    `shared` (ROWS_PAIR / ROWS_TOKEN): the MoE's shared expert, any supported format, same N and K, streamed in
    the same launch. ROWS_PAIR: R = M = pairs + tokens, rows from `pairs` on are the shared expert's (x row
    r - pairs); ROWS_TOKEN: x has pairs + R rows, each token's extra slot reads row pairs + token.

    `x_ready` (ROWS_PAIR with `shared`): the caller promises that x was written before the previous kernel on
    the stream started and that that kernel writes neither x nor the weights (it is `moe.route`'s); the shared
    expert's units then run first and, with `cfg.pdl`, before that kernel has finished (`X_READY`)."""
    p = _prepare(x, w, y, cfg, M=M, rows=rows, R=R, gated=gated, topk=topk, x_div=x_div, ids=ids, rw=rw, limit=limit,
                 group_r=group_r, x_gstride=x_gstride, shared=shared, pairs=pairs, scratch=scratch, x_ready=x_ready)
    _gemv_kernel[(p.programs,)](*p.args, **p.consts)


def _prepare(x, w: QWeight, y, cfg: GemvConfig, *, M: int, rows: int, R: int, gated: bool, topk: int, x_div: int, ids,
             rw, limit: float, group_r: int, x_gstride: int, shared: QWeight | None, pairs: int, scratch,
             x_ready: bool, cnt: torch.Tensor | None = None) -> _Prepared:
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
                  X_READY=x_ready and shared is not None and rows == ROWS_PAIR)
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
                swt, sscale, ss2 if ss2 is not None else swt, max(1, pairs), chunk_s, split_s, n_steps_s,
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
        rows, R, routed_rows, topk, num_n, n_steps, n_steps_s if shared is not None else 0, slots, cfg.split)
    ws = cnt.view(torch.float32)   # unused without splits (the kernel still needs typed pointers)
    if parts > 1:
        ws = torch.empty(parts * (2 if gated else 1) * M * N, dtype=torch.float32, device=x.device)
    nprog = units if (interp or not cfg.persistent) else max(1, min(units, slots))
    return _Prepared(kernel_args(split, chunk, split_s, chunk_s, ws), consts, units, nprog, slots)


# the down launch's constexprs that may differ from gate/up's; `_moe_pair_kernel` takes them prefixed D_
_PAIR_DOWN_CONSTS = ("FMT", "SCALE_F32", "BN", "FMT_S", "SCALE_F32_S", "TILED", "TILED_S", "GCOL")


def launch_pair(x: torch.Tensor, w13: QWeight, h: torch.Tensor, w2: QWeight, out: torch.Tensor, up: GemvConfig,
                down: GemvConfig, *, tokens: int, topk: int, ids, rw, limit: float, shared: tuple | None = None,
                scratch=None, x_ready: bool = False, fused: bool | None = None, await_l2: int = 0,
                pair_order: bool = True):
    """The MoE decode pair (`kernels.moe`): gate/up (`up`: ROWS_PAIR over the tokens * topk pairs, then the shared
    expert's rows, SwiGLU) into h, and the down projection (`down`: ROWS_TOKEN, the routing weights and the top-k
    sum fused) from h into out. `shared`: (w13, w2) of the shared expert; `x_ready` as in `launch`.

    `fused`: both in one launch (`_moe_pair_kernel`), each unit as `launch` would run it with the same split
    plan, so out holds the same bits as the two launches give. None: fused where the down projection takes more
    than one wave of CTAs (its first wave then overlaps the tail of gate/up: 2-5 % faster at 4-8 tokens on the
    H200), else two launches (at 1 token both are single waves and the fused pair's signalling measured 6-9 %
    slower; bench/RESULTS.md round nine). `await_l2`: sub-steps of a down unit's weights prefetched into L2 while
    it waits for its h row (measured slower, so 0); `pair_order` False: down units in their own launch's order
    instead of the order gate/up completes h rows (the same bits; for benchmarks)."""
    pairs = tokens * topk
    h_rows = pairs + (tokens if shared is not None else 0)
    sw13, sw2 = shared if shared is not None else (None, None)
    n_up, n_dn = h_rows * triton.cdiv(w13.out_features, up.BN), tokens * triton.cdiv(w2.out_features, down.BN)
    need = n_up + n_dn + (2 + h_rows) * SYNC_LINE
    buf = scratch.counters(x.device, need) if scratch is not None else \
        torch.zeros(need, dtype=torch.int32, device=x.device)
    pu = _prepare(x, w13, h, up, M=h_rows, rows=ROWS_PAIR, R=h_rows, gated=True, topk=1, x_div=topk, ids=ids,
                  rw=None, limit=limit, group_r=0, x_gstride=0, shared=sw13, pairs=pairs, scratch=scratch,
                  x_ready=x_ready, cnt=buf[:n_up])
    pd = _prepare(h, w2, out, down, M=tokens, rows=ROWS_TOKEN, R=tokens, gated=False, topk=topk, x_div=1, ids=ids,
                  rw=rw, limit=0.0, group_r=0, x_gstride=0, shared=sw2, pairs=pairs, scratch=scratch, x_ready=False,
                  cnt=buf[n_up:n_up + n_dn])
    if fused is None:
        fused = pd.units > pd.slots
    if not fused:
        _gemv_kernel[(pu.programs,)](*pu.args, **pu.consts)
        _gemv_kernel[(pd.programs,)](*pd.args, **pd.consts)
        return
    # one launch: programmatic dependent launch as gate/up's (`moe` gives it only gate/up, after routing)
    consts = {k: v for k, v in pu.consts.items() if k != "PDL_L2"}
    for k, v in pd.consts.items():
        if k in _PAIR_DOWN_CONSTS:
            consts["D_" + k] = v
        elif k not in ("ROWS", "GATED", "X_READY", "PDL_L2", "PDL", "launch_pdl") and consts.get(k) != v:
            raise ValueError(f"the fused MoE pair needs the same {k} for gate/up and down, got {consts.get(k)} "
                             f"and {v}")
    consts["AWAIT_L2"] = await_l2
    consts["PAIR_ORDER"] = pair_order
    args = (*pu.args, *pd.args, buf[n_up + n_dn:], h_rows)
    units = pu.units + pd.units
    if interpreting():
        programs = 1   # programs run one after another: a second one's first unit would come after all others
    else:
        key = ("pair", x.device, tuple(sorted((k, str(v)) for k, v in consts.items())))
        per_sm = scratch.resident(key, lambda: resident_ctas(
            _moe_pair_kernel.warmup(*args, grid=(1,), **consts), up.num_warps, x.device)) \
            if scratch is not None else 4
        programs = min(units, num_sms(x.device) * per_sm)
    _moe_pair_kernel[(programs,)](*args, **consts)


# FP4 weights of at least this many bytes (scales included) stream with 3 pipeline stages at up to 8 rows: with
# programmatic dependent launch, V4-Pro wq_b / wo_b NVFP4 (56 / 66 MB) 21.4 -> 20.4 and 27.5 -> 26.6 us; V4-Flash
# wq_b / wo_b (19 MB) 2-3 % slower, FP8 level (bench/RESULTS.md, runs 51-52). With 9-16 rows (MMA N = 16) the
# third stage's shared memory leaves 6 CTAs per SM instead of 8, and V4-Pro wq_b's 1024 units then take two
# waves: 35.6 against 26.4 us (wo_b, split to fit, gains 5 % with it: 34.6 against 36.6 us; run 70)
THREE_STAGE_FP4_BYTES = 40e6


def default_config(w: QWeight, rows: int = 1) -> GemvConfig:
    """The dense GEMV's configuration for a weight and `rows` rows of x: GemvConfig() but 3 stages for large FP4
    weights where the MMA's N is 8 (up to 8 rows)."""
    large_fp4 = w.fmt in FP4_FORMATS and w.nbytes() >= THREE_STAGE_FP4_BYTES
    return GemvConfig(num_stages=3) if large_fp4 and mma_n(rows) == 8 else GemvConfig()


def linear(x: torch.Tensor, w: QWeight, cfg: GemvConfig | None = None, out: torch.Tensor | None = None,
           scratch=None) -> torch.Tensor:
    """y = x @ W^T for x [M <= 64, K] (the caller checked `supported`); `cfg` None: `default_config(w, M)`."""
    M, N = x.shape[0], w.out_features
    cfg = cfg or default_config(w, M)
    y = out if out is not None else torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M:
        launch(x, w, y, cfg, M=M, scratch=scratch)
    return y
