"""NVFP4: weight bytes against nvidia-modelopt 0.47, activation staging against an independent FlashInfer-recipe
oracle in numpy + ml_dtypes, dequantization and the W4A4 GEMM against float64 emulations."""

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from dsv4.formats import (E2M1_VALUES, dequantize_nvfp4, nvfp4_global_scale, quantize_nvfp4, stage_activation,
                          unpack_e2m1, w4a4_matmul_ref)

LUT64 = np.array(E2M1_VALUES, np.float64)
F32 = np.float32


@pytest.fixture(scope="module")
def modelopt():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from modelopt.torch.quantization.qtensor import NVFP4QTensor
    return NVFP4QTensor


def _weights(case: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(hash(case) % 2**31)
    if case == "randn":
        return torch.randn(64, 128, generator=g), None
    if case == "odd_n":
        return torch.randn(3, 48, generator=g), None
    if case == "leading":
        return torch.randn(2, 3, 5, 32, generator=g), None
    if case == "bf16":
        return torch.randn(16, 64, generator=g).bfloat16(), None
    if case == "zero_blocks":
        w = torch.randn(4, 64, generator=g)
        w[0, :16] = 0
        w[2, 32:] = 0
        return w, None
    if case == "wide_range":  # blocks 1e-9 below the tensor amax: their scale clamps to 2^-9
        w = torch.randn(8, 64, generator=g) * torch.logspace(-9, 0, 32).reshape(8, 4).repeat_interleave(16, 1)
        return w, None
    if case == "ties":  # amax 6 puts the block scale at ~1, so elements land on the E2M1 midpoints
        ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
        row = torch.tensor([6.0, *ties, *(-t for t in ties), 0.0])
        return row.repeat(2, 2), None
    if case == "shared_scale_saturates":  # a w1/w3-style shared weight_scale_2 too small for this tensor
        w = torch.randn(4, 32, generator=g)
        return w, nvfp4_global_scale(w.abs().amax() / 4)
    raise AssertionError(case)


CASES = ["randn", "odd_n", "leading", "bf16", "zero_blocks", "wide_range", "ties", "shared_scale_saturates"]


@pytest.mark.parametrize("case", CASES)
def test_bytes_equal_modelopt(modelopt, case):
    w, ws2 = _weights(case)
    q, ws, ws2_ours = quantize_nvfp4(w, ws2)
    ref_q, ref_ws, ref_ws2 = modelopt.quantize(w.clone(), 16, None, ws2)
    assert q.dtype == torch.uint8 and q.shape == (*w.shape[:-1], w.shape[-1] // 2)
    assert ws.dtype == torch.float8_e4m3fn and ws.shape == (*w.shape[:-1], w.shape[-1] // 16)
    assert ws2_ours.dtype == torch.float32 and ws2_ours.shape == ()
    assert torch.equal(q, ref_q._quantized_data)
    assert torch.equal(ws.view(torch.uint8), ref_ws.view(torch.uint8))
    assert torch.equal(ws2_ours, ref_ws2.float().reshape(()))


def test_special_cases_are_what_the_issue_says():
    w, _ = _weights("zero_blocks")
    _, ws, _ = quantize_nvfp4(w)
    assert float(ws[0, 0]) == 1.0 and float(ws[2, 2]) == 1.0 and float(ws[2, 3]) == 1.0
    w, _ = _weights("wide_range")
    assert float(quantize_nvfp4(w)[1].float().min()) == 2.0 ** -9
    w, ws2 = _weights("shared_scale_saturates")
    q, ws, _ = quantize_nvfp4(w, ws2)
    assert float(ws.float().max()) == 448.0 and (unpack_e2m1(q) & 7).max() == 7
    q, ws, ws2 = quantize_nvfp4(_weights("ties")[0])
    assert float(ws[0, 0]) == 448.0


def _float64_dequant(q, ws, ws2):
    ws64 = np.repeat(ws.double().numpy(), 16, -1)
    return LUT64[unpack_e2m1(q).numpy()] * ws64 * ws2.double().numpy()[..., None, None]


@pytest.mark.parametrize("case", CASES)
def test_dequant_is_the_correctly_rounded_product(modelopt, case):
    w, ws2 = _weights(case)
    q, ws, ws2 = quantize_nvfp4(w, ws2)
    got = dequantize_nvfp4(q, ws, ws2)
    # e2m1 * e4m3 * fp32 needs at most 2 + 4 + 24 bits: exact in float64, then rounded once to fp32.
    np.testing.assert_array_equal(got.numpy(), _float64_dequant(q, ws, ws2).astype(F32))
    # ModelOpt multiplies (ws * ws2) first, which can round twice: equal up to one ulp.
    qt = modelopt(w.shape, torch.float32, q)
    ref = qt.dequantize(dtype=torch.float32, scale=ws, double_scale=ws2, block_sizes={-1: 16})
    torch.testing.assert_close(got, ref, rtol=2 ** -22, atol=0)


def _half_gap(v: np.ndarray) -> np.ndarray:
    return np.where(v <= 2, 0.25, np.where(v <= 4, 0.5, 1.0))


@settings(max_examples=60, deadline=None)
@given(arrays(np.float32, st.tuples(st.integers(1, 4), st.sampled_from([16, 32, 64])),
              elements=st.floats(-1e4, 1e4, width=32)),
       st.integers(-6, 6))
def test_quant_dequant_error_within_the_format_bound(x, exponent):
    w = torch.from_numpy(x) * 2.0 ** exponent
    if not bool(w.abs().amax() > 0):
        return
    if float(w.abs().amax()) < 2688 * torch.finfo(torch.float32).tiny:
        with pytest.raises(ValueError, match="too small"):   # weight_scale_2 would be subnormal
            quantize_nvfp4(w)
        return
    q, ws, ws2 = quantize_nvfp4(w)
    deq = dequantize_nvfp4(q, ws, ws2).double().numpy()
    w64 = w.double().numpy()
    s = np.repeat(ws.double().numpy(), 16, -1) * float(ws2)
    v = np.abs(w64) / s
    slack = 1e-6 * np.abs(w64) + 1e-30
    # Rounding to nearest on the E2M1 grid, or clipping at 6 when the E4M3 block scale rounded down.
    bound = np.where(v <= 6, s * _half_gap(v), np.abs(w64) - 6 * s)
    assert np.all(np.abs(w64 - deq) <= bound + slack)
    ideal = np.abs(w64).reshape(*w64.shape[:-1], -1, 16).max(-1) / (6 * float(ws2))
    normal = np.repeat((ideal >= 2.0 ** -6) & (ideal <= 448), 16, -1)
    assert np.all(v[normal] <= 6 * (1 + 2.0 ** -4) + 1e-6)  # E4M3 relative rounding is at most 2^-4


def flashinfer_oracle(x: np.ndarray, input_scale: float) -> tuple[np.ndarray, np.ndarray]:
    """nvfp4-format.md §3.2 written out in numpy float32 with ml_dtypes casts (IEEE division for rcp.approx)."""
    xb = x.astype(F32).reshape(-1, 16)
    sf_scale = F32(1) / F32(input_scale)                              # SFScaleVal = global scale
    vec_max = np.abs(xb).max(axis=1)
    sf_value = sf_scale * (vec_max * (F32(1) / F32(6)))
    sf = np.minimum(sf_value, F32(448)).astype(ml_dtypes.float8_e4m3fn)  # __nv_fp8_e4m3: satfinite, RN
    sf32 = sf.astype(F32)
    with np.errstate(divide="ignore"):
        out_scale = np.where(sf32 != 0, F32(1) / (sf32 * (F32(1) / sf_scale)), F32(0)).astype(F32)
    y = (xb * out_scale[:, None]).astype(F32)
    codes = y.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)          # cvt.rn.satfinite.e2m1x2
    codes = np.where(y == 0, 0, codes)  # ±0.0 both encode as +0 in dsv4 (ModelOpt's sign rule); same value
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed.reshape(*x.shape[:-1], -1), sf.view(np.uint8).reshape(*x.shape[:-1], -1)


def _activations(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 5, 64, generator=g) * torch.logspace(-3, 2, 4).repeat_interleave(16)
    x[0, 0, :16] = 0                # zero block
    x[0, 1, :16] *= 1e-12           # block scale underflows E4M3 -> stored as zeros
    x[1, 2, 16:32] *= 1e3           # past the calibrated range -> saturates
    return x.bfloat16()


@pytest.mark.parametrize("calibration", [1.0, 0.1, 10.0])  # input_scale from the true amax, too small, too big
def test_stage_activation_equals_independent_oracle(calibration):
    x = _activations(int(calibration * 10))
    input_scale = nvfp4_global_scale(x.float().abs().amax() * calibration)
    x_fp4, x_sf, global_scale = stage_activation(x, input_scale)
    ref_fp4, ref_sf = flashinfer_oracle(x.float().numpy(), float(input_scale))
    assert x_fp4.shape == (3, 5, 32) and x_sf.shape == (3, 5, 4) and x_sf.dtype == torch.float8_e4m3fn
    np.testing.assert_array_equal(x_sf.view(torch.uint8).numpy(), ref_sf)
    np.testing.assert_array_equal(x_fp4.numpy(), ref_fp4)
    assert float(global_scale) == float(F32(1) / F32(float(input_scale)))


def _distinguishing_block(input_scale: float) -> tuple[np.ndarray, int, int]:
    """A block on which the documented output scale 1/(sf*(1/g)) and the shortcut g/sf give different codes."""
    g = F32(1) / F32(input_scale)
    code = lambda v: int(np.array([v], F32).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)[0])  # noqa: E731
    for amax in np.linspace(0.5, 3, 2000, dtype=F32):
        sf = F32(np.array(g * (amax * (F32(1) / F32(6))), F32).astype(ml_dtypes.float8_e4m3fn).astype(F32))
        documented, shortcut = F32(1) / (sf * (F32(1) / g)), F32(g / sf)
        for bound in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0):
            up = down = F32(bound) / documented
            for _ in range(4):  # a few float32 neighbours of the element that lands on a rounding boundary
                for x in (up, down):
                    if x <= amax and code(x * documented) != code(x * shortcut):
                        block = np.zeros(16, F32)
                        block[0], block[1] = amax, x
                        return block, code(x * documented), code(x * shortcut)
                up, down = np.nextafter(up, F32(np.inf)), np.nextafter(down, F32(-np.inf))
    raise AssertionError("no distinguishing block found")


