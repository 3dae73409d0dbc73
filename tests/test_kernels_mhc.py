"""The mHC kernels (`kernels.mhc`) under the interpreter against their reference (`ref.hc_*`), both against
the reference evaluated in float64: fp32 within rounding of the float64 values, bf16 within one bf16 step of the
reference (the kernels round once where the reference rounds an intermediate to bf16)."""

import pytest
import torch

from dsv4.kernels import mhc
from dsv4.kernels import ref

EPS = 1e-6
SHAPES = [(1, 4, 64), (6, 4, 128), (3, 4, 1024), (9, 4, 64)]      # (tokens, hc_mult, hidden); 2 x 9 tokens: 32 a
                                                                   # mixing program, 14 of them masked


def params(n: int, d: int, rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    fn = torch.randn(rows, n * d, generator=g) * 0.5 / (n * d) ** 0.5
    return fn, torch.randn(rows, generator=g) * 0.5, torch.rand(3, generator=g) + 0.5


def streams(T: int, n: int, d: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(2, T, n, d, generator=torch.Generator().manual_seed(seed)).to(dtype)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@pytest.mark.parametrize("T, n, d", SHAPES)
def test_hc_pre_and_post_fp32(T, n, d):
    x = streams(T, n, d, seed=T)
    fn, base, scale = params(n, d, (2 + n) * n, seed=d)
    u, post, comb = mhc.hc_pre(x, fn, base, scale, 20, EPS, EPS)
    exact = ref.hc_pre(x.double(), fn.double(), base.double(), scale.double(), 20, EPS, EPS)
    close = ref.hc_pre(x, fn, base, scale, 20, EPS, EPS)
    assert u.dtype == x.dtype and post.shape == (2, T, n) and comb.shape == (2, T, n, n)
    for mine, theirs, want in zip((u, post, comb), close, exact):
        assert rel(mine, want) < 4e-6 and rel(theirs, want) < 4e-6
    assert torch.allclose(comb.sum(dim=-2), torch.ones(2, T, n), atol=1e-3)   # Sinkhorn ends on the columns
    out = torch.randn(2, T, d, generator=torch.Generator().manual_seed(7))
    y = mhc.hc_post(out, x, post, comb)
    want = ref.hc_post(out.double(), x.double(), exact[1], exact[2])
    assert y.dtype == x.dtype and rel(y, want) < 4e-6


@pytest.mark.parametrize("T, n, d", SHAPES)
def test_hc_head_fp32(T, n, d):
    x = streams(T, n, d, seed=T + 1)
    fn, base, scale = params(n, d, n, seed=d + 1)
    got = mhc.hc_head(x, fn, base, scale[:1], EPS, EPS)
    want = ref.hc_head(x.double(), fn.double(), base.double(), scale[:1].double(), EPS, EPS)
    assert got.shape == (2, T, d) and rel(got, want) < 4e-6


def test_bf16_streams_within_one_bf16_step():
    T, n, d = 5, 4, 256
    x = streams(T, n, d, seed=3, dtype=torch.bfloat16)
    fn, base, scale = params(n, d, (2 + n) * n, seed=4)
    u, post, comb = mhc.hc_pre(x, fn, base, scale, 20, EPS, EPS)
    ur, pr, cr = ref.hc_pre(x, fn, base, scale, 20, EPS, EPS)
    assert u.dtype == torch.bfloat16 and rel(post, pr) < 1e-6 and rel(comb, cr) < 1e-6
    step = 2.0 ** -7                                     # one bf16 step, relative
    assert ((u.float() - ur.float()).abs() <= step * ur.float().abs() + 1e-6).all()
    out = torch.randn(2, T, d, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    y, yr = mhc.hc_post(out, x, post, comb), ref.hc_post(out, x, pr, cr)
    assert ((y.float() - yr.float()).abs() <= 2 * step * yr.float().abs() + 2 * step).all()


@pytest.mark.parametrize("T", [3, 9, 40])
def test_bf16_streams_take_fn_in_three_bf16_pieces(T):
    """bf16 streams multiply fn as hi + mid + lo bf16 pieces (the plan's "bf16x3"): the mixes are fp32 FMAs' within
    fp32 rounding (a missing piece moves them by about 2^-16), against the float64 reference on the same values."""
    import dataclasses
    n, d = 4, 256
    x = streams(T, n, d, seed=31, dtype=torch.bfloat16)
    fn, base, scale = params(n, d, (2 + n) * n, seed=32)
    plan = mhc.plan_hc(x.shape[0] * T, n, d, (2 + n) * n, bf16=True)
    assert plan.precision == "bf16x3" and mhc.plan_hc(x.shape[0] * T, n, d, 24).precision == "ieee"
    pieces = mhc._collapse(x, fn, base, scale, 20, EPS, EPS, False, None, 0.0)
    fmas = mhc._collapse(x, fn, base, scale, 20, EPS, EPS, False, None, 0.0,
                         plan=dataclasses.replace(plan, precision="ieee"))
    exact = ref.hc_pre(x.double(), fn.double(), base.double(), scale.double(), 20, EPS, EPS)
    for mine, fma, want in zip(pieces[1:3], fmas[1:3], exact[1:]):
        assert rel(mine, want) < 1e-6 and rel(fma, want) < 1e-6
    assert torch.equal(pieces[0], fmas[0]) or rel(pieces[0], fmas[0]) <= 2.0 ** -7


def test_plans_and_refusals():
    flash, pro = mhc.plan_hc(1, 4, 4096, 24), mhc.plan_hc(256, 4, 7168, 24)
    # a decode token's fn read spreads over 256 programs of 64 columns; 256 tokens keep 512-column chunks, 32 tokens
    # a program above 16 tokens
    assert (flash.chunk, flash.chunks, flash.rows_p2, flash.token_blocks, flash.chunks_p2) == (64, 256, 32, 1, 256)
    assert (pro.chunk, pro.chunks, pro.token_blocks, pro.chunks_p2) == (512, 56, 8, 64)
    assert [mhc.plan_hc(t, 4, 4096, 24).block_tokens for t in (16, 17, 256)] == [16, 32, 32]
    # bf16 streams: their products on the tensor cores in three bf16 pieces, 64 tokens a program above 16 tokens
    assert [(p.block_tokens, p.precision) for p in (mhc.plan_hc(t, 4, 4096, 24, bf16=True) for t in (16, 17))] \
        == [(16, "bf16x3"), (64, "bf16x3")]
    assert mhc.plan_hc(64, 4, 4096, 24).chunk == 128 and mhc.plan_hc(3, 4, 64, 4).chunk == 64
    assert mhc.plan_hc(3, 4, 64, 4).rows_p2 == 16                    # the head's 4 rows: tl.dot's least N
    with pytest.raises(ValueError, match="power-of-two hc_mult"):
        mhc.plan_hc(1, 3, 4096, 15)
    empty = torch.zeros(0, 4, 64)
    fn, base, scale = params(4, 64, 24, seed=0)
    assert mhc.hc_pre(empty, fn, base, scale, 20, EPS, EPS)[0].shape == (0, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, n, d", [(3, 4, 1024), (2, 4, 96)])
def test_collapse_with_the_blocks_norm(T, n, d, dtype):
    """hc_pre / hc_head given the next norm's weight: the collapse normalised in the same launch equals the collapse
    followed by the norm kernel (`norm_rope`) and the reference's rms_norm of the reference's collapse."""
    from dsv4.kernels import norm_rope
    x = streams(T, n, d, seed=11, dtype=dtype)
    fn, base, scale = params(n, d, (2 + n) * n, seed=12)
    w = torch.rand(d, generator=torch.Generator().manual_seed(13)) + 0.5
    u, post, comb = mhc.hc_pre(x, fn, base, scale, 20, EPS, EPS, w, 1e-5)
    plain = mhc.hc_pre(x, fn, base, scale, 20, EPS, EPS)
    assert torch.equal(post, plain[1]) and torch.equal(comb, plain[2])
    then_normed = norm_rope.norm_rope(plain[0], None, None, w, 1e-5)
    want = ref.hc_pre(x, fn, base, scale, 20, EPS, EPS, w, 1e-5)[0]
    assert torch.equal(want, ref.rms_norm(ref.hc_pre(x, fn, base, scale, 20, EPS, EPS)[0], w, 1e-5))
    bound = 4e-6 if dtype == torch.float32 else 2.0 ** -7
    assert u.dtype == dtype and rel(u, then_normed) <= bound and rel(u, want) <= 2 * bound
    fh, bh, sh = params(n, d, n, seed=14)
    y = mhc.hc_head(x, fh, bh, sh[:1], EPS, EPS, w, 1e-5)
    assert rel(y, norm_rope.norm_rope(mhc.hc_head(x, fh, bh, sh[:1], EPS, EPS), None, None, w, 1e-5)) <= bound
    assert rel(y, ref.hc_head(x, fh, bh, sh[:1], EPS, EPS, w, 1e-5)) <= 2 * bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, n, d", [(5, 4, 256), (1, 4, 1024), (9, 4, 64)])
def test_post_then_pre_in_two_launches(T, n, d, dtype):
    """hc_post_pre (the residual update made inside the next collapse's mixing launch) gives the streams of hc_post
    bit for bit and the collapse of hc_pre on them, and equals the reference's hc_post then hc_pre."""
    x = streams(T, n, d, seed=21, dtype=dtype)
    g = torch.Generator().manual_seed(22)
    out = torch.randn(2, T, d, generator=g).to(dtype)
    fn0, base0, scale0 = params(n, d, (2 + n) * n, seed=23)
    _, post, comb = mhc.hc_pre(x, fn0, base0, scale0, 20, EPS, EPS)
    fn, base, scale = params(n, d, (2 + n) * n, seed=24)
    w = torch.rand(d, generator=g) + 0.5
    new, u, p, c = mhc.hc_post_pre(out, x, post, comb, fn, base, scale, 20, EPS, EPS, w, 1e-5)
    apart = mhc.hc_post(out, x, post, comb)
    assert new.dtype == dtype and torch.equal(new, apart)
    for mine, theirs in zip((u, p, c), mhc.hc_pre(apart, fn, base, scale, 20, EPS, EPS, w, 1e-5)):
        assert torch.equal(mine, theirs)
    want = ref.hc_post_pre(out, x, post, comb, fn, base, scale, 20, EPS, EPS, w, 1e-5)
    bound = 4e-6 if dtype == torch.float32 else 2.0 ** -6
    for mine, theirs in zip((new, u, p, c), want):
        assert rel(mine, theirs) <= bound
