"""QWeight: layout validation at construction and per-shard scales of stacked weights."""

import pytest
import torch

from dsv4.formats import QWeight, quantize_fp8_block, quantize_mxfp4, quantize_nvfp4


def _nvfp4_stack(ws):
    """Two shards (w1, w3) stacked on a leading dim of 2, each with its own weight_scale_2."""
    parts = [quantize_nvfp4(w) for w in ws]
    return QWeight("nvfp4", torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]),
                   torch.stack([p[2] for p in parts]), torch.ones(2)), parts


def test_stacked_nvfp4_uses_each_shards_weight_scale_2():
    w1, w3 = torch.randn(8, 32), torch.randn(8, 32) * 50  # very different global scales
    q, parts = _nvfp4_stack([w1, w3])
    deq = q.dequantize()
    for i, (w, p) in enumerate(zip((w1, w3), parts)):
        single = QWeight("nvfp4", *p).dequantize()
        assert torch.equal(deq[i], single)
        assert (single - w).abs().max() <= w.abs().max() / 6  # a dropped scale_2 would be off by ~50x
    assert q.leading == (2,) and q.out_features == 8 and q.in_features == 32


@pytest.mark.parametrize("fmt", ["dense", "fp8", "mxfp4", "nvfp4"])
def test_each_format_dequantizes_close_to_the_source(fmt):
    w = torch.randn(3, 130, 64)
    if fmt == "dense":
        q = QWeight("dense", w.bfloat16())
    elif fmt == "fp8":
        q = QWeight("fp8", *quantize_fp8_block(w))
    elif fmt == "mxfp4":
        q = QWeight("mxfp4", *quantize_mxfp4(w))
    else:
        packed, ws, _ = quantize_nvfp4(w, 1e-3)
        q = QWeight("nvfp4", packed, ws, torch.full((3,), 1e-3))
    assert q.dequantize().shape == w.shape and q.in_features == 64
    rel = (q.dequantize() - w).norm() / w.norm()
    assert rel < {"dense": 0.01, "fp8": 0.05, "mxfp4": 0.2, "nvfp4": 0.2}[fmt]
    assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16


def test_construction_refuses_layouts_that_disagree():
    packed, ws, ws2 = quantize_nvfp4(torch.randn(4, 32))
    with pytest.raises(ValueError, match="unknown weight format"):
        QWeight("int4", packed)
    with pytest.raises(ValueError, match="weight must be"):
        QWeight("nvfp4", packed.view(torch.int8), ws, ws2)
    with pytest.raises(ValueError, match="scale must be one of"):
        QWeight("nvfp4", packed, ws.float(), ws2)
    with pytest.raises(ValueError, match="scale must have shape"):
        QWeight("nvfp4", packed, ws[:, :1], ws2)
    with pytest.raises(ValueError, match="scale_2 must have shape"):
        QWeight("nvfp4", packed, ws)
    with pytest.raises(ValueError, match="scale_2 must be float32"):
        QWeight("nvfp4", packed, ws, ws2.double())
    with pytest.raises(ValueError, match="input_scale must have shape"):
        QWeight("nvfp4", packed, ws, ws2, torch.ones(1))
    with pytest.raises(ValueError, match="has no scale_2"):
        QWeight("fp8", *quantize_fp8_block(torch.randn(4, 32)), ws2)
    with pytest.raises(ValueError, match="has no scale"):
        QWeight("dense", torch.randn(4, 32), ws)
    with pytest.raises(ValueError, match="floating point"):
        QWeight("dense", torch.ones(4, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\[\*L, N, K\]"):
        QWeight("dense", torch.ones(4))
    with pytest.raises(ValueError, match="not a multiple of 32"):
        QWeight("mxfp4", torch.zeros(4, 8, dtype=torch.uint8), torch.ones(4, 0).to(torch.float8_e8m0fnu))
    stacked, _ = _nvfp4_stack([torch.randn(4, 32)] * 2)
    with pytest.raises(ValueError, match=r"scale_2 must have shape \(2,\)"):
        QWeight("nvfp4", stacked.weight, stacked.scale, stacked.scale_2[0])  # one shard's scale for both
    assert QWeight("nvfp4", packed, ws, ws2).input_scale is None  # W4A16 checkpoints have none
