"""Kernel tables: one `Ops` table per backend, chosen once and handed to the model (no module globals).

`Ops.reference()` runs `kernels.ref` everywhere; `Ops.triton()` runs the Triton kernels through `dispatch` (each call
planned once per shape by `policy`), handing a call no kernel takes (format, dtype, layout) to its reference twin.
`w4a4=True` gives either table's W4A4 variant (`emulation.py`). `ops_for(device)` picks Triton on CUDA and the
reference elsewhere.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, NamedTuple

import torch

from ..formats import QWeight
from . import emulation, ref


class Pending(NamedTuple):
    """Work started beside the current stream (`Ops.start`): its result, which only later work beside it may read
    before the join, and the join, which makes the current stream wait for the work and returns the result."""
    value: Any
    join: Callable[[], Any]


@dataclass(frozen=True)
class Ops:
    name: str
    linear: Callable          # (x [..., K], QWeight) -> [..., N]
    linear_w4a4: Callable     # NVFP4 W4A4 emulation of one product, same signature
    mlp: Callable             # shared expert (x [T, K], w13 (2,), w2, limit) -> [T, D]
    route: Callable           # (logits [T, E], bias, top_k, scaling, tid2eid, input_ids, held) -> (weights, ids)
    moe: Callable             # (x [T, K], ids [T, k], weights [T, k], w13 (E, 2), w2 (E,), limit, shared=(w13, w2))
    grouped_linear: Callable  # (x [..., g, Kg], W [g*R, Kg], g) -> [..., g, R] (wo_a)
    # cached attention of a ragged step: (q [N, H, D], kv [N, D], ring, entries, picks, StepTokens, ratio, sinks,
    # scale, max_entries, update_ring: also write the rings, decode steps only, entry_nope: the fp8 cache's packed
    # entries, rope: (cos, sin) to rotate the queries by and the output back, q_eps: the queries' per-head RMS)
    # -> [N, H, D]; and the step's rows into the rings
    sparse_attention: Callable = ref.sparse_attention
    write_ring: Callable = ref.write_ring
    # a compressor's step for every sequence (kv, gate logits [N, width], ape [ratio, width], StepTokens, state,
    # ratio, cos, sin [N, r/2], norm weight, eps, max_windows, second: another compressor's `ref.SecondCompressor`
    # of the same step, stepped with it) -> None, states updated in place; the indexer's picks (q [N, H, hd],
    # weights [N, H], entries, StepTokens, topk, ratio, scale, max_keys, weight_scale, entry_scales: fp8 keys' scales)
    # -> [N, topk]
    compress: Callable = ref.compress
    index_picks: Callable = ref.index_picks
    # RMS normalisation and rope of rows: (x [..., D], cos, sin, weight, eps, inverse, fp8_nope: channels rounded
    # through the fp8 cache's codes) -> x's shape; and of several tensors' rows, each call's arguments a tuple
    norm_rope: Callable = ref.norm_rope
    norm_ropes: Callable = ref.norm_ropes
    # the router's dense projection: (x [..., d], fp32 weight [E, d]) -> fp32 logits [..., E]
    router_logits: Callable = ref.router_logits
    # mHC: (streams [..., n, d], fn, base, scale, iters, hc_eps, norm_eps[, norm weight, its eps]) -> (collapsed (and
    # normed), post, comb); (out, streams, post, comb) -> new streams; (streams, fn, base, scale, hc_eps, norm_eps[,
    # norm weight, its eps]) -> the HyperHead's collapse; (out, streams, post, comb, then hc_pre's arguments after the
    # streams) -> (new streams, collapsed, post, comb): one sub-block's update and the next one's collapse
    hc_pre: Callable = ref.hc_pre
    hc_post: Callable = ref.hc_post
    hc_head: Callable = ref.hc_head
    hc_post_pre: Callable = ref.hc_post_pre
    # a second CUDA stream for `start`: (x, work) -> (work's result, its join), work(that stream's table) queued
    # there (`dispatch.Side.start`); None: work runs at once, in order
    beside: Callable | None = None
    w4a4: bool = False        # NVFP4 weights with an input_scale run the W4A4 emulation (Blackwell numerics)
    reads_tiled: bool = False  # the kernels read tile-major weights (the loader stores them so on CUDA)

    @classmethod
    def reference(cls, w4a4: bool = False) -> "Ops":
        ops = cls("ref", ref.linear, ref.linear_w4a4, ref.mlp, ref.route, ref.moe, ref.grouped_linear)
        return emulation.variant(ops) if w4a4 else ops

    @classmethod
    def triton(cls, strict: bool = False, w4a4: bool = False) -> "Ops":
        """strict=True: a call a kernel does not support raises instead of running the reference (tests, benchmarks)."""
        from . import attention, compressor, dispatch, indexer, mhc, moe, norm_rope, w4a4 as w4a4_kernels  # triton
        from .host import Scratch

        def fallback(reference: Callable) -> Callable:
            return refuse_fallback if strict else reference

        side = dispatch.Side(fallback(ref.mlp), fallback(ref.linear))   # the second stream

        def table(beside) -> Ops:
            scratch = Scratch()   # split-K semaphores and the plans, owned by this table
            linear = partial(dispatch.linear, fallback=fallback(ref.linear), scratch=scratch)
            mlp = partial(dispatch.mlp, fallback=fallback(ref.mlp), linear=linear, scratch=scratch)
            ops = cls("triton-strict" if strict else "triton", linear,
                      partial(w4a4_kernels.linear_w4a4, fallback=fallback(ref.linear_w4a4), scratch=scratch), mlp,
                      partial(moe.route, fallback=fallback(ref.route)),
                      partial(dispatch.moe, fallback=fallback(ref.moe), mlp_op=mlp, scratch=scratch, side=side),
                      partial(dispatch.grouped_linear, fallback=fallback(ref.grouped_linear), scratch=scratch),
                      sparse_attention=partial(attention.sparse_attention, fallback=fallback(ref.sparse_attention)),
                      write_ring=attention.write_ring,
                      compress=compressor.compress, index_picks=indexer.index_picks, norm_rope=norm_rope.norm_rope,
                      norm_ropes=norm_rope.norm_ropes,
                      router_logits=partial(moe.router_logits, fallback=fallback(ref.router_logits)),
                      hc_pre=partial(mhc.hc_pre, fallback=fallback(ref.hc_pre)),
                      hc_post=partial(mhc.hc_post, fallback=fallback(ref.hc_post)),
                      hc_head=partial(mhc.hc_head, fallback=fallback(ref.hc_head)),
                      hc_post_pre=partial(mhc.hc_post_pre, fallback=fallback(ref.hc_post_pre)), beside=beside,
                      reads_tiled=True)
            return emulation.variant(ops) if w4a4 else ops
        return table(partial(side.start, table=table(None)))    # the second stream's work runs the inner table

    def start(self, x: torch.Tensor, work: Callable[["Ops"], Any]) -> Pending:
        """work(table) beside the current stream (x: on its device). With `beside`, it is queued on a second CUDA
        stream after what this one has queued so far and runs beside what this one queues next, `table` the second
        stream's Ops (split-K semaphores of its own); else it runs now, with this table."""
        if self.beside is None:
            out = work(self)
            return Pending(out, lambda: out)
        return Pending(*self.beside(x, work))

    def emulates(self, w: QWeight) -> bool:
        """Whether this table runs products with `w` as the W4A4 emulation."""
        return self.w4a4 and emulation.emulated(w)


class KernelFallback(RuntimeError):
    """A strict Triton table was asked for a call its kernels do not support."""


def refuse_fallback(*args, **kwargs):
    raise KernelFallback("a call fell back to the reference: no Triton kernel supports it (strict ops)")


def ops_for(device: torch.device | str, backend: str = "auto", w4a4: bool = False) -> Ops:
    """backend: "auto" (Triton on CUDA, reference elsewhere), "ref", or "triton"; w4a4: the W4A4 variant."""
    device = torch.device(device)
    if backend not in ("auto", "ref", "triton"):
        raise ValueError(f"unknown kernel backend {backend!r}; expected auto, ref or triton")
    if backend == "ref" or (backend == "auto" and device.type != "cuda"):
        return Ops.reference(w4a4)
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the triton backend needs a CUDA device (set TRITON_INTERPRET=1 only in tests)")
    return Ops.triton(w4a4=w4a4)
