"""FP8 128x128 block weights and the UE8M0 / E4M3 scale codecs, against ml_dtypes and torch's float8 dtypes."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from dsv4.formats import (dequantize_fp8_block, expand_block_scale, float_to_ue8m0, pow2_ceil, quantize_fp8_block,
                          to_e4m3_saturating, ue8m0_to_float)


def test_ue8m0_codec_matches_ml_dtypes():
    raw = torch.arange(0, 255, dtype=torch.uint8)
    expected = raw.numpy().view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    np.testing.assert_array_equal(ue8m0_to_float(raw).numpy(), expected)
    np.testing.assert_array_equal(ue8m0_to_float(raw.view(torch.float8_e8m0fnu)).numpy(), expected)
    back = float_to_ue8m0(torch.from_numpy(expected))
    assert torch.equal(back.view(torch.uint8), raw)
    assert back.dtype == torch.float8_e8m0fnu


def test_ue8m0_refusals():
    with pytest.raises(ValueError, match="NaN"):
        ue8m0_to_float(torch.tensor([255], dtype=torch.uint8))
    for bad in (3.0, 0.0, -2.0, 2.0 ** -128, float("inf")):
        with pytest.raises(ValueError, match="powers of two"):
            float_to_ue8m0(torch.tensor([bad]))
    with pytest.raises(TypeError, match="dtype"):
        ue8m0_to_float(torch.ones(2))


def test_pow2_ceil():
    x = torch.tensor([1.0, 1.0000001, 0.75, 3.0, 2.0 ** -130, 0.0, 448.0])
    expected = [1.0, 2.0, 1.0, 4.0, 2.0 ** -126, 2.0 ** -126, 512.0]
    assert pow2_ceil(x).tolist() == expected
    assert pow2_ceil(torch.tensor([0.0]), floor=2.0 ** -127).tolist() == [2.0 ** -127]


def test_e4m3_saturating_matches_ml_dtypes_and_torch():
    x = np.concatenate([np.linspace(-500, 500, 4001), 2.0 ** np.arange(-12, 9), [1e30, -1e30, 464.0, 447.9]])
    x = x.astype(np.float32)
    got = to_e4m3_saturating(torch.from_numpy(x))
    expected = np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn)  # ml_dtypes gives NaN past 448: clip first
    np.testing.assert_array_equal(got.view(torch.uint8).numpy(), expected.view(np.uint8))
    assert torch.equal(got, torch.from_numpy(np.clip(x, -448, 448)).to(torch.float8_e4m3fn))
    assert to_e4m3_saturating(torch.tensor([float("inf")])).float().item() == 448.0
    with pytest.raises(ValueError, match="NaN"):
        to_e4m3_saturating(torch.tensor([float("nan")]))


def oracle_fp8(w: np.ndarray, ue8m0: bool) -> tuple[np.ndarray, np.ndarray]:
    n, k = w.shape
    tn, tk = -(-n // 128), -(-k // 128)
    scale = np.ones((tn, tk), np.float32)
    for i in range(tn):
        for j in range(tk):
            amax = float(np.abs(w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]).max())
            if amax > 0:
                scale[i, j] = 2.0 ** math.ceil(math.log2(amax / 448)) if ue8m0 else np.float32(amax) / np.float32(448)
    full = np.repeat(np.repeat(scale, 128, 0), 128, 1)[:n, :k]
    q = np.clip(w / full, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return q.view(np.uint8), scale


@pytest.mark.parametrize("ue8m0", [True, False])
@pytest.mark.parametrize("n,k", [(3, 48), (130, 200), (256, 128)])
def test_quantize_matches_oracle(n, k, ue8m0):
    w = torch.randn(n, k) * torch.logspace(-3, 3, k)
    w[:, :10] = 0
    if n > 128:
        w[128:, :128] = 0  # an all-zero tile stores 1.0
    q, scale = quantize_fp8_block(w, torch.float8_e8m0fnu if ue8m0 else torch.float32)
    ref_q, ref_scale = oracle_fp8(w.numpy(), ue8m0)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (-(-n // 128), -(-k // 128))
    assert scale.dtype == (torch.float8_e8m0fnu if ue8m0 else torch.float32)
    np.testing.assert_array_equal(scale.float().numpy(), ref_scale)
    np.testing.assert_array_equal(q.view(torch.uint8).numpy(), ref_q)


def test_dequantize_exact_with_leading_dims():
    q = torch.randn(2, 3, 130, 200).to(torch.float8_e4m3fn)
    scale = torch.randint(110, 140, (2, 3, 2, 2), dtype=torch.uint8).view(torch.float8_e8m0fnu)
    got = dequantize_fp8_block(q, scale)
    full = np.repeat(np.repeat(scale.float().numpy(), 128, -2), 128, -1)[..., :130, :200]
    np.testing.assert_array_equal(got.numpy(), q.float().numpy() * full)
    assert torch.equal(dequantize_fp8_block(q, scale, torch.bfloat16), got.bfloat16())
    assert torch.equal(expand_block_scale(scale, 130, 200), torch.from_numpy(full))


@settings(max_examples=40, deadline=None)
@given(arrays(np.float32, st.tuples(st.integers(1, 140), st.integers(1, 140)), elements=st.floats(-1e5, 1e5, width=32)),
       st.booleans())
def test_quant_dequant_error_within_the_format_bound(x, ue8m0):
    q, scale = quantize_fp8_block(torch.from_numpy(x), torch.float8_e8m0fnu if ue8m0 else torch.float32)
    deq = dequantize_fp8_block(q, scale).double().numpy()
    s = expand_block_scale(scale, *x.shape).double().numpy()
    # E4M3: relative error <= 2^-4 for normal values, absolute <= 2^-10 * s in the subnormal range
    bound = np.maximum(np.abs(x) * 2.0 ** -4, s * 2.0 ** -10)
    assert np.all(np.abs(x - deq) <= bound * (1 + 1e-6))


def test_input_errors():
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_fp8_block(torch.tensor([[1.0, float("inf")]]))
    with pytest.raises(ValueError, match=r"\[..., N, K\]"):
        quantize_fp8_block(torch.ones(5))
    with pytest.raises(ValueError, match="FP8 block scales"):
        quantize_fp8_block(torch.ones(2, 2), torch.bfloat16)
    q, scale = quantize_fp8_block(torch.randn(130, 10))
    with pytest.raises(ValueError, match="does not match"):
        dequantize_fp8_block(q, scale[:1])
    with pytest.raises(TypeError, match="dtype"):
        dequantize_fp8_block(q.float(), scale)
    with pytest.raises(TypeError, match="dtype"):
        dequantize_fp8_block(q, scale.view(torch.uint8))  # raw bytes are ambiguous here (e8m0? int?)
    with pytest.raises(ValueError, match="NaN bytes"):
        dequantize_fp8_block(torch.full((2, 2), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn), scale[:1])
    with pytest.raises(ValueError, match="positive and finite"):
        dequantize_fp8_block(q, torch.zeros(2, 1))
