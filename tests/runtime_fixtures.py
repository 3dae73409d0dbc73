"""Tiny checkpoints and helpers shared by the runtime tests (memoised for the session, like ckpt_fixtures).

The indexer of `ModelConfig.tiny()` (2 index heads, index_topk 4) produces exact ties: an entry whose ReLU'd
score is 0 in both heads scores exactly 0, and often 5 or more entries tie for the last picks. torch.topk breaks
such ties differently for differently shaped score tensors (a one-shot prefill, a chunk, a decode step), and
so does transformers; the logits then differ for reasons that say nothing about the caches. The runtime
equivalence tests therefore use two variants of the tiny model:
* "wide": index_topk 128, more than the 75 CSA entries of a 300-token sequence: every visible entry is
  picked, so tie-breaking never decides anything;
* "sharp": 8 index heads (index_topk 4 stays): mixed-sign head weights make exact-zero sums rare; the tests
  check that the gap between the 4th and 5th best visible scores stays far above rounding noise wherever
  there are more than 4 candidates (`min_topk_gap`).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from types import MappingProxyType

import torch

import ckpt_fixtures as fx
from dsv4.checkpoint.tiny import make_tiny
from dsv4.config import ModelConfig
from dsv4.kernels import ref
from dsv4.model import indexer

VARIANTS = MappingProxyType({"wide": dict(index_topk=128), "sharp": dict(index_n_heads=8)})


@cache
def variant(name: str) -> Path:
    out = fx.workdir() / f"runtime-{name}"
    make_tiny(out, seed=0, cfg=ModelConfig.tiny(**VARIANTS[name]))
    return out


@cache
def demo_root() -> Path:
    """A DSV4_CACHE folder holding the built-in demo model (vocab 129,280, NVFP4)."""
    from dsv4.runtime.demo import demo_checkpoint

    root = fx.workdir() / "dsv4-cache"
    demo_checkpoint(root)
    return root


def prompt_ids(n: int, seed: int, vocab: int = 512) -> list[int]:
    """Random token ids avoiding BOS/EOS (0, 1), so no sequence ends early on EOS by construction."""
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class TopkGaps:
    """Records, while active, the gap between the k-th and (k+1)-th best visible index scores of every query
    that has more than k candidates (where the choice could hinge on a tie)."""

    def __init__(self, monkeypatch):
        self.gaps: list[float] = []
        original = ref.index_select

        def select(scores, positions, topk, ratio):
            visible = (positions + 1) // ratio
            for row, lim in zip(scores.flatten(0, -2), visible.reshape(-1).tolist()):
                if lim > topk:
                    top = row[:lim].topk(topk + 1).values
                    self.gaps.append(float(top[topk - 1] - top[topk]))
            return original(scores, positions, topk, ratio)

        for module in (ref, indexer):       # the cached step's picks, and a fresh prefill's
            monkeypatch.setattr(module, "index_select", select)

    def min(self) -> float:
        return min(self.gaps, default=float("inf"))
