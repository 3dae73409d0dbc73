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


def test_biased_layers_spread_a_batch_over_as_many_experts_as_random_routing():
    """A trained model's selection bias balances the experts' load; a dummy's must not concentrate a batch on a few
    experts either, or the benchmarks at 64-256 tokens read fewer expert bytes than a real model's step does."""
    cfg = ModelConfig.tiny(n_routed_experts=256, num_experts_per_tok=6, hidden_size=256)
    model = dummy_model(cfg, "nvfp4-experts", dtype=torch.float32)
    E, k, T = cfg.n_routed_experts, cfg.num_experts_per_tok, 64
    expected = E * (1 - (1 - k / E) ** T)                   # distinct experts of T uniformly random routings: 200
    x = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(2))   # RMS-normalised inputs
    for i in range(cfg.num_hash_layers, cfg.num_hidden_layers):
        _, ids = model.layers[i].ffn.route(x, None)
        assert int(ids.unique().numel()) >= 0.9 * expected, (i, int(ids.unique().numel()), expected)


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


def test_llm_with_dummy_weights():
    """LLM(load_format="dummy"): a preset or a checkpoint's config, hf_overrides applied, weights drawn from the seed
    (the same seed gives the same greedy tokens), no weight read; bad overrides refused naming them."""
    import dsv4
    from dsv4.config import ConfigError

    def tokens(**kw):
        llm = dsv4.LLM("tiny", skip_tokenizer_init=True, progress=False, **kw)
        return llm, llm.generate([[5, 6, 7]], dsv4.SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].token_ids

    llm, a = tokens(hf_overrides={"num_hidden_layers": 3}, load_format="dummy-official")
    assert llm.model.config.num_hidden_layers == 3 and llm.model.layers[0].attn.wq_a.format.fmt == "fp8"
    assert tokens(hf_overrides={"num_hidden_layers": 3}, load_format="dummy-official")[1] == a
    assert tokens(hf_overrides={"num_hidden_layers": 3}, load_format="dummy-official", seed=1)[1] != a
    default, _ = tokens(hf_overrides={"num_hidden_layers": 3}, load_format="dummy")
    assert default.model.layers[0].ffn.experts.w13.format.fmt == "nvfp4"       # NVIDIA's NVFP4-experts layout
    with pytest.raises(ValueError, match=r"unknown load_format 'dummy-fp4'; expected 'auto', 'dummy' or one of"):
        dsv4.LLM("tiny", load_format="dummy-fp4")
    folder = dsv4.LLM(fx.tiny(), load_format="dummy", skip_tokenizer_init=True, progress=False)
    assert folder.model.config == ModelConfig.from_json(fx.tiny() / "config.json")
    with pytest.raises(ConfigError, match=r"hf_overrides: \['layers'\] are not config fields"):
        dsv4.LLM("tiny", load_format="dummy", hf_overrides={"layers": 2})
    with pytest.raises(ValueError, match="hf_overrides applies to load_format='dummy' only"):
        dsv4.LLM(fx.tiny(), hf_overrides={"num_hidden_layers": 2})
    with pytest.raises(ValueError, match="unknown load_format 'fast'"):
        dsv4.LLM("tiny", load_format="fast")
