"""Shared, cached tiny checkpoints for the checkpoint and CLI tests.

Every helper is memoised for the whole test session (a module-level cache, because pytest would build a
session fixture imported into several modules once per module), and writes under one temporary folder
removed at exit. Checkpoints written here are read-only for tests: copy before damaging one.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from functools import cache
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dsv4.checkpoint.tiny import make_tiny, random_canonical
from dsv4.config import ModelConfig

SMALL_SHARD = 150_000  # bytes: splits a tiny checkpoint into several shards


@cache
def workdir() -> Path:
    d = Path(tempfile.mkdtemp(prefix="dsv4-ckpt-tests-"))
    atexit.register(shutil.rmtree, d, True)
    return d


def fresh_dir(name: str) -> Path:
    """A new empty folder for one test's output."""
    d = Path(tempfile.mkdtemp(prefix=name + "-", dir=workdir()))
    return d


@cache
def tiny_config() -> ModelConfig:
    return ModelConfig.tiny()


def reference(seed: int = 0) -> dict[str, torch.Tensor]:
    """The canonical tensors every tiny checkpoint here is made from."""
    return _reference(seed)


@cache
def _reference(seed: int) -> dict[str, torch.Tensor]:
    return random_canonical(tiny_config(), seed)


def tiny(fmt: str = "bf16", naming: str = "deepseek", seed: int = 0) -> Path:
    """make-tiny output (small shards, so every checkpoint here is really sharded)."""
    return _tiny(fmt, naming, seed)


@cache
def _tiny(fmt: str, naming: str, seed: int) -> Path:
    out = workdir() / f"tiny-{fmt}-{naming}-{seed}"
    make_tiny(out, seed=seed, fmt=fmt, naming=naming, shard_bytes=SMALL_SHARD)
    return out


def hf_config_kwargs() -> dict:
    return tiny_config().to_hf_dict()


@cache
def hf_model():
    """transformers' DeepseekV4ForCausalLM (fp32) loaded from the tiny bf16 DeepSeek-named checkpoint."""
    import transformers
    from transformers import DeepseekV4ForCausalLM

    transformers.logging.set_verbosity_error()
    model = DeepseekV4ForCausalLM.from_pretrained(tiny(), dtype=torch.float32)
    return model.eval()


@cache
def hf_saved() -> Path:
    """What transformers' save_pretrained writes for the tiny model (the hf-saved dialect, no MTP)."""
    out = workdir() / "hf-saved"
    hf_model().save_pretrained(out)
    return out


@cache
def hf_stacked() -> Path:
    """The model's own state_dict() under its module names (the hf-stacked dialect, no MTP)."""
    out = workdir() / "hf-stacked"
    out.mkdir()
    shutil.copy(hf_saved() / "config.json", out / "config.json")
    state = {k: v.contiguous() for k, v in hf_model().state_dict().items()}
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


def copy_checkpoint(src: Path, name: str) -> Path:
    """A writable copy of a checkpoint folder (for tests that damage it)."""
    dst = fresh_dir(name)
    for f in src.iterdir():
        shutil.copy(f, dst / f.name)
    return dst


def rewrite(src: Path, dst: Path, edit=None, edit_config=None) -> Path:
    """A copy of sharded checkpoint `src` as one model.safetensors, with its tensors and config.json edited."""
    dst.mkdir(parents=True)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    if edit:
        edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    if edit_config:
        edit_config(config)
    (dst / "config.json").write_text(json.dumps(config))
    if (src / "hf_quant_config.json").exists():
        shutil.copy(src / "hf_quant_config.json", dst)
    return dst


def drop(*prefixes: str):
    """A `rewrite` tensor edit deleting every key that starts with one of `prefixes` (at least one must)."""
    def edit(t):
        gone = [k for k in t if k.startswith(prefixes)]
        assert gone, prefixes
        for k in gone:
            del t[k]
    return edit
