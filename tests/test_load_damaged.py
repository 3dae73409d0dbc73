"""Damaged checkpoints are refused, each with a message naming the tensor, the file or the config key."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ckpt_fixtures
import dsv4
from ckpt_fixtures import drop, rewrite
from dsv4.checkpoint.errors import CheckpointError


@pytest.fixture(scope="module")
def source():
    """make-tiny checkpoints shared with the checkpoint tests (read-only: `rewrite` copies them)."""
    return ckpt_fixtures.tiny


def put(key, value_of):
    def edit(t):
        t[key] = value_of(t)
    return edit


def bad_hash_entry(t):
    t["layers.0.ffn.gate.tid2eid"][3, 1] = 8  # n_routed_experts = 8


def one_expert_from(other: Path):
    def edit(t):
        drop("layers.3.ffn.experts.5.w1.")(t)
        for f in other.glob("*.safetensors"):
            t.update({k: v for k, v in load_file(f).items() if k.startswith("layers.3.ffn.experts.5.w1.")})
    return edit


def more_layers(config):
    config["num_hidden_layers"] += 1
    config["compress_ratios"] = config["compress_ratios"][:-1] + [128, 0]


def no_quantization_config(config):
    del config["quantization_config"], config["expert_dtype"]


CASES = {
    # name: (format, naming, tensor edit, config edit, the message must match)
    "missing tensor": ("official", "deepseek", drop("layers.1.attn.attn_sink"), None,
                       r"missing: 'layers\.1\.attn\.attn_sink'"),
    "missing tensor, hf names": ("official", "hf", drop("model.layers.1.self_attn.sinks"), None,
                                 r"missing: 'model\.layers\.1\.self_attn\.sinks' "
                                 r"\(canonical layers\.1\.attn\.attn_sink\)"),
    "extra tensor": ("official", "deepseek", put("layers.1.attn.extra.weight", lambda t: torch.zeros(3)), None,
                     r"'layers\.1\.attn\.extra\.weight'"),
    "tensor of a layer the config lacks": ("bf16", "deepseek", put("layers.7.attn_norm.weight",
                                                                   lambda t: torch.ones(64)), None,
                                           r"'layers\.7\.attn_norm\.weight'"),
    "transposed weight": ("bf16", "deepseek", put("layers.2.attn.wq_a.weight",
                                                  lambda t: t["layers.2.attn.wq_a.weight"].T.contiguous()), None,
                          r"'layers\.2\.attn\.wq_a\.weight'.*\[64, 32\]"),
    "missing weight_scale_2": ("nvfp4-experts", "deepseek", drop("layers.3.ffn.experts.5.w1.weight_scale_2"), None,
                               r"layers\.3\.ffn\.experts\.5\.w1"),
    "missing expert": ("nvfp4-experts", "deepseek", drop("layers.3.ffn.experts.5."), None,
                       r"missing: 'layers\.3\.ffn\.experts\.5\.w1\.weight'"),
    "tid2eid entry out of range": ("bf16", "deepseek", bad_hash_entry, None,
                                   r"'layers\.0\.ffn\.gate\.tid2eid'.*expert id 8"),
    "config with more layers than the weights": ("bf16", "deepseek", None, more_layers,
                                                 r"num_hidden_layers is 6 .* layers \[5\]"),
    "stacked experts in two formats": ("nvfp4-experts", "deepseek", "mixed", None,
                                       r"layers\.3\.ffn\.experts\.w13 mixes storage formats.*experts\.5\.w1"),
    "4-bit weights but no quantization config": ("official", "deepseek", None, no_quantization_config,
                                                 r"config\.json.*quantization_config"),
}


@pytest.mark.parametrize("case", CASES)
def test_damaged_checkpoint_is_refused_naming_the_culprit(case, source, tmp_path):
    fmt, naming, edit, edit_config, message = CASES[case]
    if edit == "mixed":
        edit = one_expert_from(source("official"))
    broken = rewrite(source(fmt, naming), tmp_path / "broken", edit, edit_config)
    with pytest.raises(CheckpointError, match=message):
        dsv4.load(broken)


def test_truncated_shard_is_refused_naming_the_file(source):
    broken = ckpt_fixtures.copy_checkpoint(source("bf16"), "truncated")
    shard = sorted(broken.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=rf"{shard.name}: truncated"):
        dsv4.load(broken)


def test_the_undamaged_copy_loads(source, tmp_path):
    """The edits above are what breaks each case: the same rewrite without an edit loads."""
    for fmt, naming in {(c[0], c[1]) for c in CASES.values()}:
        dsv4.load(rewrite(source(fmt, naming), tmp_path / f"{fmt}-{naming}"))


def test_audit_names_zero_and_non_finite_parameters(source):
    from dsv4.checkpoint.audit import audit

    model = dsv4.load(source("nvfp4-experts"))
    assert audit(model) == []
    with torch.no_grad():
        model.layers[1].attn.attn_sink.zero_()
        model.layers[2].ffn.gate.bias[3] = float("nan")
        model.layers[3].ffn.experts.w13.weight[5, 1] = 0            # expert 5's w3: every FP4 code 0
        model.layers[4].ffn.experts.w2.input_scale[2] = 0           # unused by weight-only dequantization
        model.layers[0].ffn.gate.tid2eid[7] = torch.tensor([4, 4])
    found = {f.name: f for f in audit(model)}
    assert set(found) == {"layers.1.attn.attn_sink", "layers.2.ffn.gate.bias", "layers.3.ffn.experts.5.w3.weight",
                          "layers.4.ffn.experts.2.w2.input_scale", "layers.0.ffn.gate.tid2eid"}
    assert found["layers.1.attn.attn_sink"].problem == "all zero" and not found["layers.1.attn.attn_sink"].legit
    assert found["layers.2.ffn.gate.bias"].problem == "non-finite"
    assert "FP4 codes" in found["layers.3.ffn.experts.5.w3.weight"].detail
    assert found["layers.4.ffn.experts.2.w2.input_scale"].legit            # explained, not hidden
    assert "token 7" in found["layers.0.ffn.gate.tid2eid"].detail
