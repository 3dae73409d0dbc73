"""128x4 swizzled scale layout vs torch's cuBLAS-layout helpers and the offset formula (nvfp4-format.md §3.4)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4.formats import swizzle_128x4, unswizzle_128x4


@pytest.fixture(scope="module")
def torch_blocked():
    from torch.testing._internal.common_quantized import from_blocked, to_blocked

    return to_blocked, from_blocked


def formula_offset(m: int, s: int, cols: int) -> int:
    col_tiles = -(-cols // 4)
    return ((m // 128) * col_tiles + s // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + s % 4


@pytest.mark.parametrize("m,s", [(300, 37), (128, 4), (1, 1), (129, 5)])
def test_matches_torch_to_blocked_and_the_offset_formula(torch_blocked, m, s):
    to_blocked, _ = torch_blocked
    sf = torch.randint(1, 255, (m, s), dtype=torch.uint8)
    swz = swizzle_128x4(sf)
    assert swz.shape == (-(-m // 128) * 128, -(-s // 4) * 4)
    assert torch.equal(swz.flatten(), to_blocked(sf))
    flat = swz.flatten()
    for i in range(m):
        for j in range(s):
            assert flat[formula_offset(i, j, s)] == sf[i, j]
    assert int((flat != 0).sum()) == m * s  # padding is zeros


def test_inverse_matches_torch_from_blocked(torch_blocked):
    _, from_blocked = torch_blocked
    sf = (torch.rand(200, 12) * 400).to(torch.float8_e4m3fn)
    swz = swizzle_128x4(sf)
    assert swz.dtype == torch.float8_e4m3fn
    # from_blocked(input [M, K], flat scales, block) recovers [M, K/block] scales
    ref = from_blocked(torch.empty(200, 12 * 16), swz.flatten().view(torch.uint8), 16)
    assert torch.equal(unswizzle_128x4(swz, 200, 12).view(torch.uint8), ref)


def test_leading_dims_swizzle_each_matrix():
    sf = torch.randint(0, 255, (2, 3, 130, 6), dtype=torch.uint8).view(torch.float8_e8m0fnu)
    swz = swizzle_128x4(sf)
    assert swz.shape == (2, 3, 256, 8)
    for idx in [(0, 0), (1, 2)]:
        assert torch.equal(swz[idx].view(torch.uint8), swizzle_128x4(sf[idx]).view(torch.uint8))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 300), st.integers(1, 20), st.integers(0, 2))
def test_unswizzle_swizzle_identity(m, s, lead):
    sf = torch.randint(0, 256, (*(2,) * lead, m, s), dtype=torch.uint8)
    assert torch.equal(unswizzle_128x4(swizzle_128x4(sf), m, s), sf)


def test_input_errors():
    with pytest.raises(TypeError, match="one-byte"):
        swizzle_128x4(torch.ones(4, 4))
    with pytest.raises(TypeError, match="one-byte"):
        swizzle_128x4(torch.ones(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="cannot hold"):
        unswizzle_128x4(torch.zeros(128, 4, dtype=torch.uint8), 129, 4)
    with pytest.raises(ValueError, match="cannot hold"):
        unswizzle_128x4(torch.zeros(256, 4, dtype=torch.uint8), 100, 4)
