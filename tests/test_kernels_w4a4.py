"""W4A4 emulation kernels: `stage_activation` must equal `dsv4.formats.stage_activation` byte for byte; the
GEMM must match `ref.linear_w4a4` (alpha applied once). TRITON_INTERPRET=1, small odd shapes."""

import pytest
import torch
import triton
import triton.language as tl

from dsv4.formats import QWeight, quantize_nvfp4, stage_activation
from dsv4.formats.e2m1 import E2M1_VALUES, encode_e2m1
from dsv4.kernels import ops_for, ref
from dsv4.kernels import w4a4
from kernel_util import strict_ops


def tricky_activations(m: int, k: int) -> torch.Tensor:
    x = torch.randn(m, k) * torch.exp(2 * torch.randn(m, 1))
    x[0, :16] = 0.0                                   # all-zero block: scale 0, codes 0
    x[0, 16:32] = -0.0
    x[1, :16] = 1e4                                   # far past the calibrated range: saturation at 448 / ±6
    x[1, 16:32] = torch.tensor(E2M1_VALUES) * 0.01    # exact codes, including -0
    if m > 2:  # with input_scale 1/8 this block's scale is exactly 1, so elements land exactly on E2M1 ties
        ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2)
        x[2, :16] = ties * torch.tensor([1, -1] * 8) / 8
    return x


@pytest.mark.parametrize("shape", [(5, 64), (3, 2, 48)])
def test_stage_activation_is_bit_identical(shape):
    x = tricky_activations(int(torch.tensor(shape[:-1]).prod()), shape[-1]).reshape(shape)
    for input_scale in (torch.tensor(0.125), torch.tensor(0.05), 0.003, torch.tensor(7.0)):
        q, sf, g = w4a4.stage_activation(x, input_scale)
        rq, rsf, rg = stage_activation(x, input_scale)
        assert q.dtype == torch.uint8 and sf.dtype == torch.float8_e4m3fn
        assert torch.equal(q, rq)
        assert torch.equal(sf.view(torch.uint8), rsf.view(torch.uint8))
        assert torch.equal(g.reshape(()), rg.reshape(()))


def test_stage_activation_bf16_input():
    x = tricky_activations(4, 32).bfloat16()
    q, sf, _ = w4a4.stage_activation(x, 0.02)
    rq, rsf, _ = stage_activation(x, 0.02)
    assert torch.equal(q, rq) and torch.equal(sf.view(torch.uint8), rsf.view(torch.uint8))


# (input_scale, block amax, another element of the block): inputs on which fp32 rounding in another operation order
# changes the bits; found by a search over random scales (2026-12-03), where a kernel computing amax * global / 6
# (case 1: its scale byte) or global / scale (case 2: the other element's code) differed from the reference
ORDER_SENSITIVE = [(1.1119446754455566, 0.37788745760917664, 0.1),
                   (0.07497379183769226, 0.25709179043769836, 0.010543189942836761)]


@pytest.mark.parametrize("input_scale, amax, other", ORDER_SENSITIVE)
def test_stage_activation_keeps_the_reference_operation_order(input_scale, amax, other):
    s = torch.tensor(input_scale)
    x = torch.zeros(2, 32)
    x[0, 0], x[0, 1], x[1, 16], x[1, 17] = amax, other, -amax, -other
    q, sf, _ = w4a4.stage_activation(x, s)
    rq, rsf, _ = stage_activation(x, s)
    assert torch.equal(q, rq) and torch.equal(sf.view(torch.uint8), rsf.view(torch.uint8))
    # the case discriminates: the other order gives other bits
    g = 1.0 / s
    a = torch.tensor(amax)
    ref_scale = (g * (a * torch.tensor(1 / 6))).to(torch.float8_e4m3fn).float()
    alt_scale = ((a * g) / 6.0).to(torch.float8_e4m3fn).float()
    ref_code = encode_e2m1(torch.tensor([other]) * (1.0 / (ref_scale * (1.0 / g))))
    alt_code = encode_e2m1(torch.tensor([other]) * (g / alt_scale))
    assert ref_scale != alt_scale or not torch.equal(ref_code, alt_code)


@pytest.mark.parametrize("block, warps", [(1, 1), (32, 4), (256, 8)])
@pytest.mark.parametrize("rows, k", [(7, 80), (5, 192), (3, 1536)])   # 5, 12, 96 groups per row: odd, 4 x 3, 32 x 3
def test_stage_activation_launch_never_changes_bits(block, warps, rows, k):
    x = tricky_activations(rows, k)
    rq, rsf, _ = stage_activation(x, 0.05)
    q, sf, _ = w4a4.stage_activation(x, 0.05, block=block, num_warps=warps)
    assert torch.equal(q, rq) and torch.equal(sf.view(torch.uint8), rsf.view(torch.uint8))


