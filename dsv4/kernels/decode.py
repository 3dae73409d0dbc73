"""Register decoders of the decode GEMV (`gemv.py`): packed FP4 / FP8 weight words -> exact bf16 operands.

Decode cost per 32-bit word (SASS, sm_90): FP4 8 values = 4 x (shift, LOP3, bf16x2 mul) on the coded words of
tiled weights (`formats.wordcode`, docs/tuning.md#word-code), 1 shift + 4 x (prmt, shift, and, bf16x2 mul) on plain
words; FP8 4 values = 2 x (prmt, shift, and, bf16x2 mul). FP4 block-scale multipliers are formed once per scale
group. NVFP4: e2m1 as a bf16 subnormal (value * 2^-126) times bf16(scale * 2^117); MXFP4: times
bf16(2^(e - 17)) (exact for block scales 2^-116 .. 2^17, as the fused tiles' decoder); FP8: e4m3 as bf16 value * 2^-120 times
2^120 (an e4m3 NaN byte decodes to a finite value), its 128x128 block scale applied to the fp32 partial of
each 128-K block. Every value reaching the MMA is exact; the FP4 prescale is undone once in the epilogue
(`tiles.epilogue_factor`).

Each decoder returns its elements in natural order ([BN, 16] words -> [BN, 64] FP8 / [BN, 128] FP4 elements);
`gemv._to_mma` then re-indexes them into the MMA's operand layout (register renaming only). Without ASM (the
interpreter, fp32 operands) the same values come from plain Triton arithmetic.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tiles import (FP4_CODED_PTX, FP4_CODED_PTX_RAW, FP4_PTX, FP4_PTX_RAW, FP8_BF16X2_ASM, _e2m1_values,
                    _uncode_words)


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


@triton.jit
def _fp4_decode(b, mult, BN: tl.constexpr, ASM: tl.constexpr, SCALED: tl.constexpr = True,
                CODED: tl.constexpr = False):
    """Packed FP4 weights [BN, 16] uint32 (four adjacent bytes of one row each) and their block multipliers ->
    [BN, 128] in natural order (bf16 with ASM, else fp32): element 2j / 2j + 1 is the low / high nibble of
    byte j times its multiplier. Not SCALED (the group columns, module docstring): E2M1 value * 2^-126 (with ASM
    no multiply at all, a bf16 subnormal for +-0.5; else times `mult`, which the caller sets to 2^-126).

    ASM, one 32-bit word per instance, one bf16x2 per byte i (elements 2i, 2i + 1, adjacent in x too, so x
    fragments are plain words), the low nibble in the low half and the high nibble in the high half as bf16
    subnormals (sign at bit 15 / 31, magnitude bits at 8..6 / 24..22): from a CODED word (tiled weights,
    `formats.wordcode`) by a shift, XOR and mask; from a plain one `prmt` builds [S(w_i) w_i S(u_i) u_i] from the
    word w and u = w << 4 (mode 8 replicates a byte's sign bit), then << 2 and the mask (`tiles._fp4_ptx`). One
    mul.bf16x2 applies the multiplier (a word never straddles a scale group). Element positions come from
    memory (a uint32 is four bytes of one row), never from Triton's register order, on which `pack > 1`
    would depend. Without ASM a CODED word is first uncoded (`tiles._uncode_words`).
    """
    if ASM:
        if SCALED:
            p0, p1, p2, p3 = tl.inline_asm_elementwise(FP4_CODED_PTX if CODED else FP4_PTX, "=r,=r,=r,=r,r,r",
                                                       [b, mult], dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32),
                                                       is_pure=True, pack=1)
        else:
            p0, p1, p2, p3 = tl.inline_asm_elementwise(FP4_CODED_PTX_RAW if CODED else FP4_PTX_RAW, "=r,=r,=r,=r,r",
                                                       [b], dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32),
                                                       is_pure=True, pack=1)
        e0, e1 = _bf16_pair(p0)
        e2, e3 = _bf16_pair(p1)
        e4, e5 = _bf16_pair(p2)
        e6, e7 = _bf16_pair(p3)
    else:
        if CODED:
            b = _uncode_words(b)
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
    fp32). ASM: `tiles.FP8_BF16X2_ASM` per word."""
    if ASM:
        p01, p23 = tl.inline_asm_elementwise(FP8_BF16X2_ASM, "=r,=r,r", [b], dtype=(tl.uint32, tl.uint32),
                                             is_pure=True, pack=1)
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
    """Scale words of a sub-step [BN, 2] -> fp32 [BN, 8] in `gemv._to_mma` row order: column g is the factor from
    the group columns' partials of K columns 16g .. 16g + 15 (x * 2^64 times E2M1 * 2^-126) to the tile prescale
    that `tiles.epilogue_factor` undoes, less the 2^53 that `gemv._unit_acc` applies to the column sum. NVFP4 (a
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
