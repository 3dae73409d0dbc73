"""The dialect rename tables: every key of every dialect matches exactly one rule, and every rule fires.

Key sets come from real producers where one exists (transformers' state_dict and save_pretrained of the
tiny model, our writer's outputs in every format) and from generated name lists for V4-Flash and V4-Pro.
"""

from __future__ import annotations

from types import MappingProxyType

import pytest
from safetensors import safe_open

import ckpt_fixtures as fx
from dsv4.checkpoint import names
from dsv4.checkpoint.spec import model_specs
from dsv4.checkpoint.writer import FORMATS, plan
from dsv4.config import ModelConfig


def file_keys(folder) -> set[str]:
    keys = set()
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            keys |= set(h.keys())
    return keys


def stacked_keys(cfg: ModelConfig, fmt: str) -> set[str]:
    """hf-stacked names of every tensor of an output format (stacked keys appear once)."""
    return {names.dialect_key(t.canonical, "hf-stacked") for u in plan(cfg, fmt) for t in u.tensors}


@pytest.fixture(scope="module")
def keys_by_dialect() -> dict[str, set[str]]:
    cfg = fx.tiny_config()
    keys: dict[str, set[str]] = {d: set() for d in names.DIALECTS}
    keys["hf-saved"] |= file_keys(fx.hf_saved())
    keys["hf-stacked"] |= file_keys(fx.hf_stacked())
    for fmt in FORMATS:
        keys["deepseek"] |= file_keys(fx.tiny(fmt, "deepseek"))
        keys["hf-saved" if fmt == "bf16" else "hf-experts"] |= file_keys(fx.tiny(fmt, "hf"))
    # transformers cannot save a quantized stacked model on CPU: generated names (FP8 `_scale_inv` experts)
    keys["hf-stacked"] |= stacked_keys(cfg, "official")
    # FP8 scales under transformers' name are accepted in every dialect.
    for dialect in names.DIALECTS:
        keys[dialect] |= {k[: -len("scale")] + "weight_scale_inv" for k in keys[dialect]
                          if k.endswith(".scale") and "_hc." not in k}
    return keys


def test_real_transformers_keys_are_what_the_dialects_say(keys_by_dialect):
    saved = file_keys(fx.hf_saved())
    # transformers undoes its `.norm. -> .kv_norm.` rename when saving: the attention kv_norm comes out as
    # `attn.norm`, embed and head keep HF-ish names, the rest is DeepSeek's names under `model.`.
    assert "model.layers.0.attn.norm.weight" in saved and "model.layers.0.attn.kv_norm.weight" not in saved
    assert {"model.embed_tokens.weight", "head.weight", "model.norm.weight", "model.hc_head.hc_fn"} <= saved
    assert "model.layers.0.ffn.experts.7.w3.weight" in saved
    assert not any(k.startswith("mtp.") for k in saved)
    stacked = file_keys(fx.hf_stacked())
    assert "model.layers.0.mlp.experts.gate_up_proj" in stacked and "lm_head.weight" in stacked


@pytest.mark.parametrize("dialect", names.DIALECTS)
def test_every_key_matches_exactly_one_rule_and_every_rule_fires(keys_by_dialect, dialect):
    renamer = names.Renamer(dialect)
    fired = set()
    for key in sorted(keys_by_dialect[dialect]):
        hits = [r for r in names.RULES[dialect] if r.regex.match(key)]  # unmemoised: the real count
        assert len(hits) == 1, f"{key!r}: {[str(r) for r in hits]}"
        assert renamer.match(key).rule is hits[0]
        fired.add(hits[0])
    silent = [str(r) for r in names.RULES[dialect] if r not in fired]
    assert not silent, f"rules that never fired: {silent}"