def test_stage_activation_of_no_rows_or_no_columns():
    for shape in ((0, 48), (3, 0), (2, 0, 32)):
        x = torch.randn(shape)
        q, sf, g = w4a4.stage_activation(x, 0.05)
        rq, rsf, rg = stage_activation(x, 0.05)
        assert q.shape == rq.shape and sf.shape == rsf.shape and torch.equal(g.reshape(()), rg.reshape(()))


def test_stage_activation_block_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="block=96"):
        w4a4.stage_activation(torch.randn(2, 32), 0.05, block=96)


@triton.jit
def _elementwise_kernel(v_ptr, out_ptr, n, E2M1: tl.constexpr, B: tl.constexpr):
    """One of the stage kernel's roundings per element: `_e2m1_code` (E2M1) or `_round_e4m3`."""
    o = tl.program_id(0) * B + tl.arange(0, B)
    v = tl.load(v_ptr + o, mask=o < n)
    tl.store(out_ptr + o, w4a4._e2m1_code(v) if E2M1 else w4a4._round_e4m3(v), mask=o < n)


def _elementwise(v: torch.Tensor, e2m1: bool) -> torch.Tensor:
    out = torch.empty(v.numel(), dtype=torch.int32 if e2m1 else torch.float32)
    _elementwise_kernel[(triton.cdiv(v.numel(), 512),)](v, out, v.numel(), E2M1=e2m1, B=512)
    return out


def _with_fp32_neighbours(marks: torch.Tensor, top: float) -> torch.Tensor:
    """marks and their three float32 neighbours on either side (within [0, top])."""
    vals, up, down = [marks], marks, marks
    for _ in range(3):
        up, down = torch.nextafter(up, torch.tensor(top)), torch.nextafter(down, torch.tensor(0.0))
        vals += [up, down]
    return torch.cat(vals)


def test_e2m1_code_equals_encode_e2m1_at_every_threshold():
    """The kernel's magic-number rounding against the reference's comparisons: each grid point and tie, their
    three fp32 neighbours either side, saturation, infinities, tiny values, both signs, -0.0."""
    marks = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0,
                          1e30, float("inf"), 1e-40, 1e-45])
    v = torch.cat([_with_fp32_neighbours(marks, float("inf")), torch.rand(2000) * 8, torch.exp(torch.randn(2000) * 4)])
    v = torch.cat([v, -v, torch.tensor([-0.0])]).float()
    assert torch.equal(_elementwise(v, e2m1=True), encode_e2m1(v).to(torch.int32))


def test_round_e4m3_equals_the_e4m3_cast_at_every_midpoint():
    """The block scale's magic-number rounding against torch's float8_e4m3fn cast (round to nearest even): every
    non-negative E4M3 value up to 448, every midpoint between neighbours, and three fp32 neighbours of each."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()   # 0 ... 448
    marks = torch.cat([grid, (grid[:-1] + grid[1:]) / 2, torch.tensor([2.0 ** -10, 2.0 ** -11])])
    v = _with_fp32_neighbours(marks, 448.0).clamp(max=448.0)
    assert torch.equal(_elementwise(v, e2m1=False), v.to(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("m", [1, 6])
def test_linear_w4a4_matches_reference(m):
    ops = ops_for("cpu", "triton")
    q, s, s2 = quantize_nvfp4(torch.randn(29, 96) * 0.1)
    w = QWeight("nvfp4", q, s, s2, torch.tensor(0.004))
    x = torch.randn(m, 96)
    y, r = ops.linear_w4a4(x, w), ref.linear_w4a4(x, w)
    assert ((y - r).norm() / r.norm()).item() < 1e-6
    xb = torch.randn(2, m, 96).bfloat16()
    yb, rb = ops.linear_w4a4(xb, w), ref.linear_w4a4(xb, w)
    assert yb.shape == (2, m, 29) and ((yb.float() - rb.float()).norm() / rb.float().norm()).item() < 1e-2


def test_linear_w4a4_needs_input_scale():
    q, s, s2 = quantize_nvfp4(torch.randn(8, 32))
    with pytest.raises(ValueError, match="input_scale"):
        ops_for("cpu", "triton").linear_w4a4(torch.randn(1, 32), QWeight("nvfp4", q, s, s2))
