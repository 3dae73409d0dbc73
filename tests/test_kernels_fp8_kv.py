"""The attention's fp8 cache (kv_cache_dtype "fp8"): packed K = V rows of e4m3 codes in blocks of 64 channels with a
power-of-two scale each and bf16 rope channels (`ref.fp8_kv_pack` / `fp8_kv_unpack` / `fp8_kv_round`, 584 bytes at
V4's 512 channels), written by the compressor kernel, read by the attention kernel, and the window's rows rounded to
the same values by the norm_rope kernel; each under the interpreter against its reference, and the references against
the rounding DeepSeek's reference describes (`act_quant(x, 64, "ue8m0", inplace=True)` on the nope channels)."""

import pytest
import torch

from dsv4.kernels import compressor, norm_rope, ref
from dsv4.kernels.attention import sparse_attention
from dsv4.model.state import CompressorState

from test_kernels_attention import CASES, make_step
from test_kernels_compressor import PAGE, RUNS, compress_runs, fresh_state


def act_quant_inplace(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """DeepSeek's reference rounding, written from its description: per block of `block` channels, scale
    2^ceil(log2(max(amax, 1e-4) / 448)), codes clamp(x / scale) in e4m3, back as code * scale."""
    blocks = x.float().unflatten(-1, (-1, block))
    amax = blocks.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax * (1 / 448))))
    return ((blocks / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale).flatten(-2).to(x.dtype)


def test_v4_rows_take_flashmlas_584_bytes():
    assert ref.kv_row_bytes(512, 448) == 584           # 448 codes + 64 bf16 + 7 exponents + 1 pad
    assert ref.kv_row_bytes(64, 48) == 88              # the tiny model: 48 + 32 + 1, padded to 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_pack_unpack_agree_with_deepseeks_rounding(dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(40, 512, generator=g) * torch.logspace(-8, 4, 40)[:, None]).to(dtype)
    x[0] = 0.0
    x[1, :64] = 448.0                                  # amax / 448 = 1: that block's scale is exactly 1
    rounded = ref.fp8_kv_round(x, 448)
    assert rounded.dtype == dtype
    assert torch.equal(rounded[:, :448], act_quant_inplace(x[:, :448]))
    assert torch.equal(rounded[:, 448:], x[:, 448:].to(torch.bfloat16).to(dtype))
    packed = ref.fp8_kv_pack(x, 448)
    assert packed.dtype == torch.uint8 and packed.shape == (40, 584) and not packed[:, 583].any()
    assert torch.equal(ref.fp8_kv_unpack(packed, 512, 448, dtype), rounded)
    assert int(packed[1, 576]) == 127                  # the first block's exponent byte: 2^0
    assert torch.equal(ref.fp8_kv_round(rounded, 448), rounded)     # rounded values are fixed points


@pytest.mark.parametrize("D, nope", [(512, 448), (64, 48), (128, 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_rope_kernel_rounds_as_the_reference(D, nope, dtype):
    g = torch.Generator().manual_seed(D)
    x = (torch.randn(6, 2, D, generator=g) * torch.logspace(-6, 3, 6)[:, None, None]).to(dtype)
    x[0, 0, :64] = 0.0
    angle = torch.rand(6, (D - nope) // 2, generator=g) * 6
    w = torch.rand(D, generator=g) + 0.5
    plain = norm_rope.norm_rope(x, angle.cos(), angle.sin(), w, 1e-6)
    got = norm_rope.norm_rope(x, angle.cos(), angle.sin(), w, 1e-6, fp8_nope=nope)
    assert torch.equal(got, ref.fp8_kv_round(plain, nope))
    want = ref.norm_rope(x, angle.cos(), angle.sin(), w, 1e-6, fp8_nope=nope)
    assert (got.float() - want.float()).abs().max() <= want.float().abs().max() * 2**-3   # an e4m3 step at most
    with pytest.raises(ValueError, match="fp8_nope"):
        norm_rope.norm_rope(x[..., :48], None, None, fp8_nope=40)


@pytest.mark.parametrize("ratio, hd", [(4, 64), (128, 64), (4, 128)])
def test_compressor_writes_packed_rows_as_the_reference(ratio, hd):
    g = torch.Generator().manual_seed(ratio + hd)
    runs, slots, num_pages, nope = RUNS[ratio], 4, 16, hd - 16
    perm = torch.randperm(num_pages, generator=g).tolist()
    tables = {slot: tuple(perm[4 * i:4 * i + 4]) for i, (slot, _) in enumerate(runs)}
    base = fresh_state(slots, num_pages, ratio, hd, g)
    row = ref.kv_row_bytes(hd, nope)

    def packed_state():
        c = lambda t: None if t is None else t.clone()  # noqa: E731
        return CompressorState(c(base.open_kv), c(base.open_score), c(base.prev_kv), c(base.prev_score),
                               torch.full((num_pages, PAGE // ratio, row), 0xAB, dtype=torch.uint8), None, nope)
    mine, theirs = packed_state(), packed_state()
    weight, ape = torch.rand(hd, generator=g) + 0.5, torch.randn(ratio, mine.open_kv.shape[-1], generator=g)
    done = {slot: 0 for slot, _ in runs}
    for _ in compress_runs(runs, tables, mine, theirs, ratio, ape, weight, done, g):
        pass
    written = (theirs.entries != 0xAB).any(-1)
    assert int(written.sum()) == sum(done[s] // ratio for s in done) > 0
    assert torch.equal(written, (mine.entries != 0xAB).any(-1))
    assert float((mine.entries == theirs.entries).all(-1)[written].float().mean()) > 0.9   # rounding ties apart
    a = ref.fp8_kv_unpack(mine.entries[written], hd, nope, torch.float32)
    b = ref.fp8_kv_unpack(theirs.entries[written], hd, nope, torch.float32)
    assert torch.allclose(a, b, atol=1e-5, rtol=0.07)
    assert not mine.entries[written][:, row - 1].any()                 # the padding byte is written, zero


@pytest.mark.parametrize("ratio, starts, lengths", [c for c in CASES if c[0]])
@pytest.mark.parametrize("split", [0, 3])
def test_attention_reads_packed_entries_as_their_values(ratio, starts, lengths, split, D=64):
    """D = 64 channels, 48 of them fp8: the kernel over packed rows gives what it gives over their decoded values,
    and what the reference gives over the packed rows."""
    q, kv, ring, entries, picks, steps, _, sinks = make_step(ratio + 7, ratio, starts, lengths, D=D)
    nope = 48
    packed = ref.fp8_kv_pack(entries * 3, nope)
    values = ref.fp8_kv_unpack(packed, D, nope, torch.float32)
    got = sparse_attention(q, kv, ring, packed, picks, steps, ratio, sinks, D ** -0.5, entry_nope=nope, split=split)
    plain = sparse_attention(q, kv, ring, values, picks, steps, ratio, sinks, D ** -0.5, split=split)
    twin = ref.sparse_attention(q, kv, ring, packed, picks, steps, ratio, sinks, D ** -0.5, entry_nope=nope)
    assert torch.equal(got, plain)
    assert (twin - got).abs().max() / twin.abs().max() < 1e-5
    with pytest.raises(ValueError, match="packed with 48 fp8 channels"):
        sparse_attention(q, kv, ring, values, picks, steps, ratio, sinks, D ** -0.5, entry_nope=nope)
