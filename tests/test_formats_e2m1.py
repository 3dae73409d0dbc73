"""E2M1 codes, packing and packed-byte views, against ml_dtypes, torch's own FP4 helpers and hand-worked values."""

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from dsv4.formats import (E2M1_VALUES, as_packed_u8, decode_e2m1, dequantize_e2m1_blocks, encode_e2m1, pack_e2m1,
                          unpack_e2m1, view_packed)


def ml_codes(x: np.ndarray) -> np.ndarray:
    """ml_dtypes' RNE, saturating float32 -> float4_e2m1fn cast; its byte is the 4-bit code."""
    return x.astype(np.float32).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)


# (input, expected value): the ties of the issue text, both neighbours of each, saturation.
HAND = [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0),
        (0.2500001, 0.5), (0.7499999, 0.5), (2.5000002, 3.0), (4.9999995, 4.0), (5.0000005, 6.0),
        (6.0, 6.0), (7.0, 6.0), (1e30, 6.0), (float("inf"), 6.0), (0.0, 0.0)]


@pytest.mark.parametrize("x,value", HAND)
def test_hand_worked_rounding(x, value):
    for sign in (1.0, -1.0):
        code = int(encode_e2m1(torch.tensor([sign * x]))[0])
        assert E2M1_VALUES[code] == sign * value
        if sign < 0 and x > 0:
            assert code & 8, "a negative value keeps its sign bit, also when it rounds to zero"


def test_negative_zero_and_tiny_negatives_match_modelopt_sign_rule():
    codes = encode_e2m1(torch.tensor([-0.0, 0.0, -1e-30, -0.25, 1e-30]))
    assert codes.tolist() == [0, 0, 8, 8, 0]  # ModelOpt: sign bit = (x < 0)


def test_encode_matches_ml_dtypes_on_a_dense_grid():
    grid = np.concatenate([np.arange(-8, 8, 1 / 64), np.nextafter(np.float32([.25, .75, 1.25, 1.75, 2.5, 3.5, 5]), 0),
                           np.nextafter(np.float32([.25, .75, 1.25, 1.75, 2.5, 3.5, 5]), 9)]).astype(np.float32)
    grid = grid[grid != 0]  # ml_dtypes gives -0.0 the sign bit; ModelOpt and dsv4 do not (tested above)
    got = encode_e2m1(torch.from_numpy(grid)).numpy()
    np.testing.assert_array_equal(got, ml_codes(grid))


@settings(max_examples=200, deadline=None)
@given(arrays(np.float32, st.integers(1, 64), elements=st.floats(-20, 20, width=32).filter(lambda v: v != 0)))
def test_encode_matches_ml_dtypes_random(x):
    np.testing.assert_array_equal(encode_e2m1(torch.from_numpy(x)).numpy(), ml_codes(x))


def test_decode_all_codes_matches_ml_dtypes():
    codes = np.arange(16, dtype=np.uint8)
    expected = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    got = decode_e2m1(torch.from_numpy(codes)).numpy()
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(expected))


def test_decode_encode_identity_on_every_value():
    values = torch.tensor(E2M1_VALUES)
    nonneg_zero = torch.tensor([0] + list(range(1, 8)) + [0] + list(range(9, 16)), dtype=torch.uint8)
    assert torch.equal(encode_e2m1(values), nonneg_zero)  # -0.0 encodes as +0
    assert torch.equal(decode_e2m1(encode_e2m1(values)), values)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(E2M1_VALUES), min_size=1, max_size=40),
       st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]))
def test_decode_encode_identity_hypothesis(values, dtype):
    x = torch.tensor(values, dtype=dtype)
    assert torch.equal(decode_e2m1(encode_e2m1(x)), x.float())


def test_pack_layout_low_nibble_first():
    assert pack_e2m1(torch.tensor([1, 2, 3, 10], dtype=torch.uint8)).tolist() == [0x21, 0xA3]
    assert unpack_e2m1(torch.tensor([0x21, 0xA3], dtype=torch.uint8)).tolist() == [1, 2, 3, 10]