def test_stage_activation_uses_the_documented_output_scale_arithmetic():
    block, documented, shortcut = _distinguishing_block(0.3)
    x_fp4, _, _ = stage_activation(torch.from_numpy(block)[None], 0.3)
    assert documented != shortcut and int(unpack_e2m1(x_fp4)[0, 1]) == documented
    np.testing.assert_array_equal(x_fp4.numpy(), flashinfer_oracle(block[None], 0.3)[0])


def test_stage_activation_saturates_past_calibration_and_zeroes_empty_blocks():
    x = torch.zeros(2, 32)
    x[0, :16] = torch.linspace(-100, 100, 16)
    input_scale = nvfp4_global_scale(1.0)  # calibrated for |x| <= 1
    x_fp4, x_sf, _ = stage_activation(x, input_scale)
    assert float(x_sf[0, 0]) == 448.0 and x_sf[1].float().eq(0).all()
    codes = unpack_e2m1(x_fp4)
    assert codes[0, 0] == 0xF and codes[0, 15] == 0x7  # -6 and +6: clipped at the calibrated amax
    assert codes[0, 16:].eq(0).all() and codes[1].eq(0).all()


@pytest.mark.parametrize("m,n,k", [(1, 3, 48), (5, 8, 256)])
def test_w4a4_ref_equals_float64_emulation(m, n, k):
    g = torch.Generator().manual_seed(k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * 0.02
    input_scale = nvfp4_global_scale(x.abs().amax())
    x_fp4, x_sf, _ = stage_activation(x, input_scale)
    w_fp4, w_sf, ws2 = quantize_nvfp4(w)
    alpha = input_scale * ws2
    got = w4a4_matmul_ref(x_fp4, x_sf, w_fp4, w_sf, alpha).double().numpy()
    a64 = LUT64[unpack_e2m1(x_fp4).numpy()] * np.repeat(x_sf.double().numpy(), 16, -1)
    b64 = LUT64[unpack_e2m1(w_fp4).numpy()] * np.repeat(w_sf.double().numpy(), 16, -1)
    exact = float(alpha) * (a64 @ b64.T)
    # fp32 accumulation of exact products, then one multiply by alpha.
    bound = float(alpha) * (np.abs(a64) @ np.abs(b64).T) * (k + 2) * 2.0 ** -24
    assert np.all(np.abs(got - exact) <= bound)
    # and the whole W4A4 path approximates the plain product: 4-bit rounding on both sides, so measured
    # against |x_i| |w_j| (the Cauchy-Schwarz scale of each dot product), loosely.
    plain = (x.double() @ w.double().T).numpy()
    scale = np.outer(x.double().norm(dim=1).numpy(), w.double().norm(dim=1).numpy())
    assert np.all(np.abs(got - plain) <= 0.25 * scale)


def test_alpha_is_applied_once_not_folded_into_e4m3():
    x_fp4 = torch.full((1, 8), 0x22, dtype=torch.uint8)  # sixteen 1.0s
    sf = torch.full((1, 1), 1.0).to(torch.float8_e4m3fn)
    alpha = torch.tensor(1.0 / 3.0)  # not an E4M3 value: folding it into a block scale would round it
    got = w4a4_matmul_ref(x_fp4, sf, x_fp4, sf, alpha)
    assert float(got) == float(torch.tensor(16.0) * alpha)


def test_input_errors():
    with pytest.raises(ValueError, match="multiple of the block size 16"):
        quantize_nvfp4(torch.randn(4, 40))
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_nvfp4(torch.tensor([[float("inf")] + [0.0] * 15]))
    with pytest.raises(TypeError, match="floating"):
        quantize_nvfp4(torch.ones(2, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="all-zero"):
        quantize_nvfp4(torch.zeros(2, 16))
    with pytest.raises(ValueError, match="positive and finite"):
        quantize_nvfp4(torch.randn(2, 16), torch.tensor(0.0))
    with pytest.raises(ValueError, match="one scalar"):
        quantize_nvfp4(torch.randn(2, 16), torch.ones(2))
    with pytest.raises(ValueError, match="positive and finite"):
        stage_activation(torch.randn(2, 16), float("nan"))
    with pytest.raises(ValueError, match="multiple of the block size 16"):
        stage_activation(torch.randn(2, 24), 1.0)
    with pytest.raises(ValueError, match="NaN or Inf"):
        stage_activation(torch.tensor([[float("nan")] * 16]), 1.0)
    q, ws, ws2 = quantize_nvfp4(torch.randn(2, 32))
    with pytest.raises(TypeError, match="weight_scale"):
        dequantize_nvfp4(q, ws.float(), ws2)
    with pytest.raises(ValueError, match="weight_scale_2 has shape"):
        dequantize_nvfp4(q, ws, torch.ones(3))
    with pytest.raises(ValueError, match="positive and finite"):
        dequantize_nvfp4(q, ws, torch.tensor(float("nan")))
    with pytest.raises(ValueError, match="block scale has shape"):
        dequantize_nvfp4(q, ws[:, :1], ws2)
    with pytest.raises(ValueError, match="same K"):
        w4a4_matmul_ref(q, ws, q[:, :8], ws[:, :1], 1.0)
    with pytest.raises(ValueError, match="positive"):
        nvfp4_global_scale(0.0)


def test_a_tensor_too_small_for_an_fp32_global_scale_is_refused():
    w = torch.full((2, 16), 1.68e-41)           # hypothesis found this: amax / 2688 underflows fp32
    with pytest.raises(ValueError, match="too small"):
        quantize_nvfp4(w)
