"""A full-size V4-Flash `official` checkpoint, as sparse files (headers real, data all holes): opening it reads
headers only, finds every one of the 69,187 tensors, and inspect counts the published parameters."""

from __future__ import annotations

import json
import re
import struct

import pytest

import ckpt_fixtures as fx
from dsv4.checkpoint.canonical import open_checkpoint
from dsv4.checkpoint.errors import CheckpointError
from dsv4.checkpoint.inspect import inspect_checkpoint
from dsv4.checkpoint.writer import assign_shards, config_json, plan
from dsv4.config import ModelConfig, count_parameters


@pytest.fixture(scope="module")
def flash_dir():
    cfg = ModelConfig.flash()
    out = fx.fresh_dir("flash-sparse")
    shards = assign_shards(plan(cfg, "official"), 4 * 1024**3)
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {}, 0
        for t in shard:
            header[t.key] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
            offset += t.nbytes
            weight_map[t.key] = name
        raw = json.dumps(header).encode()
        with open(out / name, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + offset)  # a hole: no disk space, no data
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(config_json(cfg, "official", "deepseek", None)))
    return out


def test_flash_opens_header_only(flash_dir):
    ckpt = open_checkpoint(flash_dir)
    assert ckpt.dialect == "deepseek" and ckpt.config == ModelConfig.flash()
    assert len(ckpt.sources) == len(ckpt.tensors) == 69_187
    assert ckpt.missing() == [] and ckpt.has_mtp()
    assert sum(t.nbytes for t in ckpt.tensors.values()) == 159_609_485_896
    formats = list(ckpt.formats.values())
    assert formats.count("mxfp4") == (43 + 1) * 256 * 3 and formats.count("fp8") == 43 * 5 + 21 + 43 * 3 + 5 + 3 + 2
    expert = ckpt.tensors["layers.7.ffn.experts.200.w2.weight"]
    assert expert.dtype.itemsize == 1 and expert.shape == (4096, 1024)


def test_flash_inspect_counts_the_parameters(flash_dir):
    report = inspect_checkpoint(flash_dir)
    assert report.ok, report.refusals
    assert report.params_present["main"] == count_parameters(ModelConfig.flash()) == 284_332_240_471
    assert report.params_present["mtp"] == 6_610_048_891


def test_flash_with_a_pro_config_is_refused_with_names(flash_dir):
    pro = fx.fresh_dir("flash-as-pro")
    for f in flash_dir.iterdir():
        (pro / f.name).symlink_to(f)
    (pro / "config.json").unlink()
    (pro / "config.json").write_text(json.dumps(ModelConfig.pro().to_dict()))
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(pro)
    text = str(e.value)
    assert "'layers.0.hc_attn_fn': shape [24, 16384] but config expects [24, 28672]" in text
    assert "model-00001-of-" in text and re.search(r"\.\.\. and \d+ more", text)
