import json

import pytest

from dsv4.checkpoint.spec import model_specs
from dsv4.config import ConfigError, ModelConfig, count_parameters

FLASH_PARAMS, PRO_PARAMS = 284_332_240_471, 1_572_997_201_763


def test_presets_have_published_parameter_counts():
    assert count_parameters(ModelConfig.flash()) == FLASH_PARAMS
    assert count_parameters(ModelConfig.pro()) == PRO_PARAMS


def test_spec_matches_closed_form_count():
    from math import prod

    for cfg, n in ((ModelConfig.flash(), FLASH_PARAMS), (ModelConfig.pro(), PRO_PARAMS)):
        specs = model_specs(cfg, include_mtp=False)
        assert sum(prod(s.shape) for s in specs if s.role != "tid2eid") == n


def test_layer_schedules():
    f, p = ModelConfig.flash(), ModelConfig.pro()
    assert [f.layer_type(i)[:3] for i in range(4)] == ["sli", "sli", "com", "hea"]
    assert [p.layer_type(i)[:3] for i in range(4)] == ["hea", "hea", "com", "hea"]
    assert f.compress_ratio(f.num_hidden_layers) == 0 and not f.is_hash_layer(f.num_hidden_layers)
    assert [f.is_hash_layer(i) for i in range(4)] == [True, True, True, False]


def test_hf_style_config_round_trip(tmp_path):
    transformers = pytest.importorskip("transformers")
    for cfg in (ModelConfig.flash(), ModelConfig.pro(), ModelConfig.tiny()):
        hf = transformers.DeepseekV4Config(**cfg.to_hf_dict())
        hf.save_pretrained(tmp_path)
        raw = json.loads((tmp_path / "config.json").read_text())
        assert "compress_ratios" not in raw and "layer_types" in raw
        assert ModelConfig.from_dict(raw) == cfg


def test_deepseek_style_round_trip():
    for cfg in (ModelConfig.flash(), ModelConfig.pro(), ModelConfig.tiny()):
        assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize("change, culprit", [
    ({"compress_ratios": [0, 0, 4]}, "compress_ratios"),
    ({"compress_ratios": [0] * 43 + [7]}, "compress_ratios"),
    ({"some_new_knob": 1}, "some_new_knob"),
    ({"layer_types": ["sliding_attention"] * 42}, "layer_types"),
    ({"mlp_layer_types": ["moe", "hash_moe"] + ["moe"] * 41}, "mlp_layer_types"),
    ({"partial_rotary_factor": 0.25}, "qk_rope_head_dim"),
    ({"model_type": "deepseek_v41"}, "model_type"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"expert_dtype": "fp4", "quantization_config": {"quant_method": "fp8", "expert_dtype": "fp8"}}, "expert_dtype"),
])
def test_bad_configs_name_the_culprit(change, culprit):
    raw = ModelConfig.flash().to_dict() | change
    with pytest.raises(ConfigError, match=culprit):
        ModelConfig.from_dict(raw)


def test_from_json_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json"):
        ModelConfig.from_json(tmp_path)