def test_pack_matches_torch_pack_uint4_and_float4_view():
    from torch.testing._internal.common_quantized import pack_uint4

    codes = torch.randint(0, 16, (3, 5, 8), dtype=torch.uint8)
    assert torch.equal(pack_e2m1(codes), pack_uint4(codes))
    # torch's own bf16 -> float4_e2m1fn_x2 helper (torchao's encoder) as an independent packer + encoder.
    from torch.testing._internal.common_quantized import _bfloat16_to_float4_e2m1fn_x2

    x = torch.tensor(E2M1_VALUES[:8] + tuple(-v for v in E2M1_VALUES[1:8]) + (0.0,)).reshape(2, 8)
    ref = _bfloat16_to_float4_e2m1fn_x2(x.bfloat16())
    assert torch.equal(pack_e2m1(encode_e2m1(x)), as_packed_u8(ref))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 255), min_size=1, max_size=64), st.integers(1, 3))
def test_unpack_pack_identity(raw, rows):
    packed = torch.tensor(raw * rows, dtype=torch.uint8).reshape(rows, len(raw))
    codes = unpack_e2m1(packed)
    assert codes.shape == (rows, 2 * len(raw)) and int(codes.max()) <= 15
    assert torch.equal(pack_e2m1(codes), packed)


def test_views_between_u8_i8_f4_share_bytes():
    u8 = torch.tensor([[0x21, 0xA3, 0xFF, 0x80]], dtype=torch.uint8)
    for dtype in (torch.int8, torch.float4_e2m1fn_x2, torch.uint8):
        v = view_packed(u8, dtype)
        assert v.dtype == dtype and v.data_ptr() == u8.data_ptr()
        assert torch.equal(unpack_e2m1(v), unpack_e2m1(u8))
        assert torch.equal(as_packed_u8(v), u8)
    assert view_packed(u8, torch.int8).tolist() == [[0x21, -0x5D, -1, -128]]


def test_dequantize_blocks_against_numpy():
    codes = torch.randint(0, 16, (2, 3, 64), dtype=torch.uint8)
    scale = (torch.rand(2, 3, 2) * 8).to(torch.float8_e4m3fn)  # E4M3 scales: the products are exact in fp32
    got = dequantize_e2m1_blocks(pack_e2m1(codes), scale, 32)
    lut = np.array(E2M1_VALUES, np.float64)
    expected = lut[codes.numpy()] * np.repeat(scale.double().numpy(), 32, axis=-1)
    np.testing.assert_array_equal(got.double().numpy(), expected)


def test_input_errors():
    with pytest.raises(ValueError, match="NaN"):
        encode_e2m1(torch.tensor([1.0, float("nan")]))
    with pytest.raises(TypeError, match="floating"):
        encode_e2m1(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="odd"):
        pack_e2m1(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="0..15"):
        pack_e2m1(torch.tensor([1, 16], dtype=torch.uint8))
    with pytest.raises(ValueError, match="0..15"):
        decode_e2m1(torch.tensor([200], dtype=torch.uint8))
    with pytest.raises(TypeError, match="dtype"):
        decode_e2m1(torch.tensor([1], dtype=torch.int64))
    with pytest.raises(TypeError, match="dtype"):
        unpack_e2m1(torch.zeros(4, dtype=torch.int16))
    with pytest.raises(TypeError, match="target dtype"):
        view_packed(torch.zeros(4, dtype=torch.uint8), torch.int16)
    with pytest.raises(ValueError, match="block scale has shape"):
        dequantize_e2m1_blocks(torch.zeros(2, 16, dtype=torch.uint8), torch.ones(2, 3), 16)
    with pytest.raises(ValueError, match="NaN or Inf"):
        dequantize_e2m1_blocks(torch.zeros(1, 8, dtype=torch.uint8), torch.tensor([[float("nan")]]), 16)
