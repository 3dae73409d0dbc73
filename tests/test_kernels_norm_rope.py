"""The fused norm + rope kernel (`kernels.norm_rope`) under the interpreter against its reference
(`ref.norm_rope`: `rms` / `rms_norm` then `apply_rope`), for every use the model makes of it: weighted RMSNorm rows
(block, q and kv norms; also a width that is not a power of two), the unweighted per-head RMS then rope (queries),
rope alone (the indexer's queries) and the inverse rope (attention's output); fp32 and bf16 rows."""

import pytest
import torch

from dsv4.kernels import ref
from dsv4.kernels.norm_rope import norm_rope, norm_ropes

CASES = [  # (shape, rotate, weighted, normalised, inverse)
    ((2, 5, 64), False, True, True, False),        # a block's RMSNorm
    ((1, 3, 96), False, True, True, False),        # a width that is not a power of two
    ((2, 5, 64), True, True, True, False),         # kv: RMSNorm, then rope
    ((1, 6, 4, 64), True, False, True, False),     # q per head: unweighted RMS, then rope
    ((1, 6, 4, 32), True, False, False, False),    # the indexer's queries: rope only
    ((1, 6, 4, 64), True, False, False, True),     # attention's output: the inverse rope
    ((1, 5, 3, 64), True, False, True, False),     # q per head, 15 rows: a short last program of 8 rows
]


@pytest.mark.parametrize("many_rows", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, rotate, weighted, normalised, inverse", CASES)
def test_matches_the_reference(shape, rotate, weighted, normalised, inverse, dtype, many_rows, monkeypatch):
    """One row a program, and (many_rows) NORM_ROPE_ROWS rows a program, as a launch of many rows on the GPU."""
    from dsv4.kernels import norm_rope as module
    if many_rows:
        monkeypatch.setattr(module, "ROWS_PROGRAMS_PER_SM", 0)
    g = torch.Generator().manual_seed(len(shape) * 10 + shape[-1])
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    tokens = shape[:2]
    angle = torch.rand(*tokens, 8, generator=g) * 6
    cos, sin = (angle.cos(), angle.sin()) if rotate else (None, None)
    weight = torch.rand(shape[-1], generator=g) + 0.5 if weighted else None
    eps = 1e-6 if normalised else None
    got = norm_rope(x, cos, sin, weight, eps, inverse)
    want = ref.norm_rope(x, cos, sin, weight, eps, inverse)
    assert got.shape == want.shape and got.dtype == want.dtype
    exact = ref.norm_rope(x.double(), None if cos is None else cos.double(), None if sin is None else sin.double(),
                          None if weight is None else weight.double(), eps, inverse)
    err = lambda a: float((a.double() - exact).abs().max() / exact.abs().max())  # noqa: E731
    if dtype == torch.float32:
        assert err(got) < 1e-6 and err(want) < 1e-6
    else:       # both round to bf16 up to three times (the RMS factor, the normalised row, the rotation)
        assert err(got) < 2 ** -6 and err(want) < 2 ** -6
        assert float((got.float() - want.float()).abs().max() / want.float().abs().max()) < 2 ** -6
    if not normalised and not rotate:
        assert torch.equal(got, x)


def test_rows_of_a_wider_product_are_read_in_place():
    """x a column slice of a wider product (wq_a's and wkv's columns of their fused output): the launch reads the
    rows through their stride, with the same result as a contiguous copy."""
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(3, 7, 96 + 64, generator=g).bfloat16()
    kv = wide[..., 96:]
    angle = torch.rand(3, 7, 8, generator=g)
    weight = torch.rand(64, generator=g) + 0.5
    got = norm_rope(kv, angle.cos(), angle.sin(), weight, 1e-6)
    assert torch.equal(got, norm_rope(kv.contiguous(), angle.cos(), angle.sin(), weight, 1e-6))
    want = ref.norm_rope(kv, angle.cos(), angle.sin(), weight, 1e-6)          # bf16 roundings may differ
    assert float((got.float() - want.float()).abs().max() / want.float().abs().max()) < 2 ** -6


@pytest.mark.parametrize("normalised", [True, False])
def test_heads_of_a_wider_product_are_read_in_place(normalised, monkeypatch):
    """x the per-head view of a column slice (wq_b's and the indexer's wq_b's columns of their fused output, [T, H,
    D] with a token stride wider than H D): the launch reads each head through the token and head strides from x
    itself (no copy), with the same result as a contiguous copy."""
    from dsv4.kernels import norm_rope as module

    read = []

    class Spy:                                      # records the memory the launch reads x from
        def __getitem__(self, grid):
            def launch(rows, *args, **kwargs):
                read.append(rows.x.data_ptr())
                return kernel[grid](rows, *args, **kwargs)
            return launch

    kernel = module._norm_rope_kernel
    monkeypatch.setattr(module, "_norm_rope_kernel", Spy())
    g = torch.Generator().manual_seed(6)
    wide = torch.randn(2, 5, 4 * 64 + 3 * 32, generator=g).bfloat16()
    q, iq = wide[..., :256].view(2, 5, 4, 64), wide[..., 256:].view(2, 5, 3, 32)
    angle = torch.rand(2, 5, 8, generator=g)
    eps = 1e-6 if normalised else None
    for x in (q, iq):
        got = norm_rope(x, angle.cos(), angle.sin(), None, eps)
        assert read[-1] == x.data_ptr()
        assert torch.equal(got, norm_rope(x.contiguous(), angle.cos(), angle.sin(), None, eps))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_calls_in_one_launch_give_each_calls_bits(dtype, monkeypatch):
    """`norm_ropes`: wq_a's rows (weighted RMSNorm, no rope) and wkv's (RMSNorm, rope; also through the fp8 cache's
    codes) of one fused product, two calls a launch, equal bit for bit to a launch each, and the reference twin
    `ref.norm_ropes` equal to `ref.norm_rope` of each; a third call takes a launch of its own, a call of no rows
    none."""
    from dsv4.kernels import norm_rope as module
    launches = []
    kernel = module._norm_rope_kernel

    class Count:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(module, "_norm_rope_kernel", Count())
    g = torch.Generator().manual_seed(7)
    wide = (torch.randn(1, 5, 96 + 64, generator=g) * 3).to(dtype)
    xq, xkv = wide[..., :96], wide[..., 96:]
    angle = torch.rand(1, 5, 8, generator=g) * 6
    wq, wkv = torch.rand(96, generator=g) + 0.5, torch.rand(64, generator=g) + 0.5
    heads = (torch.randn(1, 5, 2, 64, generator=g) * 3).to(dtype)
    calls = [(xq, None, None, wq, 1e-6), (xkv, angle.cos(), angle.sin(), wkv, 1e-6, False, 32),
             (heads, angle.cos(), angle.sin(), None, 1e-6), (xq[:, :0], None, None, wq, 1e-6)]
    got = norm_ropes(*calls)
    assert len(launches) == 2 and launches[0] == (10,) and launches[1] == (10,), launches
    for out, call in zip(got, calls):
        assert torch.equal(out, norm_rope(*call))
    for out, call in zip(ref.norm_ropes(*calls), calls):
        assert torch.equal(out, ref.norm_rope(*call))
    assert got[3].shape == (1, 0, 96)