@pytest.mark.parametrize("dialect", names.DIALECTS)
def test_keys_rename_to_exactly_the_canonical_tensors(dialect):
    """A dialect's keys for the tiny model rename onto exactly the canonical names they stand for."""
    cfg = fx.tiny_config()
    if dialect == "hf-experts":  # the quantized per-expert dialect: companions (.scale) included
        want = {t.canonical for u in plan(cfg, "official", "hf") for t in u.tensors}
    else:
        want = {s.name for s in model_specs(cfg)}
    keys = {names.dialect_key(name, dialect) for name in want}
    renamer = names.Renamer(dialect)
    got = set()
    for key in keys:
        m = renamer.match(key)
        if m.rule.transform == names.SPLIT_GATE_UP:
            got |= {m.canonical(expert=str(e), w13=w) for e in range(cfg.n_routed_experts) for w in ("w1", "w3")}
        elif m.rule.transform == names.SPLIT_EXPERTS:
            got |= {m.canonical(expert=str(e)) for e in range(cfg.n_routed_experts)}
        else:
            got.add(m.canonical())
    assert got == want
    if dialect == "hf-stacked":
        assert len(keys) < len(want)  # the experts really were stacked


@pytest.mark.parametrize("cfg_name", ["flash", "pro"])
def test_flash_and_pro_name_lists(cfg_name):
    """Generated names of the big models: each matches one rule and renames back to its canonical name."""
    cfg = getattr(ModelConfig, cfg_name)()
    cases = [("official", "deepseek", "deepseek")]
    if cfg_name == "flash":
        cases += [("nvfp4", "hf", "hf-experts"), ("bf16", "hf", "hf-saved")]
    for fmt, naming, dialect in cases:
        renamer = names.Renamer(dialect)
        keys = []
        for unit in plan(cfg, fmt, naming):
            for t in unit.tensors:
                assert renamer.match(t.key).canonical() == t.canonical
                keys.append(t.key)
        # the memo by numeric shape gives the same answer as matching every rule
        for key in sorted(keys)[::211]:
            assert renamer.candidates(key) == tuple(r for r in names.RULES[dialect] if r.regex.match(key))
    if cfg_name == "flash":
        renamer = names.Renamer("hf-stacked")
        for key in stacked_keys(cfg, "official"):
            assert len(renamer.candidates(key)) == 1, key


def test_two_matching_rules_are_an_error_naming_both(monkeypatch):
    clash = names.Rule("deepseek", "layers.{layer}.attn.wq_a.{leaf}", "layers.{layer}.attn.wq_b.{leaf}")
    monkeypatch.setattr(names, "RULES", MappingProxyType({**names.RULES, "deepseek": names.RULES["deepseek"] + (clash,)}))
    with pytest.raises(ValueError) as e:
        names.Renamer("deepseek").match("layers.3.attn.wq_a.weight")
    assert "matches 2 rules" in str(e.value)
    assert "layers.{layer}.attn.wq_a.{leaf} -> layers.{layer}.attn.wq_b.{leaf}" in str(e.value)
    assert "layers.{layer}.attn.{attnlin}.{leaf}" in str(e.value)


def test_unmatched_and_unknown():
    assert names.Renamer("deepseek").match("layers.3.attn.wq_c.weight") is None
    assert names.Renamer("hf-saved").match("model.layers.3.attn.kv_norm.weight") is None  # hf-saved spells it attn.norm
    with pytest.raises(ValueError):
        names.Renamer("vllm")


def test_dialect_detection_markers():
    assert names.detect_dialect(["embed.weight", "layers.0.attn.wq_a.weight"]) == ["deepseek"]
    assert names.detect_dialect(["model.layers.0.mlp.experts.gate_up_proj"]) == ["hf-stacked"]
    assert names.detect_dialect(["model.layers.0.mlp.experts.3.up_proj.weight"]) == ["hf-experts"]
    assert names.detect_dialect(["model.layers.0.attn.wq_a.weight"]) == ["hf-saved"]
    assert names.detect_dialect(["mtp.0.e_proj.weight", "lm_head.weight"]) == []


def test_rule_counts_are_stable():
    # A changed count must be a deliberate table change (update the report in docs if it is).
    assert names.rule_count() == {"deepseek": 38, "hf-stacked": 49, "hf-experts": 48, "hf-saved": 38}
