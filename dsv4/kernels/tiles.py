"""Triton building blocks shared by every weight-streaming kernel: load a weight tile in its stored format,
dequantize it in registers, and feed it to one `tl.dot`.

Prescaled tiles. An FP4 tile leaves `_fp4_tile` (or `_fp4_natural`) multiplied by a power of two (2^-9 for
NVFP4, 2^-16 for MXFP4) so that one bf16 multiply per element pair is exact and never overflows; `epilogue_factor`
multiplies it back, together with NVFP4's fp32 `weight_scale_2`, once per output. Every value that reaches
the dot is exact in the operand dtype: e2m1 (2 significant bits) times an E4M3 scale (4 bits) needs 6 of
bf16's 8, and a UE8M0 scale is a power of two. FP8 tiles are converted exactly and their 128x128 scale is
applied to the fp32 partial product of each K block ("promotion"), so fp32 scales (-Base checkpoints) are
not rounded through bf16 either.

ASM=True (CUDA) decodes four packed bytes per instruction group with PTX bit tricks and bf16x2 multiplies;
ASM=False is plain Triton (the path `TRITON_INTERPRET=1` runs, and a fallback on GPUs). Both compute the
same values. Tiled FP4 weights hold XOR-coded words (`formats.wordcode`): their readers pass CODED = TILED, the
PTX decodes them directly, and the plain-Triton path uncodes them first (`_uncode_words`).
"""

from __future__ import annotations

from types import MappingProxyType

import triton
import triton.language as tl

from ..formats import MXFP4_BLOCK, NVFP4_BLOCK, TILE_BYTES, TILE_ROWS, scale_chunk
from ..formats.wordcode import DECODE_OPS, PAIR_MASK

FMT_DENSE, FMT_FP8, FMT_MXFP4, FMT_NVFP4 = 0, 1, 2, 3
FMT_CODES = MappingProxyType({"dense": FMT_DENSE, "fp8": FMT_FP8, "mxfp4": FMT_MXFP4, "nvfp4": FMT_NVFP4})

_TWO_M9 = tl.constexpr(2.0 ** -9)
_TWO_P117 = tl.constexpr(2.0 ** 117)
TILE_ROWS_C = tl.constexpr(TILE_ROWS)
TILE_BYTES_C = tl.constexpr(TILE_BYTES)
FMT_NVFP4_C = tl.constexpr(FMT_NVFP4)   # W4A4 activations are NVFP4
PAIR_MASK_C = tl.constexpr(PAIR_MASK)


# `formats.scale_chunk` indexed by kernel format code (Triton's dependency hashing takes constexprs, not calls)
_SCALE_CHUNKS_C = tl.constexpr(tuple(scale_chunk(name) for name in sorted(FMT_CODES, key=FMT_CODES.get)))


@triton.constexpr_function
def scale_chunk_c(fmt: int) -> int:
    """`formats.scale_chunk` for a kernel format code (`FMT_CODES`), at compile time: the block-scale bytes per
    row stored with one TILE_BYTES weight chunk (NVFP4 8, MXFP4 4; 0 where scales are not tiled)."""
    return _SCALE_CHUNKS_C.value[fmt]


@triton.constexpr_function
def group_size_c(fmt: int) -> int:
    """K elements per block scale of an FP4 kernel format code, at compile time (MXFP4 32, NVFP4 16)."""
    return MXFP4_BLOCK if fmt == FMT_MXFP4 else NVFP4_BLOCK


