"""FP4 words as the GPU kernels store them: each 32-bit word of packed E2M1 codes XOR-coded so that a pair of
values decodes in one shift and one LOP3 instead of `prmt`, shift and AND (bench/RESULTS.md, round twenty-six).

A word w (four bytes of one weight row, little-endian) holds eight codes in natural order: element e is bits
4e .. 4e + 3 (sign bit 3, magnitude e1 e0 m bits 2..0). A Hopper kernel feeds each pair of elements (2i, 2i + 1) to
the MMA as one bf16x2 register holding both as bf16 subnormals (times 2^126): sign at bit 15 / 31, magnitude at
8..6 / 24..22, every other bit zero. Its 8 bits sit at `PAIR_MASK`. From the plain word that costs a byte
permute, a shift and an AND per pair: no single shift brings a pair's 8 bits to their places (the sign and the
magnitude lie 7 bits apart in the register and 1 bit apart in the code). So the word is stored coded, as the q
for which

    pair i = DECODE_OPS[i](q) & PAIR_MASK,   DECODE_OPS = (q ^ q << 2, q ^ q << 6, q ^ q >> 6, rotl(q, 12)),

exactly: each output bit is one or two bits of q, a linear map over GF(2) that is invertible (found by search;
none exists with only two shifted copies of q). Decoding pair i is then a shift and one LOP3 (xor and mask), plus the
bf16x2 multiply as before: per word 12 instructions instead of 17 (SASS, sm_90).

Only tiled weights are coded (`QWeight.tile`, the device placement); checkpoints, the reference and every other
format function see plain words.
"""

from __future__ import annotations

import functools
from types import MappingProxyType

import torch

PAIR_MASK = 0x81C081C0
# pair i of a coded word q: (op, shift) -> op(q) & PAIR_MASK holds natural elements 2i (low half), 2i + 1 (high half)
DECODE_OPS = (("xor_shl", 2), ("xor_shl", 6), ("xor_shr", 6), ("rotl", 12))
_PAIR_BITS = (6, 7, 8, 15, 22, 23, 24, 31)   # the bits of PAIR_MASK
# bit b of a pair -> (element of the pair, bit of its 4-bit code)
_CODE_BIT = MappingProxyType({6: (0, 0), 7: (0, 1), 8: (0, 2), 15: (0, 3), 22: (1, 0), 23: (1, 1), 24: (1, 2),
                              31: (1, 3)})


def _sources(op: str, s: int, p: int) -> list[int]:
    """The bits of q that bit p of op(q) XORs together."""
    if op == "rotl":
        return [(p - s) % 32]
    moved = p - s if op == "xor_shl" else p + s
    return [p] + ([moved] if 0 <= moved < 32 else [])


def _encode_masks() -> tuple[int, ...]:
    """Bit j of a coded word is the parity of (plain word & mask j): the GF(2) inverse of the decode map."""
    rows, targets = [], []   # decoded bit (as a mask over q) -> the plain bit it must equal
    for i, (op, s) in enumerate(DECODE_OPS):
        for p in _PAIR_BITS:
            rows.append(sum(1 << b for b in _sources(op, s, p)))
            e, bit = _CODE_BIT[p]
            targets.append(1 << (4 * (2 * i + e) + bit))
    # Gauss-Jordan over GF(2) on [rows | targets]: afterwards row r has pivot bit r, so q_r = parity(w & target_r)
    aug = list(zip(rows, targets))
    for col in range(32):
        piv = next(r for r in range(col, 32) if aug[r][0] >> col & 1)
        aug[col], aug[piv] = aug[piv], aug[col]
        for r in range(32):
            if r != col and aug[r][0] >> col & 1:
                aug[r] = (aug[r][0] ^ aug[col][0], aug[r][1] ^ aug[col][1])
    assert all(aug[r][0] == 1 << r for r in range(32)), "the decode map is not invertible"
    return tuple(t for _, t in aug)


ENCODE_MASKS = _encode_masks()


def _code_int(w: int) -> int:
    """One plain word (a Python int) -> its coded word: bit j is the parity of w & ENCODE_MASKS[j]."""
    return sum((bin(w & mask).count("1") & 1) << j for j, mask in enumerate(ENCODE_MASKS))


def _pairs_int(q: int) -> list[int]:
    """One coded word -> the four pair registers `DECODE_OPS` give: what the kernels' PTX computes before its
    multiply."""
    pairs = []
    for op, s in DECODE_OPS:
        if op == "rotl":
            t = ((q << s) | (q >> (32 - s))) & 0xFFFFFFFF
        else:
            t = q ^ (((q << s) & 0xFFFFFFFF) if op == "xor_shl" else q >> s)
        pairs.append(t & PAIR_MASK)
    return pairs


def _uncode_int(q: int) -> int:
    """One coded word -> its plain word, read off the pair registers."""
    return sum(((t >> p) & 1) << (4 * (2 * i + e) + bit)
               for i, t in enumerate(_pairs_int(q)) for p, (e, bit) in _CODE_BIT.items())


@functools.cache
def _byte_tables(uncode: bool) -> tuple[tuple[int, ...], ...]:
    """Both maps are linear over GF(2), so a word's image is the XOR of its four bytes' images: 4 x 256 int32s
    (built on first use, not at import: about 60 ms)."""
    fn = _uncode_int if uncode else _code_int
    return tuple(tuple(v - (1 << 32) if v >= 1 << 31 else v for v in (fn(b << (8 * k)) for b in range(256)))
                 for k in range(4))


def _apply(uncode: bool, words: torch.Tensor) -> torch.Tensor:
    tables = torch.tensor(_byte_tables(uncode), dtype=torch.int32, device=words.device)
    out = tables[0][(words & 0xFF).long()]
    for k in range(1, 4):
        out ^= tables[k][((words >> (8 * k)) & 0xFF).long()]
    return out


def code_words(words: torch.Tensor) -> torch.Tensor:
    """Plain FP4 words (int32, any shape) -> coded words."""
    return _apply(False, words)


def uncode_words(words: torch.Tensor) -> torch.Tensor:
    """Coded words (int32, any shape) -> plain words."""
    return _apply(True, words)


def code_fp4_(packed: torch.Tensor, uncode: bool = False, chunk: int = 1 << 22) -> torch.Tensor:
    """Code (or uncode) packed FP4 bytes [..., R] (one byte per element, R a multiple of 4, contiguous) in place,
    `chunk` words at a time: the temporaries (int64 indices among them) stay near 100 MB however large the stacked
    tensor, which matters while the device placement fills a GPU."""
    if packed.element_size() != 1 or not packed.is_contiguous() or packed.shape[-1] % 4:
        raise ValueError(f"FP4 word coding needs contiguous byte rows of whole 32-bit words, got "
                         f"{tuple(packed.shape)} {packed.dtype}")
    words = packed.view(-1).view(torch.int32)
    fn = uncode_words if uncode else code_words
    for a in range(0, words.numel(), chunk):
        part = words[a:a + chunk]
        part.copy_(fn(part))
    return packed
