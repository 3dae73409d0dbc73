"""Launching the decode GEMV (`gemv.py`): one launch over a (possibly stacked) QWeight, its geometry made once.

A launch's geometry (layout constexprs, split plan, programs) depends on shapes, formats and the configuration
alone, so it is made on the first call of a shape and kept in the `Scratch`; every call then only gathers its
tensors and strides into the kernel's operand bundles and launches. On a GPU the split plan fills the CTAs that fit
at once: the SMs times the resident CTAs of the compiled kernel (its registers and shared memory).

The kernel's arguments travel as named tuples (Triton tuples): `Io`, `Units` (left unspecialized, so that one
compiled kernel serves every token count), a `host.Operand` per weight, and the constexpr bundles `Layout` and
`Stored`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton.language as tl

from ..formats import QWeight
from . import gemv
from .host import Scratch, cached, has_pdl, interpreting, num_sms, operand, scale_views
from .policy import (ROWS_DENSE, ROWS_PAIR, ROWS_TOKEN, GemvConfig, Splits, cdiv, group_cols_on, mma_n, plan_splits,
                     shared_cols, steps_of)
from .tiles import FMT_CODES


class Io(NamedTuple):
    """Everything a launch reads and writes but the weights."""
    x: object            # activations [rows, K] (ROWS_TOKEN: h, the (token, slot) rows then the shared expert's)
    stride_x: int
    y: object            # output [M, N]
    stride_y: int
    ids: object          # expert ids per pair (or the expert-block table)
    rw: object           # routing weights per pair (ROWS_TOKEN)
    ws: object           # fp32 split-K workspace
    cnt: object          # int32 split-K semaphores
    limit: float         # the clamped SwiGLU's limit (gated)
    x_div: int           # ROWS_PAIR: pair p reads x row p // x_div
    group_r: int         # block-diagonal (wo_a): weight rows per group, 0 = one dense weight
    x_gstride: int       # block-diagonal: x columns from one group to the next
    N: int               # output width
    n_steps: int         # sub-steps of the routed weight's rows


class Units(NamedTuple):
    """How the launch's units are counted (runtime values, left unspecialized)."""
    M: int               # output rows
    R: int               # row blocks (ROWS_PAIR: pairs + the shared expert's tokens; ROWS_TOKEN: tokens)
    SPLIT: int           # K splits of a routed weight (ROWS_TOKEN: per slot)
    TOPK: int            # routed slots per token (ROWS_TOKEN)
    CHUNK: int           # sub-steps per routed K split
    PAIRS: int           # (token, slot) pairs: the shared expert's rows follow
    N_BLOCKS: int        # rows of the expert-block table
    CHUNK_S: int         # sub-steps per K split of the shared expert
    SPLIT_S: int         # K splits of the shared expert
    n_steps_s: int       # sub-steps of the shared expert's rows


class Layout(NamedTuple):
    """The launch's compile-time choices (one constexpr)."""
    ROWS: int            # ROWS_DENSE, ROWS_PAIR or ROWS_TOKEN
    GATED: bool          # gate and up, SwiGLU epilogue
    BN: int              # weight rows per unit
    MMA_N: int           # x rows per unit (the MMA's N)
    DOT: object          # MMA operand dtype
    ASM: bool            # PTX decoders
    WARPS: int
    PREFETCH: int        # register prefetch bit mask (1 FP8, 2 FP4)
    SHARED: bool         # the MoE's shared expert in the launch
    PDL: bool            # programmatic dependent launch
    PDL_L2: int          # sub-steps L2-prefetched before the PDL wait
    GROUP_COLS: bool     # FP4 scale groups as MMA columns
    X_READY: bool        # the shared expert's units run first, overlapping the routing kernel
    COLS: bool           # the shared expert's units read COLS_TOKENS tokens as MMA columns
    BLOCKS: bool         # the routed units run over the expert-block table


class Stored(NamedTuple):
    """How a weight is stored (one constexpr per weight)."""
    FMT: int             # `tiles.FMT_CODES`
    SCALE_F32: bool      # FP8 block scales in fp32
    TILED: bool          # tile-major bytes


def pdl_enabled(cfg: GemvConfig, device: torch.device) -> bool:
    """Programmatic dependent launch: asked for, on a CUDA GPU with `griddepcontrol` (sm_90+), not interpreted."""
    return cfg.pdl and has_pdl(device)


