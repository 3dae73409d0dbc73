"""Kernel dispatch: one `Ops` table per backend, chosen once and handed to the model (no module globals).

`Ops.reference()` runs `kernels.ref` everywhere; `Ops.triton()` runs the Triton kernels (gemm.py with the
decode GEMV of gemv.py, moe.py with moe_pair.py, w4a4.py), each of which hands a call it does not support
(format, dtype, K not divisible by its block) to its reference twin. `ops_for(device)` picks Triton on CUDA and
the reference elsewhere.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial
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
    moe: Callable          # (x [T, K], ids [T, k], weights [T, k], w13 (E, 2), w2 (E,), limit, shared=(w13, w2))
    grouped_linear: Callable = ref.grouped_linear  # (x [..., g, Kg], W [g*R, Kg], g) -> [..., g, R] (wo_a)

    @classmethod
    def reference(cls) -> "Ops":
        return cls("ref", ref.linear, ref.linear_w4a4, ref.mlp, ref.route, ref.moe, ref.grouped_linear)

    @classmethod
    def triton(cls, strict: bool = False) -> "Ops":
        """strict=True: a call a kernel does not support raises instead of running the reference (tests, benchmarks)."""
        from . import gemm, moe, w4a4  # triton is imported only when asked for

        def fb(reference: Callable) -> Callable:
            return refuse_fallback if strict else reference

        scratch = gemm.Scratch()  # split-K semaphores, owned by this table
        linear = partial(gemm.linear, fallback=fb(ref.linear), scratch=scratch)
        mlp = partial(moe.mlp, fallback=fb(ref.mlp), linear=linear, scratch=scratch)
        side = moe.Side(fb(ref.mlp), fb(ref.linear))  # the MoE's shared expert on a second stream, own semaphores
        return cls("triton-strict" if strict else "triton", linear,
                   partial(w4a4.linear_w4a4, fallback=fb(ref.linear_w4a4), scratch=scratch), mlp,
                   partial(moe.route, fallback=fb(ref.route)),
                   partial(moe.moe, fallback=fb(ref.moe), mlp_op=mlp, scratch=scratch, side=side),
                   partial(gemm.grouped_linear, fallback=fb(ref.grouped_linear), scratch=scratch))


class KernelFallback(RuntimeError):
    """A strict Triton table was asked for a call its kernels do not support."""


def refuse_fallback(*args, **kwargs):
    raise KernelFallback("a call fell back to the reference: no Triton kernel supports it (strict ops)")


def ops_for(device: torch.device | str, backend: str = "auto") -> Ops:
    """backend: "auto" (Triton on CUDA, reference elsewhere), "ref", or "triton"."""
    device = torch.device(device)
    if backend not in ("auto", "ref", "triton"):
        raise ValueError(f"unknown kernel backend {backend!r}; expected auto, ref or triton")
    if backend == "ref" or (backend == "auto" and device.type != "cuda"):
        return Ops.reference()
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the triton backend needs a CUDA device (set TRITON_INTERPRET=1 only in tests)")
    return Ops.triton()
