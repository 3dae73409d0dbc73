"""Kernel dispatch: one `Ops` table per backend, chosen once and handed to the model (no module globals).

`Ops.reference()` runs `kernels.ref` everywhere; `ops_for(device)` picks Triton kernels on CUDA where they
exist and falls back to the reference otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from . import ref


@dataclass(frozen=True)
class Ops:
    name: str
    linear: Callable       # (x [..., K], QWeight) -> [..., N]
    linear_w4a4: Callable  # NVFP4 W4A4 emulation, same signature
    mlp: Callable          # shared expert (x [T, K], w13 (2,), w2, limit) -> [T, D]
    route: Callable        # (logits [T, E], bias, top_k, scaling, tid2eid, input_ids) -> (weights, ids)
    moe: Callable          # (x [T, K], ids [T, k], weights [T, k], w13 (E, 2), w2 (E,), limit) -> [T, D]

    @classmethod
    def reference(cls) -> "Ops":
        return cls("ref", ref.linear, ref.linear_w4a4, ref.mlp, ref.route, ref.moe)


def ops_for(device: torch.device | str, backend: str = "auto") -> Ops:
    """backend: "auto" (Triton on CUDA, reference elsewhere), "ref", or "triton"."""
    device = torch.device(device)
    if backend not in ("auto", "ref", "triton"):
        raise ValueError(f"unknown kernel backend {backend!r}; expected auto, ref or triton")
    if backend == "ref" or (backend == "auto" and device.type != "cuda"):
        return Ops.reference()
    if backend == "triton" and device.type != "cuda":
        raise ValueError("the triton backend needs a CUDA device (set TRITON_INTERPRET=1 only in tests)")
    return Ops.reference()  # Triton kernels plug in here (issue 5)
