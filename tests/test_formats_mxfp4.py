"""MXFP4 (DeepSeek's routed experts) against ml_dtypes, and the exact-or-refuse MXFP4 -> NVFP4 re-blocking."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from dsv4.formats import (dequantize_mxfp4, dequantize_nvfp4, mxfp4_k_max, mxfp4_to_nvfp4, pack_e2m1,
                          quantize_mxfp4, unpack_e2m1)


def oracle_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Scale 2^ceil(log2(amax/6)) in float64 (2^-127 for an empty block), elements via ml_dtypes' E2M1 cast."""
    blocks = w.astype(np.float64).reshape(*w.shape[:-1], -1, 32)
    amax = np.abs(blocks).max(-1)
    exps = np.array([max(math.ceil(math.log2(a / 6)), -127) if a > 0 else -127 for a in amax.flat]).reshape(amax.shape)
    scaled = (blocks / np.exp2(exps)[..., None]).astype(np.float32).reshape(w.shape)
    codes = scaled.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    codes = np.where(scaled == 0, 0, codes)  # dsv4 encodes -0.0 as +0 (ModelOpt's sign rule)
    e8m0 = np.exp2(exps).astype(np.float32).astype(ml_dtypes.float8_e8m0fnu).view(np.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8), e8m0


@pytest.mark.parametrize("shape", [(3, 64), (2, 2, 4, 96), (1, 32)])
def test_quantize_matches_oracle(shape):
    w = torch.randn(*shape) * torch.logspace(-20, 20, shape[-1] // 32).repeat_interleave(32)
    w[..., 0, :32] = 0  # an empty block
    q, scale = quantize_mxfp4(w)
    ref_q, ref_scale = oracle_mxfp4(w.numpy())
    assert q.dtype == torch.uint8 and scale.dtype == torch.float8_e8m0fnu
    np.testing.assert_array_equal(scale.view(torch.uint8).numpy(), ref_scale)
    np.testing.assert_array_equal(q.numpy(), ref_q)


def test_dequantize_matches_ml_dtypes_decoding():
    q = torch.randint(0, 256, (4, 48), dtype=torch.uint8)
    scale = torch.randint(100, 150, (4, 3), dtype=torch.uint8)
    lut = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    scale64 = scale.numpy().view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    expected = lut[unpack_e2m1(q).numpy()] * np.repeat(scale64, 32, -1)
    for s in (scale, scale.view(torch.float8_e8m0fnu)):  # raw bytes or the e8m0 dtype
        np.testing.assert_array_equal(dequantize_mxfp4(q, s).double().numpy(), expected)
        np.testing.assert_array_equal(dequantize_mxfp4(q.view(torch.int8), s).double().numpy(), expected)


@settings(max_examples=60, deadline=None)
@given(arrays(np.float32, st.tuples(st.integers(1, 3), st.sampled_from([32, 64])),
              elements=st.floats(-1e6, 1e6, width=32)))
def test_quant_dequant_error_within_the_format_bound(x):
    q, scale = quantize_mxfp4(torch.from_numpy(x))
    deq = dequantize_mxfp4(q, scale).double().numpy()
    s = np.repeat(scale.double().numpy(), 32, -1)
    v = np.abs(x.astype(np.float64)) / s
    assert np.all(v <= 6 * (1 + 2.0 ** -23))  # the power-of-two scale never clips
    half_gap = np.where(v <= 2, 0.25, np.where(v <= 4, 0.5, 1.0))
    assert np.all(np.abs(x - deq) <= s * half_gap * (1 + 1e-6))


def _mxfp4(exponents: list[list[int]], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random nonzero nibbles with the given block exponents [N, K/32]."""
    g = torch.Generator().manual_seed(seed)
    e = torch.tensor(exponents, dtype=torch.int32)
    codes = torch.randint(0, 16, (*e.shape[:-1], e.shape[-1] * 32), generator=g, dtype=torch.uint8)
    codes[..., ::32] = 7  # every block holds a nonzero value (+6)
    return pack_e2m1(codes), (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def _assert_exact(w, s, k_max=None):
    q, ws, ws2 = mxfp4_to_nvfp4(w, s, k_max)
    assert torch.equal(q, w.view(torch.uint8)), "not a single nibble may change"
    assert ws.dtype == torch.float8_e4m3fn and ws.shape[-1] == 2 * s.shape[-1]
    assert torch.equal(dequantize_nvfp4(q, ws, ws2), dequantize_mxfp4(w, s))  # bitwise, fp32
    return ws, ws2


@pytest.mark.parametrize("exps", [[[0, -3, 5]], [[-127, -110, -120]], [[127, 110, 115]], [[4, -13, 0], [-5, -8, 2]]])
def test_mxfp4_to_nvfp4_is_exact(exps):
    w, s = _mxfp4(exps)
    _, ws2 = _assert_exact(w, s)
    assert float(ws2) == 2.0 ** (max(map(max, exps)) - 8)


def test_span_of_17_binades_is_exact_and_18_is_refused():
    _assert_exact(*_mxfp4([[3, 3 - 17]]))
    with pytest.raises(ValueError, match="refusing a lossy conversion"):
        mxfp4_to_nvfp4(*_mxfp4([[3, 3 - 18]]))


def test_blocks_of_zeros_do_not_constrain_the_exponent_window():
    w, s = _mxfp4([[10, -120]])
    w.view(torch.uint8)[0, 16:] &= 0x88  # second block: only ±0 nibbles
    ws, ws2 = _assert_exact(w, s)
    assert float(ws2) == 2.0 ** 2 and int(mxfp4_k_max(w, s)) == 10


def test_shared_k_max_for_w1_w3():
    w1, s1 = _mxfp4([[2, -4]], seed=1)
    w3, s3 = _mxfp4([[6, -9]], seed=3)
    k = max(int(mxfp4_k_max(w1, s1)), int(mxfp4_k_max(w3, s3)))
    assert k == 6
    _, a = _assert_exact(w1, s1, k)
    _, b = _assert_exact(w3, s3, k)
    assert float(a) == float(b) == 2.0 ** (6 - 8)  # one weight_scale_2 for the fused GEMM1
    # A sibling whose maximum is far above pushes this tensor's small blocks out of the window: refuse.
    with pytest.raises(ValueError, match="refusing a lossy conversion"):
        mxfp4_to_nvfp4(w3, s3, 6 + 9)
    # A k_max below this tensor's own maximum cannot be right either.
    with pytest.raises(ValueError, match="above k_max"):
        mxfp4_to_nvfp4(w3, s3, 5)


def test_stacked_experts_get_one_weight_scale_2_per_shard_or_per_expert():
    w, s = _mxfp4([[[[0, 1]], [[5, 4]]], [[[-3, -2]], [[-1, -9]]]])  # [E=2, 2, N=1, K/32=2]
    ws, ws2 = _assert_exact(w, s)
    assert ws2.shape == (2, 2) and ws2.tolist() == [[2.0 ** -7, 2.0 ** -3], [2.0 ** -10, 2.0 ** -9]]
    per_expert = mxfp4_k_max(w, s).amax(-1, keepdim=True)  # w1/w3 of an expert share one k_max
    _, ws2 = _assert_exact(w, s, per_expert)
    assert ws2.tolist() == [[2.0 ** -3, 2.0 ** -3], [2.0 ** -9, 2.0 ** -9]]


def test_input_errors():
    w, s = _mxfp4([[0, 1]])
    with pytest.raises(ValueError, match="expected"):
        mxfp4_to_nvfp4(w, s[:, :1])
    with pytest.raises(ValueError, match="NaN"):
        mxfp4_to_nvfp4(w, torch.full_like(s.view(torch.uint8), 255))
    with pytest.raises(TypeError, match="dtype"):
        mxfp4_to_nvfp4(w, s.float())
    with pytest.raises(TypeError, match="integer"):
        mxfp4_to_nvfp4(w, s, 3.0)
    with pytest.raises(ValueError, match="does not broadcast"):
        mxfp4_to_nvfp4(w, s, torch.tensor([3, 4]))
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        quantize_mxfp4(torch.randn(2, 48))
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_mxfp4(torch.full((1, 32), float("nan")))
    with pytest.raises(ValueError, match="NaN"):
        dequantize_mxfp4(w, torch.full_like(s.view(torch.uint8), 255))
