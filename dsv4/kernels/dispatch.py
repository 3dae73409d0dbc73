"""The Triton table's operations: each makes its plan once per call shape (`policy`; kept in the table's
`Scratch`) and runs exactly the launchers the plan names.

    linear(x, w)                                y = x @ W^T: the decode GEMV, the fused tiles, or dequantize + cuBLAS
    grouped_linear(x, w, groups)                the block-diagonal wo_a, the same three ways
    mlp(x, w13, w2, limit)                      the shared expert: gate/up with the clamped SwiGLU fused, then down
    moe(x, ids, weights, w13, w2, limit, ...)   the routed experts, and the shared expert in, beside or after them

A call that no kernel takes (format, dtype, layout, device) goes to `fallback`: the table's reference, or in a
strict table an error.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..formats import QWeight
from . import gemm, gemv_launch, moe_pair, ref
from .gemm import EPI_ROUTED, ROWS_DENSE, ROWS_PAIR, ROWS_SORTED
from .host import Scratch, cached, device_info, readable
from .moe import align, expert_blocks
from .policy import (BESIDE_TOKENS, DECODE_TOKENS, UNREADABLE, Experts, Format, GemvConfig, Kernel, MoePlan, Routed,
                     Shared, TileConfig, plan_linear, plan_moe)


def _format(w: QWeight, x: torch.Tensor) -> Format:
    """The weight's format as a plan sees it, with x's dtype; UNREADABLE where the kernels cannot address it."""
    f32 = w.scale is not None and w.scale.dtype == torch.float32
    same = w.fmt != "dense" or w.weight.dtype == x.dtype    # a dense weight in another dtype: the reference casts
    return Format(w.fmt if same and readable(w, x.device) else UNREADABLE, x.dtype, f32)


def _key(w: QWeight, x: torch.Tensor) -> tuple:
    """What `_format` reads, cheaply: the part of a plan's key that one weight gives."""
    return (w.fmt, w.weight.dtype if w.fmt == "dense" else None, None if w.scale is None else w.scale.dtype,
            w.scale_2 is None, w.weight.device == x.device,
            w.weight.stride(-1), None if w.scale is None else w.scale.stride(-1))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, K] with unit-stride rows (a view where it can be)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def linear(x: torch.Tensor, w: QWeight, *, fallback=None, scratch: Scratch | None = None,
           config: GemvConfig | TileConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T: x [..., K] -> [..., N] in x.dtype (`out`: written there). `config` forces that GEMV or tile
    configuration (tests, benchmarks)."""
    if w.leading:
        raise ValueError(f"linear takes one weight, got stacked leading dims {w.leading}")
    M, N, K = x.numel() // max(1, x.shape[-1]), w.out_features, w.in_features
    if x.shape[-1] != K:
        return fallback(x, w)
    plan = cached(scratch, ("linear", _key(w, x), x.dtype, M, N, K, x.device, config),
                  lambda: plan_linear(_format(w, x), M, N, K, device_info(x.device), force=config))
    lead = x.shape[:-1]
    match plan.kernel:
        case Kernel.REFERENCE:
            return fallback(x, w)
        case Kernel.CUBLAS:
            y = F.linear(x, gemm.dequantize(w, x.dtype))
            return y if out is None else out.copy_(y.reshape(out.shape))
        case Kernel.GEMV:
            y = torch.empty(M, N, dtype=x.dtype, device=x.device) if out is None else out.view(M, N)
            if M:
                gemv_launch.launch(_rows(x), w, y, plan.config, M=M, scratch=scratch)
        case Kernel.TILES:
            y = torch.empty(M, N, dtype=x.dtype, device=x.device) if out is None else out
            if M:
                gemm.launch(_rows(x), w, y, plan.config, M=M, scratch=scratch)
    return y.reshape(*lead, N)


def grouped_linear(x: torch.Tensor, w: QWeight, groups: int, *, fallback=None, scratch: Scratch | None = None):
    """Same contract as `ref.grouped_linear`: x [..., g, Kg], W [g * R, Kg] -> [..., g, R]."""
    ref.check_grouped(x, w, groups)
    c, R = x.shape[-1], w.out_features // groups
    x2 = x.reshape(-1, groups * c)
    T = x2.shape[0]
    plan = cached(scratch, ("grouped", _key(w, x), x.dtype, T, w.out_features, c, groups, x.device),
                  lambda: plan_linear(_format(w, x), T, w.out_features, c, device_info(x.device), groups=groups))
    match plan.kernel:
        case Kernel.REFERENCE:
            return fallback(x, w, groups)
        case Kernel.CUBLAS:
            wt = gemm.dequantize(w, x.dtype).view(groups, R, c).transpose(1, 2)
            y = torch.bmm(x2.view(T, groups, c).transpose(0, 1), wt).transpose(0, 1)
        case Kernel.GEMV | Kernel.TILES:
            y = torch.empty(T, groups * R, dtype=x.dtype, device=x.device)
            launcher = gemv_launch.launch if plan.kernel is Kernel.GEMV else gemm.launch
            if T:
                launcher(_rows(x2), w, y, plan.config, M=T, group_r=R, x_gstride=c, scratch=scratch)
    return y.reshape(*x.shape[:-1], R)


def mlp(x: torch.Tensor, w13: QWeight, w2: QWeight, limit: float, *, fallback=None, linear=None,
        scratch: Scratch | None = None, config: GemvConfig | TileConfig | None = None) -> torch.Tensor:
    """Shared expert: gate/up with the clamped SwiGLU fused (one launch), then the down projection (`linear`)."""
    if w13.leading != (2,) or w2.leading:
        raise ValueError(f"mlp wants w13 with leading (2,) and an unstacked w2, got {w13.leading}, {w2.leading}")
    T, K = x.shape
    I = w13.out_features
    if K != w13.in_features:
        return fallback(x, w13, w2, limit)
    plan = cached(scratch, ("mlp", _key(w13, x), x.dtype, T, I, K, x.device, config),
                  lambda: plan_linear(_format(w13, x), T, I, K, device_info(x.device), gated=True, force=config))
    if plan.kernel is Kernel.REFERENCE:
        return fallback(x, w13, w2, limit)
    h = torch.empty(T, I, dtype=x.dtype, device=x.device)
    if T:
        if plan.kernel is Kernel.GEMV:
            gemv_launch.launch(_rows(x), w13, h, plan.config, M=T, gated=True, limit=limit, scratch=scratch)
        else:
            gemm.launch(_rows(x), w13, h, plan.config, M=T, rows=ROWS_DENSE, gated=True, limit=limit, scratch=scratch)
    return linear(h, w2)


class Side:
    """A second CUDA stream: `moe` runs the shared expert on it beside the routed experts, as `mlp` with split-K
    semaphores of its own (kernels running at the same time on two streams must not share them), and `start` runs
    other work on it (`Ops.start`: a layer's compressors and indexer beside its query products). `fallback` /
    `linear_fallback`: `mlp`'s and its down projection's, as the Ops table's. Owned by the `Ops` table, one stream
    per device, created on first use."""

    def __init__(self, fallback=None, linear_fallback=None):
        self.scratch = Scratch()
        self._linear = partial(linear, fallback=linear_fallback, scratch=self.scratch)
        self._fallback = fallback
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def mlp(self, x: torch.Tensor, w13: QWeight, w2: QWeight, limit: float) -> torch.Tensor:
        return mlp(x, w13, w2, limit, fallback=self._fallback, linear=self._linear, scratch=self.scratch)

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def fork(self, device: torch.device, work: Callable[[], Any]) -> tuple:
        """work() queued on this stream after what the current stream has queued so far, running beside what the
        current stream queues next -> (its result, the join: it makes the current stream wait for this one and
        returns the result, its tensors (allocated on this stream) recorded as used by the current stream). Works
        inside a CUDA graph capture (fork and join are event waits)."""
        main, side = torch.cuda.current_stream(device), self.stream(device)
        side.wait_stream(main)   # what the work reads is ready
        with torch.cuda.stream(side):
            out = work()

        def join():
            main.wait_stream(side)
            for t in _tensors(out):
                t.record_stream(main)
            return out
        return out, join

    def start(self, x: torch.Tensor, work: Callable, table) -> tuple:
        """`Ops.start` on this stream: `fork` of work(table). Off CUDA, and for x of more than `BESIDE_TOKENS` rows
        (their products fill the GPU alone), work runs now, on the current stream."""
        if not x.is_cuda or x.numel() > BESIDE_TOKENS * x.shape[-1]:
            out = work(table)
            return out, lambda: out
        return self.fork(x.device, partial(work, table))

    def beside(self, x: torch.Tensor, shared: tuple[QWeight, QWeight], limit: float, routed) -> torch.Tensor:
        """routed() on the current stream while the shared expert of x runs on the side stream (`fork`); their sum
        (`ref.moe`'s order: each output rounded, then added). Off CUDA (the interpreter) one after the other."""
        if not x.is_cuda:
            return routed().add_(self.mlp(x, *shared, limit))
        _, join = self.fork(x.device, partial(self.mlp, x, *shared, limit))
        out = routed()
        return out.add_(join())


def _tensors(out) -> list[torch.Tensor]:
    """The tensors in a result: a tensor, or a (nested) tuple or list of them and other values."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for item in out for t in _tensors(item)]
    return []


def moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: QWeight, w2: QWeight, limit: float,
        shared: tuple[QWeight, QWeight] | None = None, after_route: bool = False, *, fallback=None,
        scratch: Scratch | None = None, mlp_op=None, side: Side | None = None, decode: str = "auto",
        decode_tokens: int = DECODE_TOKENS, block_tokens: tuple[int, int] | None | str = "auto",
        tiles: tuple[TileConfig | None, TileConfig | None] | None = None) -> torch.Tensor:
    """Same contract as `ref.moe`; the plan (`policy.plan_moe`) picks the routed experts' path and where the shared
    expert runs: in the GEMV pair's launches, on the `side` stream, or after the routed experts (`mlp_op`, the Ops
    table's `mlp`; default `ref.mlp`). `after_route=True` is the caller's promise that the previous kernel on the
    stream is `route`'s and that x was written before it: the GEMV pair's gate/up launch then streams the shared
    expert while the routing kernel runs (the same bits either way).

    Options for tests and benchmarks: `decode` "auto", "gemv" (the GEMV pair up to `decode_tokens` tokens) or
    "tiles" (the decode tiles); `block_tokens` the token range over expert blocks ((first, last), None, or "auto");
    `tiles` (up, down) TileConfigs forced on the decode tiles or the sorted path (an entry None keeps its own)."""
    if len(w13.leading) != 2 or w13.leading[1] != 2 or w2.leading != w13.leading[:1]:
        raise ValueError(f"moe wants w13 leading (E, 2) and w2 leading (E,), got {w13.leading}, {w2.leading}")
    if shared is not None and (shared[0].leading != (2,) or shared[1].leading):
        raise ValueError(f"the shared expert wants w13 leading (2,) and an unstacked w2, got {shared[0].leading}, "
                         f"{shared[1].leading}")
    T, k, E = x.shape[0], ids.shape[1], w13.leading[0]
    key = ("moe", T, k, E, _expert_key(w13, w2, x), shared and _expert_key(*shared, x), x.dtype, x.device,
           decode, decode_tokens, block_tokens, tiles, after_route, side is not None)
    plan = cached(scratch, key, lambda: plan_moe(
        T, E, k, _experts(w13, w2, x), shared and _experts(*shared, x), device_info(x.device), decode=decode,
        decode_tokens=decode_tokens, block_tokens=block_tokens, tiles=tiles, after_route=after_route,
        side=side is not None))
    routed = partial(_routed, plan, x, ids, weights, w13, w2, limit, shared, fallback=fallback, scratch=scratch)
    if plan.shared is Shared.SIDE:
        return side.beside(x, shared, limit, routed)
    if plan.shared is Shared.AFTER:
        return routed() + (mlp_op or ref.mlp)(x, *shared, limit)
    return routed()


def _expert_key(w13: QWeight, w2: QWeight, x: torch.Tensor) -> tuple:
    return _key(w13, x), _key(w2, x), w13.out_features, w13.in_features, w2.out_features, w2.in_features


def _experts(w13: QWeight, w2: QWeight, x: torch.Tensor) -> Experts:
    """An expert (stack) as the plan sees it; a down projection of another shape than [D, I] leaves the kernels."""
    down = _format(w2, x)
    if (w2.out_features, w2.in_features) != (w13.in_features, w13.out_features) or x.shape[-1] != w13.in_features:
        down = Format(UNREADABLE, x.dtype)
    return Experts(_format(w13, x), down, w13.in_features, w13.out_features)


def _routed(plan: MoePlan, x, ids, weights, w13: QWeight, w2: QWeight, limit: float, shared, *, fallback,
            scratch) -> torch.Tensor:
    """The routed experts as `plan` says (with the shared expert where it rides in the GEMV pair)."""
    T, k, E = x.shape[0], ids.shape[1], w13.leading[0]
    P, I, D = T * k, w13.out_features, w2.out_features
    x, ids, weights = _rows(x), ids.contiguous(), weights.contiguous()
    out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    match plan.routed:
        case Routed.EMPTY:
            return out
        case Routed.REFERENCE:
            return fallback(x, ids, weights, w13, w2, limit)
        case Routed.PAIR:
            carried = shared if plan.shared is Shared.IN_PAIR else None
            h = torch.empty(P + (T if carried else 0), I, dtype=x.dtype, device=x.device)
            moe_pair.launch_pair(x, w13, h, w2, out, plan.up, plan.down, tokens=T, topk=k, ids=ids,
                                 rw=weights.reshape(-1), limit=limit, shared=carried, scratch=scratch,
                                 x_ready=plan.x_ready, up_alone=plan.up_alone, fused=plan.fused,
                                 blocks=expert_blocks(ids, E) if plan.blocks else None)
        case Routed.TILES:
            h = torch.empty(P, I, dtype=x.dtype, device=x.device)
            gemm.launch(x, w13, h, plan.up, M=P, rows=ROWS_PAIR, gated=True, x_div=k, num_m=P, limit=limit, ids=ids,
                        scratch=scratch)
            _routed_down(h, w2, out, plan.down, weights, k, scratch, rows=ROWS_PAIR, num_m=P, ids=ids)
        case Routed.SORTED:
            h = torch.empty(P, I, dtype=x.dtype, device=x.device)
            rows, blk_e, nblk, nb_max = align(ids, E, plan.up.BM, weights)
            gemm.launch(x, w13, h, plan.up, M=P, rows=ROWS_SORTED, gated=True, x_div=k, num_m=nb_max, limit=limit,
                        ids=blk_e, rows_idx=rows, nblk=nblk, scratch=scratch)
            _routed_down(h, w2, out, plan.down, weights, k, scratch, rows=ROWS_SORTED, num_m=nb_max, ids=blk_e,
                         rows_idx=rows, nblk=nblk)
    return out


def _routed_down(h, w2: QWeight, out, cfg: TileConfig, weights, k: int, scratch, **row_mode):
    """The fused tiles' down projection over the (token, slot) pairs of h into routing-weighted fp32 rows, then each
    token's k rows summed in slot order into out, those of routing weight 0 left out (the sorted path computes no
    row for them). `row_mode`: the launch's row mode and its indices."""
    T, D = out.shape
    y = torch.empty(T * k, D, dtype=torch.float32, device=h.device)
    gemm.launch(h, w2, y, cfg, M=T * k, epi=EPI_ROUTED, x_div=1, rw=weights.reshape(-1), scratch=scratch,
                **row_mode)
    gemm.sum_rows(y, out, T, D, k, y.stride(0), k * y.stride(0), weights)
