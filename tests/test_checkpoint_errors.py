"""Bad input is refused with an error that names the file and the tensor; nothing is skipped silently."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import ckpt_fixtures as fx
from dsv4.checkpoint.canonical import open_checkpoint
from dsv4.checkpoint.convert import convert_checkpoint
from dsv4.checkpoint.errors import CheckpointError
from dsv4.checkpoint.reader import INDEX_NAME


def tensors_of(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out |= {k: h.get_tensor(k) for k in h.keys()}
    return out


def single_file(name: str, tensors: dict[str, torch.Tensor], config_from: Path | None = None) -> Path:
    """A one-shard checkpoint holding `tensors`, with the tiny config.json."""
    out = fx.fresh_dir(name)
    save_file(tensors, out / "model.safetensors")
    (out / "config.json").write_text(((config_from or fx.tiny()) / "config.json").read_text())
    return out


def refused(path: Path, *fragments: str) -> str:
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(path)
    text = str(e.value)
    for f in fragments:
        assert f in text, f"{f!r} not in:\n{text}"
    return text


def test_unknown_dialect():
    out = single_file("unknown", {"transformer.h.0.attn.c_attn.weight": torch.zeros(4, 4)})
    refused(out, "unknown checkpoint dialect", str(out / "model.safetensors"), "transformer.h.0.attn.c_attn.weight")


def test_mixed_dialects():
    t = tensors_of(fx.tiny())
    t["model.layers.0.attn.wq_a.weight"] = t["layers.0.attn.wq_a.weight"].clone()
    out = single_file("mixed", t)
    refused(out, "several dialects", "'layers.0.", "'model.layers.0.attn.wq_a.weight'", "hf-saved", "deepseek")


def test_key_matching_no_rule():
    t = tensors_of(fx.tiny())
    t["layers.0.attn.wq_c.weight"] = torch.zeros(2, 2, dtype=torch.bfloat16)
    out = single_file("norule", t)
    refused(out, str(out / "model.safetensors"), "'layers.0.attn.wq_c.weight'", "matches no rule of dialect 'deepseek'")


def test_tensor_the_config_does_not_have():
    t = tensors_of(fx.tiny())
    t["layers.7.attn.wq_a.weight"] = t["layers.0.attn.wq_a.weight"].clone()  # tiny has 5 layers
    t["layers.0.attn.compressor.ape"] = torch.zeros(4, 128)  # layer 0 is sliding-only: no compressor
    out = single_file("extra", t)
    text = refused(out, "'layers.7.attn.wq_a.weight'", "'layers.0.attn.compressor.ape'", "no tensor of this name")
    assert "2 problems" in text


def test_dtype_and_shape_disagreeing_with_the_config():
    t = tensors_of(fx.tiny())
    t["layers.1.attn_norm.weight"] = t["layers.1.attn_norm.weight"].to(torch.int64)
    t["layers.2.ffn.experts.3.w2.weight"] = t["layers.2.ffn.experts.3.w2.weight"][:, :16].contiguous()
    t["layers.0.ffn.gate.tid2eid"] = t["layers.0.ffn.gate.tid2eid"].float()
    out = single_file("dtype-shape", t)
    file = str(out / "model.safetensors")
    text = refused(out, file, "'layers.1.attn_norm.weight'", "torch.int64", "'layers.2.ffn.experts.3.w2.weight'",
                   "[64, 16]", "[64, 32]", "'layers.0.ffn.gate.tid2eid'")
    assert text.count(file) >= 3


def test_config_json_disagreeing_with_the_tensors():
    out = fx.copy_checkpoint(fx.tiny(), "other-config")
    cfg = json.loads((out / "config.json").read_text())
    cfg["moe_intermediate_size"] = 48
    (out / "config.json").write_text(json.dumps(cfg))
    refused(out, "'layers.0.ffn.experts.0.w1.weight'", "[32, 64]", "[48, 64]", "model-0000")


def test_quantized_linear_missing_its_scale():
    t = tensors_of(fx.tiny("official"))
    del t["layers.2.attn.wq_a.scale"]
    out = single_file("noscale", t, fx.tiny("official"))
    refused(out, "'layers.2.attn.wq_a.weight'", "layers.2.attn.wq_a", "none of the formats", "float8_e4m3fn")


def test_duplicate_canonical_names():
    t = tensors_of(fx.tiny("official"))
    t["layers.2.attn.wq_a.weight_scale_inv"] = t["layers.2.attn.wq_a.scale"].clone()
    out = single_file("duplicate", t, fx.tiny("official"))
    refused(out, "'layers.2.attn.wq_a.weight_scale_inv'", "'layers.2.attn.wq_a.scale'",
            "both give canonical tensor 'layers.2.attn.wq_a.scale'")


def test_stored_twice_across_shards_and_stray_shards():
    out = fx.copy_checkpoint(fx.tiny(), "twice")
    first = sorted(out.glob("model-*.safetensors"))[-1]
    head_file = json.loads((out / INDEX_NAME).read_text())["weight_map"]["head.weight"]
    assert first.name != head_file
    tensors = tensors_of_file(first) | {"head.weight": torch.zeros(512, 64, dtype=torch.bfloat16)}
    save_file(tensors, first)
    refused(out, "'head.weight'", "stored twice", first.name, head_file)
    out = fx.copy_checkpoint(fx.tiny(), "stray")
    save_file({"embed.weight": torch.zeros(512, 64, dtype=torch.bfloat16)}, out / "model-extra.safetensors")
    refused(out, "model-extra.safetensors", "the index does not mention")


def tensors_of_file(file: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(file), "pt") as h:
        return {k: h.get_tensor(k) for k in h.keys()}


def test_truncated_shard_detected_at_open():
    out = fx.copy_checkpoint(fx.tiny(), "truncated")
    shard = sorted(out.glob("model-*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    text = refused(out, str(shard), "truncated")
    assert re.search(r"tensor '[^']+' ends at data byte", text)


def test_unreadable_shards():
    out = fx.copy_checkpoint(fx.tiny(), "garbage")
    shard = sorted(out.glob("model-*.safetensors"))[0]
    shard.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!" + b"\0" * 64)
    refused(out, str(shard), "not valid JSON")
    shard.write_bytes(b"abc")
    refused(out, str(shard), "not a safetensors file")
    shard.write_bytes(b"\xff" * 64)
    refused(out, str(shard), "header length")


def test_index_and_shards_disagree():
    out = fx.copy_checkpoint(fx.tiny(), "index-missing-shard")
    shard = sorted(out.glob("model-*.safetensors"))[2]
    shard.unlink()
    refused(out, str(out / INDEX_NAME), shard.name, "does not exist")
    out = fx.copy_checkpoint(fx.tiny(), "index-missing-key")
    index = json.loads((out / INDEX_NAME).read_text())
    index["weight_map"]["layers.9.attn.wq_a.weight"] = next(iter(index["weight_map"].values()))
    (out / INDEX_NAME).write_text(json.dumps(index))
    refused(out, str(out / INDEX_NAME), "'layers.9.attn.wq_a.weight'", "no shard holds it")
    out = fx.copy_checkpoint(fx.tiny(), "index-short")
    index = json.loads((out / INDEX_NAME).read_text())
    del index["weight_map"]["head.weight"]
    (out / INDEX_NAME).write_text(json.dumps(index))
    refused(out, "'head.weight'", "missing from the index")


def test_many_shards_without_an_index():
    out = fx.copy_checkpoint(fx.tiny(), "no-index")
    (out / INDEX_NAME).unlink()
    refused(out, "safetensors files but no model.safetensors.index.json")


def test_bad_config_json():
    out = fx.copy_checkpoint(fx.tiny(), "bad-config")
    cfg = json.loads((out / "config.json").read_text())
    cfg["compress_ratios"] = [0, 0, 4, 64, 4, 0]
    (out / "config.json").write_text(json.dumps(cfg))
    refused(out, "config.json", "compress_ratios")
    (out / "config.json").unlink()
    refused(out, "config.json")


def test_convert_refuses_a_model_with_missing_tensors():
    t = tensors_of(fx.tiny())
    del t["layers.3.attn.compressor.ape"]
    out = single_file("missing", t)
    open_checkpoint(out)  # opening is fine: the loader or converter decides what is required
    with pytest.raises(CheckpointError) as e:
        convert_checkpoint(out, fx.fresh_dir("missing-out"), fmt="bf16")
    assert "layers.3.attn.compressor.ape" in str(e.value) and "missing" in str(e.value)
    t = tensors_of(fx.tiny())
    del t["mtp.0.e_proj.weight"]
    out = single_file("partial-mtp", t)
    with pytest.raises(CheckpointError) as e:
        convert_checkpoint(out, fx.fresh_dir("partial-mtp-out"), fmt="bf16")
    assert "mtp.0.e_proj.weight" in str(e.value) and "MTP block is incomplete" in str(e.value)


def test_convert_does_not_overwrite_by_accident():
    out = fx.copy_checkpoint(fx.tiny(), "occupied")
    with pytest.raises(CheckpointError) as e:
        convert_checkpoint(fx.tiny(), out, fmt="bf16")
    assert "already holds a checkpoint" in str(e.value)
    with pytest.raises(CheckpointError):
        convert_checkpoint(out, out, fmt="bf16", overwrite=True)
    report = convert_checkpoint(fx.tiny(), out, fmt="official", overwrite=True)
    assert open_checkpoint(out).formats["layers.0.attn.wq_a"] == "fp8" and report.shards == 1


def test_a_failed_conversion_leaves_no_shards():
    t = tensors_of(fx.tiny())
    t["layers.4.attn.wq_b.weight"] = torch.full_like(t["layers.4.attn.wq_b.weight"], float("nan"))
    src = single_file("nan", t)
    out = fx.fresh_dir("nan-out")
    with pytest.raises(ValueError):
        convert_checkpoint(src, out, fmt="official", shard_bytes=fx.SMALL_SHARD)
    assert not list(out.glob("*.safetensors")) and not (out / INDEX_NAME).exists()