@triton.jit
def byte_offsets(rows, cols, stride, CHUNK: tl.constexpr, TILED: tl.constexpr):
    """Offsets of bytes (rows, cols) of a [N, stride] byte array: row-major, or (TILED) stored tile-major in
    [TILE_ROWS, CHUNK] tiles (`formats.tiling`: [N / TILE_ROWS, stride / CHUNK, TILE_ROWS, CHUNK])."""
    if TILED:
        return ((rows // TILE_ROWS_C) * (TILE_ROWS_C * stride) + (cols // CHUNK) * (TILE_ROWS_C * CHUNK)
                + (rows % TILE_ROWS_C) * CHUNK + cols % CHUNK)
    return rows * stride + cols


@triton.jit
def _e2m1_values(code):
    """E2M1 codes (any int tensor, 0..15) -> exact fp32 values, via the fp16 subnormal trick: sign to bit 15,
    exponent+mantissa to bits 11..9, so exponent 0 lands on fp16 subnormals and the whole table is 2^-14 off."""
    c = code.to(tl.uint16)
    bits = ((c & 7) << 9) | ((c & 8) << 12)
    return bits.to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def _scale_multiplier(s, FMT: tl.constexpr, ASM: tl.constexpr):
    """Stored block-scale bytes -> the multiplier `_fp4_tile` applies (fp32, or bf16 with ASM).

    NVFP4: e4m3 * 2^-9 (ASM: * 2^117, folding in the 2^126 of the bf16 subnormal decode).
    MXFP4: 2^(byte-127-16) (ASM: 2^(byte-17) as bf16 bits; exact for block scales 2^-116 .. 2^17).
    """
    if FMT == 3:
        v = s.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        if ASM:
            m = (v * _TWO_P117).to(tl.bfloat16)
        else:
            m = v * _TWO_M9
    else:
        e = s.to(tl.int32)
        if ASM:
            m = ((e + 110) << 7).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            m = tl.where(e > 16, (e - 16) << 23, 0).to(tl.float32, bitcast=True)
    return m


def _coded_pair_ptx(i: int, dst: str) -> list[str]:
    """PTX leaving pair i of the coded word $4 in `dst` (`formats.wordcode`: a shift and, once ptxas folds the XOR
    into the AND, one LOP3)."""
    op, s = DECODE_OPS[i]
    if op == "rotl":
        return [f"shf.l.wrap.b32 {dst}, $4, $4, {s};", f"and.b32 {dst}, {dst}, 0x{PAIR_MASK:08X};"]
    return [f"{'shl' if op == 'xor_shl' else 'shr'}.b32 {dst}, $4, {s};", f"xor.b32 {dst}, {dst}, $4;",
            f"and.b32 {dst}, {dst}, 0x{PAIR_MASK:08X};"]


def _fp4_ptx(scaled: bool, coded: bool) -> str:
    """PTX decoding one 32-bit word of packed FP4 (operands: $0..$3 out, $4 the word, $5 the multiplier when
    `scaled`, a bf16x2 of equal halves): output i is byte i's (low nibble, high nibble) as a bf16x2, elements 2i
    and 2i + 1 in natural K order, as bf16 subnormals (sign at bit 15 / 31, magnitude bits at 8..6 / 24..22: the
    value e2m1 * 2^-126); then the multiply, or not. A plain word, per byte: `prmt` (selector 0xC480 + 0x1111 i)
    builds [S(w_i) w_i S(u_i) u_i] from the word w and u = w << 4 (mode 8 replicates a byte's sign bit), then
    << 2 and the mask. A `coded` word (tiled weights): a shift, XOR and mask per pair (`_coded_pair_ptx`)."""
    lines = ["{", ".reg .b32 u, t;"] + ([] if coded else ["shl.b32 u, $4, 4;"])
    for i in range(4):
        if coded:
            lines += _coded_pair_ptx(i, "t")
        else:
            lines += [f"prmt.b32 t, u, $4, 0x{0xC480 + 0x1111 * i:04X};", "shl.b32 t, t, 2;",
                      f"and.b32 t, t, 0x{PAIR_MASK:08X};"]
        lines += [f"mul.rn.bf16x2 ${i}, t, $5;" if scaled else f"mov.b32 ${i}, t;"]
    return "\n".join(lines + ["}"])


def _fp4_halves_ptx(coded: bool) -> str:
    """PTX for `_fp4_tile`: 4 bytes ($4, one b32) and their 4 multipliers ($5, $6: two bf16x2) -> the 4 low nibbles
    ($0, $1: elements 0 2 / 4 6) and the 4 high nibbles ($2, $3: 1 3 / 5 7) as bf16 pairs. A plain word: `prmt`
    mode 8 replicates a byte's sign bit, so [S(b1) b1 S(b0) b0] << 2, masked, holds the high nibbles of b0 and b1
    as bf16 subnormals; the low nibbles come the same way from the word shifted left by 4. A coded word: its four
    natural pairs (`_coded_pair_ptx`), regrouped by `prmt` (low halves 0x5410, high halves 0x7632). Then one
    mul.bf16x2 per output applies the multipliers."""
    if coded:   # pairs 0, 1 -> outputs 0 (low halves) and 2 (high halves); pairs 2, 3 -> outputs 1 and 3
        lines = ["{", ".reg .b32 t, a, b;"]
        for half, m in ((0, 5), (1, 6)):
            lines += _coded_pair_ptx(2 * half, "a") + _coded_pair_ptx(2 * half + 1, "b")
            lines += ["prmt.b32 t, a, b, 0x5410;", f"mul.rn.bf16x2 ${half}, t, ${m};",
                      "prmt.b32 t, a, b, 0x7632;", f"mul.rn.bf16x2 ${half + 2}, t, ${m};"]
        return "\n".join(lines + ["}"])
    lines = ["{", ".reg .b32 u, t;", "shl.b32 u, $4, 4;"]
    for out, (src, sel, m) in enumerate((("u", "0x9180", 5), ("u", "0xB3A2", 6), ("$4", "0x9180", 5),
                                         ("$4", "0xB3A2", 6))):
        lines += [f"prmt.b32 t, {src}, 0, {sel};", "shl.b32 t, t, 2;", f"and.b32 t, t, 0x{PAIR_MASK:08X};",
                  f"mul.rn.bf16x2 ${out}, t, ${m};"]
    return "\n".join(lines + ["}"])


FP4_PTX = tl.constexpr(_fp4_ptx(True, False))
FP4_PTX_RAW = tl.constexpr(_fp4_ptx(False, False))   # no multiply (the GEMV's group columns)
FP4_CODED_PTX = tl.constexpr(_fp4_ptx(True, True))
FP4_CODED_PTX_RAW = tl.constexpr(_fp4_ptx(False, True))
FP4_HALVES_PTX = tl.constexpr(_fp4_halves_ptx(False))
FP4_CODED_HALVES_PTX = tl.constexpr(_fp4_halves_ptx(True))


@triton.jit
def _pair_codes(t):
    """A decoded pair register (uint32) -> the byte of its two 4-bit codes (low half -> low nibble)."""
    lo = ((t >> 12) & 8) | ((t >> 6) & 7)
    hi = ((t >> 28) & 8) | ((t >> 22) & 7)
    return lo | (hi << 4)


@triton.jit
def _uncode_words(q):
    """Coded FP4 words (uint32, `formats.wordcode`) -> plain words, in plain Triton (the interpreter's path; the
    GPU decodes coded words directly). The ops are `DECODE_OPS`'s (tests/test_wordcode.py checks both)."""
    t0 = (q ^ (q << 2)) & PAIR_MASK_C
    t1 = (q ^ (q << 6)) & PAIR_MASK_C
    t2 = (q ^ (q >> 6)) & PAIR_MASK_C
    t3 = ((q << 12) | (q >> 20)) & PAIR_MASK_C
    return _pair_codes(t0) | (_pair_codes(t1) << 8) | (_pair_codes(t2) << 16) | (_pair_codes(t3) << 24)


@triton.jit
def _uncode_bytes(b4):
    """Coded FP4 bytes [A, B, C, 4] (a little-endian word per last row) -> plain bytes, same shape."""
    shifts = (tl.arange(0, 4).to(tl.uint32) * 8)[None, None, None, :]
    w = tl.sum(b4.to(tl.uint32) << shifts, axis=3)   # disjoint bit fields: the sum is the OR
    return ((_uncode_words(w)[:, :, :, None] >> shifts) & 0xFF).to(tl.uint8)


@triton.jit
def _fp4_tile(b, mult, BN: tl.constexpr, BK: tl.constexpr, GS: tl.constexpr, DOT: tl.constexpr,
              ASM: tl.constexpr, CODED: tl.constexpr):
    """Packed bytes [BN, BK/2] (CODED: words coded as tiled weights store them, `formats.wordcode`) and per-group
    multipliers [BN, BK/GS] -> prescaled values of the even (low-nibble) and odd (high-nibble) K elements,
    [BN, BK/2] each, in the dot dtype. For mma.sync (BM < 128 in `_accumulate_fp4`), keeping the halves apart (and
    splitting x the same way) saves the register shuffles an interleave costs there; `_fp4_natural` gives the
    same values in natural K order."""
    b3 = b.reshape(BN, BK // GS, GS // 2)
    m3 = tl.broadcast_to(mult[:, :, None], (BN, BK // GS, GS // 2))
    if ASM:
        # one asm instance per 4 bytes (one b32) and their 4 multipliers (two bf16x2): `_fp4_halves_ptx`
        lo, hi = tl.inline_asm_elementwise(FP4_CODED_HALVES_PTX if CODED else FP4_HALVES_PTX, "=r,=r,=r,=r,r,r,r",
                                           [b3, m3], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        lo = lo.to(DOT)
        hi = hi.to(DOT)
    else:
        if CODED:
            b3 = _uncode_bytes(b3.reshape(BN, BK // GS, GS // 8, 4)).reshape(BN, BK // GS, GS // 2)
        lo = (_e2m1_values(b3 & 15) * m3).to(DOT)
        hi = (_e2m1_values(b3 >> 4) * m3).to(DOT)
    return lo.reshape(BN, BK // 2), hi.reshape(BN, BK // 2)


@triton.jit
def _fp4_natural(b, mult, BN: tl.constexpr, BK: tl.constexpr, GS: tl.constexpr, DOT: tl.constexpr,
                 ASM: tl.constexpr, CODED: tl.constexpr):
    """`_fp4_tile`'s values in natural K order: [BN, BK], element 2j / 2j + 1 the low / high nibble of byte j."""
    b3 = b.reshape(BN, BK // GS, GS // 8, 4)
    m3 = tl.broadcast_to(mult[:, :, None, None], (BN, BK // GS, GS // 8, 4))
    if CODED and not ASM:
        b3 = _uncode_bytes(b3)
    if ASM:
        # One `FP4_PTX` instance per 4 bytes (one b32 in one scale group: a thread's bytes of a group are
        # contiguous); its multiplier $5 is the first of the two bf16x2 that Triton packs from the word's 4
        # multipliers, all equal.
        # Its four bf16x2 outputs are natural elements 0..7 of those bytes; Triton files the first two as output
        # a's four elements and the last two as c's, so a holds natural elements 0..3 and c 4..7 of every word,
        # and the join puts them in order (register renaming, no instruction).
        a, c = tl.inline_asm_elementwise(FP4_CODED_PTX if CODED else FP4_PTX, "=r,=r,=r,=r,r,r,r", [b3, m3],
                                         dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        w = tl.permute(tl.join(a, c), (0, 1, 2, 4, 3))          # [BN, groups, words, a|c, 4]
    else:
        w = tl.join(_e2m1_values(b3 & 15) * m3, _e2m1_values(b3 >> 4) * m3)   # [BN, groups, words, byte, lo|hi]
    return w.reshape(BN, BK).to(DOT)


# Four E4M3 bytes ($2) -> their exact values as two bf16x2 ($0: bytes 0 and 1, $1: bytes 2 and 3), with integer
# ops instead of the cvt chain e4m3 -> f16 -> f32 -> bf16 (whose f16 -> f32 step issues at a quarter of the ALU
# rate). `prmt` mode 8 makes each byte a sign-extended 16-bit lane [S(b) b]; << 4 puts its exponent and mantissa
# at bf16 bits 10..4 and its sign at bit 15; the mask clears the sign copies at bits 14..11 (and, in the high
# lane, the low lane's bits shifted in at 3..0). That is the e4m3 value times 2^-120 (an e4m3 subnormal becomes a
# bf16 subnormal), and one mul.bf16x2 by 2^120 restores it exactly. An e4m3 NaN byte (0x7F / 0xFF; never in a
# quantized weight) gives a finite value.
FP8_BF16X2_ASM = tl.constexpr("""
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
            """)


@triton.jit
def _fp8_tile(raw, DOT: tl.constexpr, ASM: tl.constexpr):
    """E4M3 bytes (uint8, any shape) -> their exact values in the dot dtype; ASM (bf16 on a GPU): four bytes per
    `FP8_BF16X2_ASM` instance."""
    if ASM:
        w = tl.inline_asm_elementwise(FP8_BF16X2_ASM, "=r,=r,r", [raw], dtype=tl.bfloat16, is_pure=True, pack=4)
    else:
        w = raw.to(tl.float8e4nv, bitcast=True)
    return w.to(DOT)


@triton.jit
def _load_fp4(wbase, sbase, rows, nmask, k0, stride_wn, stride_sn, FMT: tl.constexpr, BK: tl.constexpr,
              ASM: tl.constexpr, TILED: tl.constexpr):
    """Packed FP4 bytes [BN, BK/2] of K columns k0 .. k0 + BK and their multipliers [BN, BK/GS]
    (`_scale_multiplier`), for `_fp4_tile` / `_fp4_natural`."""
    offs_j = k0 // 2 + tl.arange(0, BK // 2)
    b = tl.load(wbase + byte_offsets(rows, offs_j[None, :], stride_wn, TILE_BYTES_C, TILED), mask=nmask[:, None],
                other=0)
    GS: tl.constexpr = group_size_c(FMT)
    offs_g = k0 // GS + tl.arange(0, BK // GS)
    s = tl.load(sbase + byte_offsets(rows, offs_g[None, :], stride_sn, scale_chunk_c(FMT), TILED),
                mask=nmask[:, None], other=0)
    return b, _scale_multiplier(s, FMT, ASM)


@triton.jit
def _accumulate_fp4(acc, x, wbase, sbase, offs_n, nmask, k0, stride_wn, stride_sn,
                    FMT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr,
                    PREC: tl.constexpr, ASM: tl.constexpr, TILED: tl.constexpr):
    """acc [BM, BN] += x [BM, BK] @ W[offs_n, k0:k0+BK]^T for packed FP4 W: decoded in natural K order at BM 16
    and from BM 128, as even / odd K halves (x split the same way, two dots) at BM 32-64. Plain and coded words
    take the same order, so row-major and tiled weights give the same bits. Which order is faster depends on BM
    (SASS and timings: docs/tuning.md#tiles-fp4-order); plain FP4 words reach the GPU kernels only where a weight
    cannot be tiled."""
    GS: tl.constexpr = group_size_c(FMT)
    b, m = _load_fp4(wbase, sbase, offs_n.to(tl.int64)[:, None], nmask, k0, stride_wn, stride_sn, FMT, BK, ASM, TILED)
    if BM >= 128 or BM <= 16:
        out = tl.dot(x, tl.trans(_fp4_natural(b, m, BN, BK, GS, DOT, ASM, TILED)), acc, input_precision=PREC)
    else:
        lo, hi = _fp4_tile(b, m, BN, BK, GS, DOT, ASM, TILED)
        xe, xo = tl.split(x.reshape(BM, BK // 2, 2))
        out = tl.dot(xe, tl.trans(lo), acc, input_precision=PREC)
        out = tl.dot(xo, tl.trans(hi), out, input_precision=PREC)
    return out


@triton.jit
def _accumulate_8(acc, xt, wbase, sbase, offs_n, nmask, k0, K, stride_wn, stride_sn,
                  FMT: tl.constexpr, SCALE_F32: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                  DOT: tl.constexpr, PREC: tl.constexpr, PROMOTE: tl.constexpr, TILED: tl.constexpr, ASM: tl.constexpr):
    """acc [BM, BN] += xt [BM, BK] @ W[offs_n, k0:k0+BK]^T for FP8 (times each column's block scale, applied
    to the fp32 partial product; ASM: decoded by `FP8_BF16X2_ASM`) or dense W."""
    rows = offs_n.to(tl.int64)[:, None]
    offs_k = k0 + tl.arange(0, BK)
    if EVEN_K:
        wmask = nmask[:, None]
    else:
        wmask = nmask[:, None] & (offs_k[None, :] < K)
    raw = tl.load(wbase + byte_offsets(rows, offs_k[None, :], stride_wn, TILE_BYTES_C, TILED), mask=wmask, other=0)
    if FMT == 1:
        w = _fp8_tile(raw, DOT, ASM)
        srow = sbase + (offs_n // 128).to(tl.int64) * stride_sn + k0 // 128
        if SCALE_F32:
            sv = tl.load(srow, mask=nmask, other=0.0)
        else:  # UE8M0 byte -> 2^(byte-127)
            sv = (tl.load(srow, mask=nmask, other=0).to(tl.int32) << 23).to(tl.float32, bitcast=True)
        if PROMOTE:  # scale the fp32 partial product (exact for any scale; cheap when BM is small)
            out = acc + tl.dot(xt, tl.trans(w), input_precision=PREC) * sv[None, :]
        else:  # a power-of-two scale times an e4m3 value is exact in bf16: scale the tile, accumulate in place
            out = tl.dot(xt, tl.trans(w * sv.to(DOT)[:, None]), acc, input_precision=PREC)
    else:
        out = tl.dot(xt, tl.trans(raw.to(DOT)), acc, input_precision=PREC)
    return out


@triton.jit
def _load_x_tile(x_ptr, xrow, rmask, k0, K, stride_xm, BK: tl.constexpr, EVEN_K: tl.constexpr,
                 DOT: tl.constexpr):
    offs_k = k0 + tl.arange(0, BK)
    if EVEN_K:
        mask = rmask[:, None]
    else:
        mask = rmask[:, None] & (offs_k[None, :] < K)
    x = tl.load(x_ptr + xrow.to(tl.int64)[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0)
    return x.to(DOT)


@triton.jit
def _load_xfp4(xq_ptr, xs_ptr, xrow, rmask, k0, stride_xqm, stride_xsm, BM: tl.constexpr, BK: tl.constexpr,
               DOT: tl.constexpr, ASM: tl.constexpr):
    """A W4A4 activation tile, packed NVFP4 [BM, BK/2] + e4m3 [BM, BK/16] -> values * 2^-9 [BM, BK]."""
    rows = xrow.to(tl.int64)[:, None]
    GS: tl.constexpr = group_size_c(FMT_NVFP4_C)
    b, m = _load_fp4(xq_ptr, xs_ptr, rows, rmask, k0, stride_xqm, stride_xsm, FMT_NVFP4_C, BK, ASM, False)
    return _fp4_natural(b, m, BM, BK, GS, DOT, ASM, False)   # activations are plain words


@triton.jit
def _sum_split_partials(ws_ptr, split_stride, plane, offs, mask, n, R: tl.constexpr, C: tl.constexpr,
                        GATED: tl.constexpr):
    """The fp32 [R, C] partials of n K splits parked at ws_ptr + i * split_stride + offs (GATED: the up
    projection's `plane` elements further on), summed in split order - deterministic, whichever program does it.
    Read with .cg: other programs wrote them. Returns (sum, up sum); the up sum is zeros unless GATED."""
    acc = tl.zeros((R, C), dtype=tl.float32)
    acc_u = tl.zeros((R, C), dtype=tl.float32)
    for i in range(0, n):
        part = ws_ptr + i * split_stride
        acc += tl.load(part + offs, mask=mask, other=0.0, cache_modifier=".cg")
        if GATED:
            acc_u += tl.load(part + plane + offs, mask=mask, other=0.0, cache_modifier=".cg")
    return acc, acc_u


@triton.jit
def epilogue_factor(s2_ptr, FMT: tl.constexpr):
    """The fp32 factor that undoes the tile prescale (and applies NVFP4's per-tensor weight_scale_2)."""
    if FMT == 3:
        f = tl.load(s2_ptr).to(tl.float32) * 512.0
    elif FMT == 2:
        f = tl.full([], 65536.0, tl.float32)
    else:
        f = tl.full([], 1.0, tl.float32)
    return f
