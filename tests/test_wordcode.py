"""The XOR word code of tiled FP4 weights (`formats.wordcode`): a bijection whose pairs decode to E2M1 values, the
kernels' Triton fallback decoding it, and `QWeight.tile` applying it. The kernels' PTX on coded words is run
instruction by instruction in tests/test_kernels_gemv.py."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from dsv4.formats import E2M1_VALUES, TILE_BYTES, QWeight, tile_bytes
from dsv4.formats.wordcode import code_fp4_, code_words, uncode_words
from dsv4.kernels import tiles

GEN = torch.Generator().manual_seed(7)


def random_words(n: int) -> torch.Tensor:
    return torch.randint(-2**31, 2**31 - 1, (n,), generator=GEN, dtype=torch.int64).to(torch.int32)


def nibble(w: int, e: int) -> int:
    return (w >> (4 * e)) & 15


def pair_register(w: int, lo: int, hi: int) -> int:
    """Elements lo and hi of plain word w as the bf16x2 the MMA takes (bf16 subnormals: sign at bit 15 / 31,
    magnitude at 8..6 / 24..22), built from the nibbles alone."""
    def half(n):
        return ((n >> 3) << 15) | ((n & 7) << 6)
    return half(nibble(w, lo)) | (half(nibble(w, hi)) << 16)


def test_code_is_a_bijection():
    w = torch.cat([random_words(20000), torch.arange(-2**15, 2**15, dtype=torch.int32)])
    q = code_words(w)
    assert torch.equal(uncode_words(q), w)
    assert q.unique().numel() == w.unique().numel()
    assert not torch.equal(q, w)


def documented_pairs(q: torch.Tensor) -> list[torch.Tensor]:
    """The decode the wordcode docstring states, written out here: q ^ q << 2, q ^ q << 6, q ^ q >> 6, rotl(q, 12),
    each & 0x81C081C0."""
    q = q.to(torch.int64) & 0xFFFFFFFF
    ops = (q ^ ((q << 2) & 0xFFFFFFFF), q ^ ((q << 6) & 0xFFFFFFFF), q ^ (q >> 6),
           ((q << 12) | (q >> 20)) & 0xFFFFFFFF)
    return [t & 0x81C081C0 for t in ops]


def test_decoded_pairs_are_the_e2m1_values():
    """An independent oracle: each pair register, read as two bf16 and times 2^126, is the E2M1 table's value of
    the plain word's codes."""
    w = random_words(4096)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    for i, t in enumerate(documented_pairs(code_words(w))):
        for h in (0, 1):
            bits = ((t >> (16 * h)) & 0xFFFF).to(torch.int32)
            got = (bits << 16).view(torch.float32).double() * 2.0 ** 126
            codes = (w.to(torch.int64) >> (4 * (2 * i + h))) & 15
            assert torch.equal(got, table[codes])


@triton.jit
def _uncode_kernel(q_ptr, w_ptr, b_ptr, out_w_ptr, out_b_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_w_ptr + offs, tiles._uncode_words(tl.load(q_ptr + offs)))
    b = tl.load(b_ptr + tl.arange(0, 4 * N)).reshape(2, 2, N // 4, 4)
    tl.store(out_b_ptr + tl.arange(0, 4 * N), tiles._uncode_bytes(b).reshape(4 * N))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton fallback runs under the interpreter")
def test_triton_fallback_uncodes_like_the_spec():
    w = random_words(64)
    q = code_words(w)
    out_w = torch.empty_like(q)
    out_b = torch.empty(4 * 64, dtype=torch.uint8)
    _uncode_kernel[(1,)](q.view(torch.uint32), w, q.view(torch.uint8), out_w.view(torch.uint32), out_b, N=64)
    assert torch.equal(out_w, w)
    assert torch.equal(out_b.view(torch.int32), w)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_tiling_codes_fp4_words(fmt):
    n, k = 128, 256
    packed = torch.randint(0, 256, (2, n, k // 2), dtype=torch.uint8, generator=GEN)
    scale = torch.full((2, n, k // (16 if fmt == "nvfp4" else 32)), 0x38, dtype=torch.uint8)
    scale = scale.view(torch.float8_e4m3fn if fmt == "nvfp4" else torch.float8_e8m0fnu)
    s2 = torch.ones(2) if fmt == "nvfp4" else None
    w = QWeight(fmt, packed, scale, s2)
    expected = code_fp4_(tile_bytes(packed, TILE_BYTES).clone())
    for t in (w.tile(), QWeight(fmt, packed.clone(), scale.clone(), s2).tile(in_place=True)):
        assert torch.equal(t.weight, expected)
        assert torch.equal(t.untiled().weight, packed)
        assert torch.equal(t.dequantize(torch.float32), w.dequantize(torch.float32))
    assert torch.equal(w.weight, packed)   # tile() leaves the source alone


def test_one_tile_weight_is_not_coded_in_place():
    """A weight of one [64, 64] tile per matrix tiles to a view of itself; tile() must still return new bytes."""
    packed = torch.randint(0, 256, (64, 64), dtype=torch.uint8, generator=GEN)
    w = QWeight("mxfp4", packed.clone(), torch.full((64, 4), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu))
    t = w.tile()
    assert torch.equal(w.weight, packed)
    assert torch.equal(t.untiled().weight, packed) and torch.equal(t.untiled().weight, w.weight)
    assert torch.equal(t.weight, code_fp4_(packed.clone()))


def test_coding_in_chunks_is_the_same():
    """`code_fp4_` walks a tensor a chunk of words at a time; a chunk that ends mid-row changes nothing."""
    packed = torch.randint(0, 256, (5, 36), dtype=torch.uint8, generator=GEN)
    whole = code_fp4_(packed.clone())
    assert torch.equal(code_fp4_(packed.clone(), chunk=7), whole)
    assert torch.equal(code_fp4_(whole.clone(), uncode=True, chunk=7), packed)
    with pytest.raises(ValueError, match="whole 32-bit words"):
        code_fp4_(torch.zeros(3, 6, dtype=torch.uint8))
