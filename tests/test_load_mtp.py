"""The MTP block (`mtp.*`), in every layout: wholly absent, the model loads without it and says so once; held in
part (a block in part, or one block of two), the checkpoint is refused naming the missing tensors.

Quantized and converted V4 checkpoints often drop the MTP block (transformers ignores it). Layouts: DeepSeek's
release (`official`), NVIDIA's NVFP4 builds (`nvfp4-experts`, DeepSeek names) and the same under transformers
module names.
"""

from __future__ import annotations

import logging
from functools import cache

import pytest
import torch

import ckpt_fixtures as fx
import dsv4
from ckpt_fixtures import drop, rewrite
from dsv4.checkpoint.audit import audit
from dsv4.checkpoint import names
from dsv4.checkpoint.canonical import NO_MTP, NO_MTP_NOTE, open_checkpoint
from dsv4.checkpoint.convert import convert_checkpoint
from dsv4.checkpoint.errors import CheckpointError
from dsv4.checkpoint.inspect import inspect_checkpoint
from dsv4.checkpoint.tiny import make_tiny
from dsv4.config import ModelConfig

LAYOUTS = {"deepseek": ("official", "deepseek"), "nvidia": ("nvfp4-experts", "deepseek"),
           "nvidia, hf names": ("nvfp4-experts", "hf")}
LOGGER = "dsv4.checkpoint.loader"


@cache
def two_mtp_blocks(fmt: str, naming: str):
    """make-tiny with num_nextn_predict_layers = 2 (blocks mtp.0 and mtp.1)."""
    cfg = ModelConfig.tiny(num_nextn_predict_layers=2, compress_ratios=(0, 0, 4, 128, 4, 0, 0))
    out = fx.workdir() / f"tiny-2mtp-{fmt}-{naming}"
    make_tiny(out, fmt=fmt, naming=naming, cfg=cfg, shard_bytes=fx.SMALL_SHARD)
    return out


def mtp_notes(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and NO_MTP in r.getMessage()]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_without_its_mtp_block_the_model_loads_and_says_so_once(layout, tmp_path, caplog):
    fmt, naming = LAYOUTS[layout]
    src = fx.tiny(fmt, naming)
    dst = rewrite(src, tmp_path / "no-mtp", drop("mtp."))
    ids = torch.randint(0, fx.tiny_config().vocab_size, (1, 140), generator=torch.Generator().manual_seed(2))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        full = dsv4.load(src)
        model = dsv4.load(dst)
    assert mtp_notes(caplog) == [f"{dst}: {NO_MTP_NOTE}"]            # this load, once; none for the full one
    assert len(model.mtp) == 0 and len(full.mtp) == 1
    assert torch.equal(model.logits(ids), full.logits(ids))          # the main model is untouched
    assert [(f.problem, f.legit) for f in audit(model)] == [(NO_MTP, True)]

    report = inspect_checkpoint(dst, audit=True)
    assert report.ok, report.refusals
    assert report.render().count(NO_MTP) == 1 and NO_MTP_NOTE in report.notes
    assert report.audit == "1 finding(s), 0 refused"

    out = convert_checkpoint(dst, tmp_path / "converted", fmt="bf16")
    assert any(NO_MTP_NOTE in n for n in out.notes) and not open_checkpoint(tmp_path / "converted").has_mtp()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_mtp_block_held_in_part_is_refused_naming_what_is_missing(layout, tmp_path, caplog):
    fmt, naming = LAYOUTS[layout]
    dst = rewrite(fx.tiny(fmt, naming), tmp_path / "part-mtp", drop("mtp.0.e_proj.", "mtp.0.ffn.experts.3."))
    with caplog.at_level(logging.INFO, logger=LOGGER), pytest.raises(CheckpointError) as e:
        dsv4.load(dst)
    text = str(e.value)
    assert "the MTP block is incomplete" in text
    dialect = open_checkpoint(dst).dialect
    for name in ("mtp.0.e_proj.weight", "mtp.0.ffn.experts.3.w1.weight", "mtp.0.ffn.experts.3.w2.scale"):
        assert f"missing: '{names.dialect_key(name, dialect)}'" in text, name
    assert mtp_notes(caplog) == []

    report = inspect_checkpoint(dst)
    assert not report.ok and NO_MTP_NOTE not in report.notes
    assert any("the MTP block is incomplete" in r and "mtp.0.e_proj.weight" in r for r in report.refusals)
    with pytest.raises(CheckpointError, match="the MTP block is incomplete"):
        convert_checkpoint(dst, tmp_path / "converted", fmt="bf16")


@pytest.mark.parametrize("layout", ["deepseek", "nvidia"])
def test_two_mtp_blocks_all_or_none(layout, tmp_path, caplog):
    """With num_nextn_predict_layers = 2, "absent" means no mtp.* tensor at all: mtp.0 without mtp.1 is refused."""
    src = two_mtp_blocks(*LAYOUTS[layout])
    assert len(dsv4.load(src).mtp) == 2

    with caplog.at_level(logging.INFO, logger=LOGGER):
        model = dsv4.load(rewrite(src, tmp_path / "none", drop("mtp.")))
    assert len(model.mtp) == 0 and len(mtp_notes(caplog)) == 1

    for case, prefixes in {"mtp.1 absent": ("mtp.1.",), "mtp.1 in part": ("mtp.1.attn.",)}.items():
        with pytest.raises(CheckpointError) as e:
            dsv4.load(rewrite(src, tmp_path / case.replace(" ", "-"), drop(*prefixes)))
        text = str(e.value)
        assert "the MTP block is incomplete" in text and "missing: 'mtp.1.attn.wq_a.weight'" in text, case
        assert "missing: 'mtp.0." not in text, case
