"""W4A4 emulation kernels: `stage_activation` must equal `dsv4.formats.stage_activation` byte for byte; the
GEMM must match `ref.linear_w4a4` (alpha applied once). TRITON_INTERPRET=1, small odd shapes."""

import pytest
import torch

from dsv4.formats import QWeight, quantize_nvfp4, stage_activation
from dsv4.formats.e2m1 import E2M1_VALUES
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