def resident_ctas(kernel, num_warps: int, device: torch.device) -> int:
    """CTAs of a compiled kernel that fit on one SM at once (registers, shared memory, threads)."""
    props = torch.cuda.get_device_properties(device)
    kernel._init_handles()
    regs = max(1, -(-kernel.n_regs // 8) * 8) * 32 * num_warps
    smem = kernel.metadata.shared + 1024
    by_smem = getattr(props, "shared_memory_per_multiprocessor", 233472) // smem
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // regs
    return max(1, min(by_regs, by_smem, props.max_threads_per_multi_processor // (32 * num_warps), 32))


@dataclass(frozen=True, eq=False)   # (hashed by identity: one per cached launch shape)
class Geometry:
    """What one launch's shapes decide: its constexprs and launch options, split plan, programs and the CTAs that
    fit at once."""
    layout: Layout
    stored: Stored
    stored_s: Stored
    options: dict        # num_warps, num_stages, maxnreg, launch_pdl
    splits: Splits
    n_steps: int
    n_steps_s: int
    programs: int
    slots: int

    @property
    def consts(self) -> dict:
        return dict(L=self.layout, F=self.stored, FS=self.stored_s, **self.options)


@dataclass(frozen=True)
class Prepared:
    """One launch: the kernel's arguments and its geometry."""
    args: tuple
    geo: Geometry

    @property
    def consts(self) -> dict:
        return self.geo.consts

    @property
    def units(self) -> int:
        return self.geo.splits.units


def launch(x: torch.Tensor, w: QWeight, y: torch.Tensor, cfg: GemvConfig, *, M: int, rows: int = ROWS_DENSE,
           R: int = 1, gated: bool = False, topk: int = 1, x_div: int = 1, ids=None, rw=None, limit: float = 0.0,
           group_r: int = 0, x_gstride: int = 0, shared: QWeight | None = None, pairs: int = 0,
           scratch: Scratch | None = None, x_ready: bool = False, blocks: torch.Tensor | None = None):
    """One launch over a (possibly stacked) QWeight. x rows: M (dense), pairs (ROWS_PAIR: R = M = pairs), or
    pairs of R tokens (ROWS_TOKEN: M = R = tokens, x has tokens * topk rows). y: [M, N] (row stride any).

    `shared` (ROWS_PAIR / ROWS_TOKEN): the MoE's shared expert, any supported format, same N and K, streamed in
    the same launch. ROWS_PAIR: R = M = pairs + tokens, rows from `pairs` on are the shared expert's (x row
    r - pairs); ROWS_TOKEN: x has pairs + R rows, each token's extra slot reads row pairs + token. From
    SHARED_COLS_TOKENS tokens each of its units covers COLS_TOKENS tokens (`policy.shared_cols`).

    `x_ready` (ROWS_PAIR with `shared`): the caller promises that x was written before the previous kernel on
    the stream started and that that kernel writes neither x nor the weights (it is `moe.route`'s); the shared
    expert's units then run first and, with `cfg.pdl`, before that kernel has finished (`X_READY`).

    `blocks` (ROWS_PAIR / ROWS_TOKEN; the shared expert, if any, as token columns): the expert-block table of the
    pairs (`moe.expert_blocks`, in place of ids): each distinct expert is streamed once for all its pairs."""
    p = prepare(x, w, y, cfg, M=M, rows=rows, R=R, gated=gated, topk=topk, x_div=x_div, ids=ids, rw=rw, limit=limit,
                group_r=group_r, x_gstride=x_gstride, shared=shared, pairs=pairs, scratch=scratch, x_ready=x_ready,
                blocks=blocks)
    gemv._gemv_kernel[(p.geo.programs,)](*p.args, **p.consts)


def prepare(x, w: QWeight, y, cfg: GemvConfig, *, M: int, rows: int = ROWS_DENSE, R: int = 1, gated: bool = False,
            topk: int = 1, x_div: int = 1, ids=None, rw=None, limit: float = 0.0, group_r: int = 0,
            x_gstride: int = 0, shared: QWeight | None = None, pairs: int = 0, scratch: Scratch | None = None,
            x_ready: bool = False, cnt: torch.Tensor | None = None, blocks: torch.Tensor | None = None) -> Prepared:
    """`launch`'s work but the launch itself; `cnt`: the split-K semaphores to use (default: the scratch's)."""
    key = ("gemv", _weight_key(w), _weight_key(shared), rows, R, M, gated, topk, group_r, x_gstride, pairs, x_ready,
           None if blocks is None else (tuple(blocks.shape), blocks.dtype), cfg, x.dtype, x.device)
    n_cnt = R * cdiv(w.out_features, cfg.BN)
    if cnt is None:
        cnt = scratch.counters(x.device, n_cnt) if scratch is not None else \
            torch.zeros(n_cnt, dtype=torch.int32, device=x.device)

    table = ids if blocks is None else blocks   # the expert ids, or the expert-block table in their place

    def args(splits: Splits, ws: torch.Tensor, steps: tuple[int, int]) -> tuple:
        routed = operand(w, gated)
        unused = routed.w   # a typed pointer for what this launch does not read
        io = Io(x, x.stride(0), y, y.stride(0), unused if table is None else table, unused if rw is None else rw, ws,
                cnt, float(limit), x_div, group_r, x_gstride, w.out_features, steps[0])
        units = Units(M, R, splits.split, topk, splits.chunk, max(1, pairs), 1 if blocks is None else blocks.shape[0],
                      splits.chunk_s, splits.split_s, steps[1])
        return io, units, routed, routed if shared is None else operand(shared, gated)

    geo = cached(scratch, key, lambda: _geometry(x, w, cfg, rows=rows, R=R, M=M, gated=gated, topk=topk,
                                                 group_r=group_r, x_gstride=x_gstride, shared=shared, pairs=pairs,
                                                 x_ready=x_ready, blocks=blocks, scratch=scratch, args=args, cnt=cnt))
    ws = cnt.view(torch.float32)   # unused without splits (the kernel still needs typed pointers)
    if geo.splits.parts > 1:
        ws = torch.empty(geo.splits.parts * (2 if gated else 1) * M * w.out_features, dtype=torch.float32,
                         device=x.device)
    return Prepared(args(geo.splits, ws, (geo.n_steps, geo.n_steps_s)), geo)


def _weight_key(w: QWeight | None):
    """What a launch's geometry reads of a weight."""
    if w is None:
        return None
    return (w.fmt, w.weight.shape, None if w.scale is None else w.scale.dtype, w.tiled)


def _stored(w: QWeight) -> Stored:
    return Stored(FMT_CODES[w.fmt], scale_views(w)[1], w.tiled)


def _geometry(x, w: QWeight, cfg: GemvConfig, *, rows, R, M, gated, topk, group_r, x_gstride, shared, pairs,
              x_ready, blocks, scratch, args, cnt) -> Geometry:
    N, K = w.out_features, w.in_features
    interp = interpreting()
    if shared is not None and (rows == ROWS_DENSE or (shared.out_features, shared.in_features) != (N, K)
                               or shared.leading != w.leading[1:] or shared.fmt not in ("fp8", "mxfp4", "nvfp4")
                               or shared.in_features % 128):
        raise ValueError(f"shared expert {shared.fmt} {tuple(shared.leading)} [{shared.out_features}, "
                         f"{shared.in_features}] does not fit this launch ({w.fmt} {tuple(w.leading)} [{N}, {K}])")
    n_steps = steps_of(w.fmt, K if group_r == 0 else x_gstride)
    n_steps_s = steps_of(shared.fmt, K) if shared is not None else n_steps
    dot = tl.float32 if (interp or x.dtype == torch.float32) else tl.bfloat16
    mp = mma_n(M if rows == ROWS_DENSE else 1)
    cols = shared_cols(rows, R, pairs, shared is not None)
    if blocks is not None and (rows not in (ROWS_PAIR, ROWS_TOKEN) or (shared is not None and not cols)
                               or blocks.dim() != 2 or not 0 < blocks.shape[0] <= pairs
                               or blocks.shape[1] != 2 + mma_n(1) or blocks.dtype != torch.int32):
        raise ValueError(f"expert blocks {tuple(blocks.shape)} {blocks.dtype} do not fit this launch (rows {rows}, "
                         f"{pairs} pairs, shared expert as token columns: {cols}); expected int32 "
                         f"[1..{pairs}, {2 + mma_n(1)}]")
    layout = Layout(ROWS=rows, GATED=gated, BN=cfg.BN, MMA_N=mp, DOT=dot,
                    ASM=(not interp) and dot == tl.bfloat16 and (cfg.asm is None or cfg.asm), WARPS=cfg.num_warps,
                    PREFETCH=cfg.prefetch, SHARED=shared is not None, PDL=pdl_enabled(cfg, x.device),
                    PDL_L2=cfg.pdl_l2, GROUP_COLS=group_cols_on(cfg, rows, M, w.fmt, None if shared is None else shared.fmt),
                    X_READY=x_ready and shared is not None and rows == ROWS_PAIR, COLS=cols, BLOCKS=blocks is not None)
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if layout.PDL:
        options["launch_pdl"] = True
    maxnreg = (128 if (mp == 8 or not gated) else 0) if cfg.maxnreg < 0 else cfg.maxnreg
    if maxnreg and not interp:
        options["maxnreg"] = maxnreg
    stored, stored_s = _stored(w), _stored(shared if shared is not None else w)
    if interp:
        per_sm = 1
    else:
        consts = dict(L=layout, F=stored, FS=stored_s, **options)
        probe = Splits(1, 1, 1, n_steps, 1, n_steps_s)
        per_sm = cached(scratch, ("resident", x.device, layout, stored, stored_s, tuple(options.items())),
                        lambda: resident_ctas(gemv._gemv_kernel.warmup(
                            *args(probe, cnt.view(torch.float32), (n_steps, n_steps_s)), grid=(1,), **consts),
                            cfg.num_warps, x.device)) if scratch is not None else 4
    slots = num_sms(x.device) * per_sm
    routed_rows = pairs if rows == ROWS_PAIR and shared is not None else R
    splits = plan_splits(rows, R, routed_rows, topk, cdiv(N, cfg.BN), n_steps, n_steps_s if shared is not None else 0,
                         slots, cfg.split, cols, 0 if blocks is None else blocks.shape[0])
    return Geometry(layout, stored, stored_s, options, splits, n_steps, n_steps_s, splits.units, slots)
