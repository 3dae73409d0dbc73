"""Dummy weights (`checkpoint.dummy`): every linear stored as the writer stores it in each format (checked against
a real tiny checkpoint of that format, loaded by the loader), values of the role's scale so that the SwiGLU clamp
fires and logits stay finite, reproducible from the seed."""

import pytest
import torch

import ckpt_fixtures as fx
import dsv4
from dsv4.checkpoint.dummy import dummy_model
from dsv4.checkpoint.tiny import W13_GAIN
from dsv4.config import ConfigError, ModelConfig
from dsv4.model import QLinear

FORMATS = ("bf16", "official", "nvfp4-experts", "nvfp4")


def linear_formats(model) -> dict[str, str]:
    return {path: m.format.fmt for path, m in model.named_modules()
            if isinstance(m, QLinear) and not path.startswith("mtp.")}


@pytest.mark.parametrize("fmt", FORMATS)
def test_storage_is_the_writers_and_logits_are_finite(fmt):
    model = dummy_model(ModelConfig.tiny(), fmt, dtype=torch.float32)
    written = dsv4.load(fx.tiny(fmt))                 # the writer's layout, through the loader
    assert linear_formats(model) == linear_formats(written)
    assert len(model.mtp) == 0
    with torch.inference_mode():
        logits = model.logits(torch.randint(2, 512, (2, 40), generator=torch.Generator().manual_seed(0)))
    assert torch.isfinite(logits).all() and 0.2 < float(logits.std()) < 20


@pytest.mark.parametrize("fmt", FORMATS)
def test_expert_weights_have_their_scale_and_the_swiglu_clamp_fires(fmt):
    cfg = ModelConfig.tiny(hidden_size=256, moe_intermediate_size=256)
    experts = dummy_model(cfg, fmt, dtype=torch.float32).layers[2].ffn.experts
    w13 = experts.w13.qweight().dequantize()           # [E, 2, I, d]
    want = W13_GAIN / cfg.hidden_size ** 0.5
    assert want / 2 ** 0.5 <= float(w13.std()) <= want * 2 ** 0.5
    if fmt in ("bf16", "nvfp4-experts", "nvfp4"):      # dense and NVFP4 draw the role's std exactly
        assert float(w13.std()) == pytest.approx(want, rel=0.03)
    x = torch.randn(512, cfg.hidden_size, generator=torch.Generator().manual_seed(1))   # RMS-normalised inputs
    gate = torch.einsum("td,eid->eti", x, w13[:, 0])
    fired = float((gate > cfg.swiglu_limit).float().mean())
    assert 0.02 < fired < 0.3, fired


def test_reproducible_from_the_seed_and_refuses_unknown_formats():
    a, b, c = (dummy_model(ModelConfig.tiny(), "official", seed=s).state_dict() for s in (3, 3, 4))
    assert all(torch.equal(a[k].view(torch.uint8) if a[k].dtype.itemsize == 1 else a[k],
                           b[k].view(torch.uint8) if b[k].dtype.itemsize == 1 else b[k]) for k in a)
    assert not torch.equal(a["layers.0.attn.wq_a.weight"].float(), c["layers.0.attn.wq_a.weight"].float())
    with pytest.raises(ValueError, match="unknown dummy weight format 'fp4'; expected one of"):
        dummy_model(ModelConfig.tiny(), "fp4")


def test_presets_and_layer_counts():
    cfg = ModelConfig.preset("V4-Flash").with_layers(4)
    assert (cfg.num_hidden_layers, cfg.compress_ratios, cfg.num_hash_layers) == (4, (0, 0, 4, 128, 0), 3)
    assert ModelConfig.preset("v4_pro").hidden_size == 7168
    with pytest.raises(ConfigError, match="unknown model preset 'v5'"):
        ModelConfig.preset("v5")
    with pytest.raises(ConfigError, match=r"num_hidden_layers override 44 not in \[1, 43\]"):
        ModelConfig.flash().with_layers(44)
