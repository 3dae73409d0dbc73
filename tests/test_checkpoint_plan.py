"""The output plans in closed form: counts, bytes, names, dtypes and shapes, with no data written.

Oracle: the published V4-Flash safetensors index (69,187 tensors, 159,609,485,896 bytes) and its shard-2
header, as quoted in dsv4-architecture.md §16.1.
"""

from __future__ import annotations

from collections import Counter

import pytest

from dsv4.checkpoint.writer import assign_shards, plan, plan_totals
from dsv4.config import ModelConfig


@pytest.fixture(scope="module")
def flash_official():
    units = plan(ModelConfig.flash(), "official")
    return units, {t.key: t for u in units for t in u.tensors}


def test_official_flash_matches_the_published_index(flash_official):
    units, _ = flash_official
    assert plan_totals(units) == (69_187, 159_609_485_896)


def test_official_flash_dtypes_and_shapes(flash_official):
    _, by_key = flash_official

    def spec(key):
        t = by_key[key]
        return t.dtype, list(t.shape)

    assert spec("layers.2.attn.attn_sink") == ("F32", [64])
    assert spec("layers.2.hc_attn_fn") == ("F32", [24, 16384])
    assert spec("layers.2.ffn.experts.0.w1.weight") == ("I8", [2048, 2048])
    assert spec("layers.2.ffn.experts.0.w1.scale") == ("F8_E8M0", [2048, 128])
    assert spec("layers.2.ffn.experts.0.w2.weight") == ("I8", [4096, 1024])
    assert spec("layers.2.ffn.shared_experts.w1.weight") == ("F8_E4M3", [2048, 4096])
    assert spec("layers.2.ffn.shared_experts.w1.scale") == ("F8_E8M0", [16, 32])
    assert spec("layers.2.attn.wq_b.scale") == ("F8_E8M0", [256, 8])
    assert spec("layers.2.attn.wo_a.weight") == ("F8_E4M3", [8192, 4096])
    assert spec("layers.2.attn.compressor.wkv.weight") == ("BF16", [1024, 4096])
    assert spec("layers.3.attn.compressor.ape") == ("F32", [128, 512])
    assert spec("layers.2.attn.indexer.wq_b.scale") == ("F8_E8M0", [64, 8])
    assert spec("layers.2.attn.indexer.weights_proj.weight") == ("BF16", [64, 4096])
    assert spec("layers.0.ffn.gate.tid2eid") == ("I64", [129280, 6])
    assert spec("layers.3.ffn.gate.bias") == ("F32", [256])
    assert spec("mtp.0.e_proj.scale") == ("F8_E8M0", [32, 32])
    assert spec("mtp.0.ffn.gate.bias") == ("F32", [256])
    assert spec("embed.weight") == spec("head.weight") == ("BF16", [129280, 4096])


def test_official_flash_counts(flash_official):
    _, by_key = flash_official
    count = Counter()
    for key in by_key:
        parts = key.split(".")
        if key.endswith("attn.compressor.ape") and parts[0] == "layers":
            count["compressor"] += 1
        if key.endswith("attn.indexer.wq_b.weight"):
            count["indexer"] += 1
        if key.endswith("tid2eid"):
            count["tid2eid"] += 1
        if key.endswith("ffn.gate.bias") and parts[0] == "layers":
            count["gate.bias"] += 1
        if parts[0] == "layers" and parts[3:4] == ["experts"] and key.endswith("w1.weight"):
            count["experts"] += 1
    assert count == {"compressor": 41, "indexer": 21, "tid2eid": 3, "gate.bias": 40, "experts": 11008}
    assert "mtp.0.ffn.gate.tid2eid" not in by_key and "mtp.0.attn.compressor.ape" not in by_key


def test_nvfp4_experts_flash_layout():
    units = plan(ModelConfig.flash(), "nvfp4-experts")
    by_key = {t.key: t for u in units for t in u.tensors}
    assert (by_key["layers.5.ffn.experts.7.w3.weight"].dtype, by_key["layers.5.ffn.experts.7.w3.weight"].shape) == \
        ("U8", (2048, 2048))
    assert by_key["layers.5.ffn.experts.7.w3.weight_scale"].dtype == "F8_E4M3"
    assert by_key["layers.5.ffn.experts.7.w3.weight_scale"].shape == (2048, 256)
    assert by_key["layers.5.ffn.experts.7.w3.weight_scale_2"].shape == ()
    assert by_key["layers.5.ffn.experts.7.w3.input_scale"].dtype == "F32"
    assert by_key["layers.5.attn.wq_a.scale"].dtype == "F8_E8M0"  # the rest stays official
    # NVIDIA's sizes: ~164-168 GB, more than the original (block-16 E4M3 scales take twice the bytes)
    assert 164e9 < plan_totals(units)[1] < 169e9


def test_nvfp4_all_linears():
    units = plan(ModelConfig.tiny(), "nvfp4", "hf")
    storage = {t.key: u.storage for u in units for t in u.tensors}
    assert storage["model.layers.2.self_attn.compressor.indexer.scorer.weights_proj.weight"] == "nvfp4"
    assert storage["model.layers.2.self_attn.q_a_proj.weight_scale_2"] == "nvfp4"
    assert storage["model.layers.2.mlp.shared_experts.down_proj.input_scale"] == "nvfp4"
    assert storage["mtp.0.e_proj.weight_scale"] == "nvfp4"
    for bf16 in ("model.layers.2.self_attn.compressor.kv_proj.weight", "model.layers.2.mlp.gate.weight",
                 "model.embed_tokens.weight", "lm_head.weight"):
        assert storage[bf16] == "bf16"


def test_shards_respect_the_size_and_keep_everything():
    units = plan(ModelConfig.tiny(), "official")
    shards = assign_shards(units, 100_000)
    assert len(shards) > 5
    assert [t for s in shards for t in s] == [t for u in units for t in u.tensors]
    for shard in shards:
        assert sum(t.nbytes for t in shard) <= 100_000 or len(shard) == 1
