"""The MoE decode pair (gate/up, then the down projection) in one launch or two: `launch_pair`.

Both stages are the decode GEMV's units (`gemv._gemv_unit`) with the split plans their own launches would have,
so the output is the same bits either way. In one launch (`_moe_pair_kernel`) programs draw units in order from
a ticket, gate/up units first, and a down unit waits for the gate/up tiles of its h row (counted per row,
release / acquire: `sync.py`), so down's first wave overlaps the tail of gate/up.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..formats import QWeight
from . import gemv
from .gemv import (COLS_TOKENS_C, ROWS_PAIR, ROWS_TOKEN, GemvConfig, _gemv_unit, _launch_layout, _prepare,
                   resident_ctas, waits_per_unit)
from .host import interpreting, num_sms
from .sync import SYNC_LINE


@triton.jit
def _pair_down_unit(v, R, num_n, splits, SPLIT, SPLIT_S, TOPK, SHARED: tl.constexpr, SHARED_FIRST: tl.constexpr,
                    COLS: tl.constexpr = False):
    """The down launch's unit (`gemv._launch_layout`'s numbering, ROWS_TOKEN) for the fused pair's v-th down unit,
    in the order gate/up completes h rows: pair by pair (token, slot), the shared expert's rows first when its
    gate/up units come first (X_READY), else last. COLS: the shared expert's units are their own range before
    the routed ones in the down launch, a row block per COLS_TOKENS tokens."""
    routed = R * num_n * SPLIT * TOPK
    n_shared = (tl.cdiv(R, COLS_TOKENS_C) if COLS else R) * num_n * SPLIT_S
    w = v - n_shared if SHARED and SHARED_FIRST else v
    pair = w // (num_n * SPLIT)
    rem = w % (num_n * SPLIT)
    stride = SPLIT * TOPK if COLS else splits   # units per routed (token, N tile)
    u = ((pair // TOPK) * num_n + rem // SPLIT) * stride + (pair % TOPK) * SPLIT + rem % SPLIT
    if SHARED:
        s = v if SHARED_FIRST else v - routed
        if COLS:   # the down launch's own order: the shared units first
            u = tl.where((w < 0) | (w >= routed), s, u + n_shared)
        else:
            u = tl.where((w < 0) | (w >= routed), (s // SPLIT_S) * splits + TOPK * SPLIT + s % SPLIT_S, u)
    return u


@triton.jit(do_not_specialize=["M", "R", "SPLIT", "TOPK", "CHUNK", "P", "NB", "CHUNK_S", "SPLIT_S", "n_steps_s",
                               "d_M", "d_R", "d_SPLIT", "d_TOPK", "d_CHUNK", "d_P", "d_NB", "d_CHUNK_S", "d_SPLIT_S",
                               "d_n_steps_s", "h_rows"])
def _moe_pair_kernel(
    x_ptr, w_ptr, s_ptr, s2_ptr, y_ptr, ids_ptr, rw_ptr, ws_ptr, cnt_ptr,
    M, N, R, SPLIT, TOPK, CHUNK, n_steps, limit, X_DIV, GROUP_R, X_GSTRIDE,
    stride_xm, stride_we, stride_wg, stride_wn, stride_se, stride_sg, stride_sn, stride_s2e, stride_s2g,
    stride_ym,
    sw_ptr, ss_ptr, ss2_ptr, P, NB, CHUNK_S, SPLIT_S, n_steps_s, stride_swg, stride_swn, stride_ssg, stride_ssn,
    stride_ss2g,
    d_x_ptr, d_w_ptr, d_s_ptr, d_s2_ptr, d_y_ptr, d_ids_ptr, d_rw_ptr, d_ws_ptr, d_cnt_ptr,
    d_M, d_N, d_R, d_SPLIT, d_TOPK, d_CHUNK, d_n_steps, d_limit, d_X_DIV, d_GROUP_R, d_X_GSTRIDE,
    d_stride_xm, d_stride_we, d_stride_wg, d_stride_wn, d_stride_se, d_stride_sg, d_stride_sn, d_stride_s2e,
    d_stride_s2g, d_stride_ym,
    d_sw_ptr, d_ss_ptr, d_ss2_ptr, d_P, d_NB, d_CHUNK_S, d_SPLIT_S, d_n_steps_s, d_stride_swg, d_stride_swn,
    d_stride_ssg, d_stride_ssn, d_stride_ss2g,
    sync_ptr, h_rows,
    FMT: tl.constexpr, SCALE_F32: tl.constexpr, ROWS: tl.constexpr, GATED: tl.constexpr, BN: tl.constexpr,
    MP: tl.constexpr, DOT: tl.constexpr, ASM: tl.constexpr, W: tl.constexpr,
    SHARED: tl.constexpr, FMT_S: tl.constexpr, SCALE_F32_S: tl.constexpr, PF: tl.constexpr, TILED: tl.constexpr,
    TILED_S: tl.constexpr, PDL: tl.constexpr, GCOL: tl.constexpr, X_READY: tl.constexpr,
    D_FMT: tl.constexpr, D_SCALE_F32: tl.constexpr, D_BN: tl.constexpr, D_FMT_S: tl.constexpr,
    D_SCALE_F32_S: tl.constexpr, D_TILED: tl.constexpr, D_TILED_S: tl.constexpr, D_GCOL: tl.constexpr,
    AWAIT_L2: tl.constexpr, PAIR_ORDER: tl.constexpr = True, COLS: tl.constexpr = False,
    BLOCKS: tl.constexpr = False,
):
    """The MoE decode pair in one launch: the gate/up launch's units (the `gemv._gemv_kernel` arguments, ROWS_PAIR,
    GATED) then the down launch's (the same arguments prefixed d_, ROWS_TOKEN, constexprs prefixed D_ where they
    may differ). A program's first unit is its own id; each later one comes from a ticket (the sync line 0),
    drawn near the end of the unit before, units in that order until none is left. A down unit only waits for
    gate/up units of lower numbers: first units of programs that are resident (`launch_pair` starts no more
    programs than fit on the GPU at once, and the hardware starts them in id order) or units running programs
    drew. Every gate/up output tile written counts into its h row's flag (line 2 + row, one 128-byte line
    each); a down unit waits for its row's count (L2-prefetching AWAIT_L2 sub-steps of its weights meanwhile),
    so down's first wave runs while gate/up finishes - no launch gap (COLS: the shared expert's h rows are one
    block, its tiles counting into the flag of its first row P, on which its down units wait). The last program
    out (line 1 counts them) re-arms every flag. Split partials are summed in split order as in two launches:
    the same bits."""
    tl.static_assert(ROWS == 1 and GATED, "the first part of the pair is the gate/up launch")
    up_total, up_splits, up_n, up_shared, up_first_shared, up_first_routed = _launch_layout(
        N, R, SPLIT, TOPK, P, SPLIT_S, NB, 1, BN, SHARED, X_READY, COLS, BLOCKS)
    dn_total, dn_splits, dn_n, dn_shared, dn_first_shared, dn_first_routed = _launch_layout(
        d_N, d_R, d_SPLIT, d_TOPK, d_P, d_SPLIT_S, d_NB, 2, D_BN, SHARED, False, COLS, BLOCKS)
    total = up_total + dn_total
    done_ptr = sync_ptr + SYNC_LINE
    ready_ptr = sync_ptr + 2 * SYNC_LINE
    if PDL:   # as `gemv._gemv_kernel`; the tickets are this kernel's own scratch, which routing never touches
        gdc_launch_dependents()
        if not waits_per_unit(X_READY, ROWS, SHARED):
            gdc_wait()
    t = tl.program_id(0)   # the first unit: the program's own; later ones: tickets
    while t < total:
        if t < up_total:
            nxt = _gemv_unit(t, up_splits, up_n, up_shared, up_first_shared, up_first_routed,
                       x_ptr, w_ptr, s_ptr, s2_ptr, y_ptr, ids_ptr, rw_ptr, ws_ptr, cnt_ptr,
                       M, N, R, SPLIT, TOPK, CHUNK, n_steps, limit, X_DIV, GROUP_R, X_GSTRIDE,
                       stride_xm, stride_we, stride_wg, stride_wn, stride_se, stride_sg, stride_sn, stride_s2e,
                       stride_s2g, stride_ym,
                       sw_ptr, ss_ptr, ss2_ptr, P, NB, CHUNK_S, SPLIT_S, n_steps_s, stride_swg, stride_swn, stride_ssg,
                       stride_ssn, stride_ss2g, ready_ptr, 0, sync_ptr,
                       FMT, SCALE_F32, 1, True, BN, MP, DOT, ASM, W, SHARED, FMT_S, SCALE_F32_S, PF, TILED, TILED_S,
                       PDL, GCOL, X_READY, True, False, 0, True, COLS, BLOCKS)
        else:
            if PDL:
                gdc_wait()   # reads the expert ids
            u = t - up_total
            if PAIR_ORDER:
                u = _pair_down_unit(u, d_R, dn_n, dn_splits, d_SPLIT, d_SPLIT_S, d_TOPK, SHARED, X_READY, COLS)
            nxt = _gemv_unit(u, dn_splits, dn_n, dn_shared, dn_first_shared, dn_first_routed,
                       d_x_ptr, d_w_ptr, d_s_ptr, d_s2_ptr, d_y_ptr, d_ids_ptr, d_rw_ptr, d_ws_ptr, d_cnt_ptr,
                       d_M, d_N, d_R, d_SPLIT, d_TOPK, d_CHUNK, d_n_steps, d_limit, d_X_DIV, d_GROUP_R, d_X_GSTRIDE,
                       d_stride_xm, d_stride_we, d_stride_wg, d_stride_wn, d_stride_se, d_stride_sg, d_stride_sn,
                       d_stride_s2e, d_stride_s2g, d_stride_ym,
                       d_sw_ptr, d_ss_ptr, d_ss2_ptr, d_P, d_NB, d_CHUNK_S, d_SPLIT_S, d_n_steps_s, d_stride_swg,
                       d_stride_swn, d_stride_ssg, d_stride_ssn, d_stride_ss2g, ready_ptr, up_n, sync_ptr,
                       D_FMT, D_SCALE_F32, 2, False, D_BN, MP, DOT, ASM, W, SHARED, D_FMT_S, D_SCALE_F32_S, PF,
                       D_TILED, D_TILED_S, PDL, D_GCOL, False, False, True, AWAIT_L2, True, COLS, BLOCKS)
        # the next unit, drawn near the end of this one: a ticket drawn at its start would fix the assignment
        # early, like a persistent grid's round robin (measured slower: units sat unevenly on the SMs)
        t = tl.num_programs(0) + nxt
    if PDL:
        gdc_wait()   # (a program that drew no unit) nothing below runs before the previous kernel is done
    if tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        # the last program out: every unit is done and every ticket drawn; re-arm for the next launch
        for c in range(0, h_rows, 128):
            offs = c + tl.arange(0, 128)
            tl.store(ready_ptr + offs * SYNC_LINE, tl.zeros((128,), dtype=tl.int32), mask=offs < h_rows)
        tl.store(sync_ptr, 0)
        tl.store(done_ptr, 0)


# the down launch's constexprs that may differ from gate/up's; `_moe_pair_kernel` takes them prefixed D_
_PAIR_DOWN_CONSTS = ("FMT", "SCALE_F32", "BN", "FMT_S", "SCALE_F32_S", "TILED", "TILED_S", "GCOL")


def launch_pair(x: torch.Tensor, w13: QWeight, h: torch.Tensor, w2: QWeight, out: torch.Tensor, up: GemvConfig,
                down: GemvConfig, *, tokens: int, topk: int, ids, rw, limit: float, shared: tuple | None = None,
                scratch=None, x_ready: bool = False, fused: bool | None = None, await_l2: int = 0,
                pair_order: bool = True, up_alone: GemvConfig | None = None, blocks: torch.Tensor | None = None):
    """The MoE decode pair (`kernels.moe`): gate/up (`up`: ROWS_PAIR over the tokens * topk pairs, then the shared
    expert's rows, SwiGLU) into h, and the down projection (`down`: ROWS_TOKEN, the routing weights and the top-k
    sum fused) from h into out. `shared`: (w13, w2) of the shared expert; `x_ready` as in `launch`.

    `fused`: both in one launch (`_moe_pair_kernel`), each unit as `launch` would run it with the same split
    plan, so out holds the same bits as the two launches give. None: fused where the down projection takes more
    than one wave of CTAs (its first wave then overlaps the tail of gate/up: 2-5 % faster at 4-8 tokens on the
    H200), else two launches (at 1 token both are single waves and the fused pair's signalling measured 6-9 %
    slower; bench/RESULTS.md round nine). `await_l2`: sub-steps of a down unit's weights prefetched into L2 while
    it waits for its h row (measured slower, so 0); `pair_order` False: down units in their own launch's order
    instead of the order gate/up completes h rows (the same bits; for benchmarks). `up_alone`: gate/up's
    configuration where the pair runs as two launches (default `up`; the same BN). `blocks`: the pairs' expert-block
    table (`moe.expert_blocks`): both stages stream each distinct expert once (`gemv.launch(blocks=...)`); in one
    launch the down units then come in their own launch's order (block by block).

    On a GPU, one launch needs the PTX build (`GemvConfig.asm` not False): its down units wait for their h rows
    with PTX acquire loads (`sync._await_row`), which the plain-Triton build leaves out."""
    polls = interpreting() or up.asm is not False
    if fused and not polls:
        raise ValueError("the one-launch MoE pair waits for its h rows with PTX loads; it needs GemvConfig.asm")
    if up_alone is not None and up_alone.BN != up.BN:
        raise ValueError(f"launch_pair: up_alone.BN {up_alone.BN} differs from up.BN {up.BN}")
    pairs = tokens * topk
    h_rows = pairs + (tokens if shared is not None else 0)
    sw13, sw2 = shared if shared is not None else (None, None)
    n_up, n_dn = h_rows * triton.cdiv(w13.out_features, up.BN), tokens * triton.cdiv(w2.out_features, down.BN)
    need = n_up + n_dn + (2 + h_rows) * SYNC_LINE
    buf = scratch.counters(x.device, need) if scratch is not None else \
        torch.zeros(need, dtype=torch.int32, device=x.device)
    pd = _prepare(h, w2, out, down, M=tokens, rows=ROWS_TOKEN, R=tokens, gated=False, topk=topk, x_div=1, ids=ids,
                  rw=rw, limit=0.0, group_r=0, x_gstride=0, shared=sw2, pairs=pairs, scratch=scratch, x_ready=False,
                  cnt=buf[n_up:n_up + n_dn], blocks=blocks)
    if fused is None:
        fused = pd.units > pd.slots and polls
    pu = _prepare(x, w13, h, up if fused or up_alone is None else up_alone, M=h_rows, rows=ROWS_PAIR, R=h_rows,
                  gated=True, topk=1, x_div=topk, ids=ids, rw=None, limit=limit, group_r=0, x_gstride=0, shared=sw13,
                  pairs=pairs, scratch=scratch, x_ready=x_ready, cnt=buf[:n_up], blocks=blocks)
    if not fused:
        gemv._gemv_kernel[(pu.programs,)](*pu.args, **pu.consts)
        gemv._gemv_kernel[(pd.programs,)](*pd.args, **pd.consts)
        return
    # one launch: programmatic dependent launch as gate/up's (`moe` gives it only gate/up, after routing)
    consts = {k: v for k, v in pu.consts.items() if k != "PDL_L2"}
    for k, v in pd.consts.items():
        if k in _PAIR_DOWN_CONSTS:
            consts["D_" + k] = v
        elif k not in ("ROWS", "GATED", "X_READY", "PDL_L2", "PDL", "launch_pdl") and consts.get(k) != v:
            raise ValueError(f"the fused MoE pair needs the same {k} for gate/up and down, got {consts.get(k)} "
                             f"and {v}")
    consts["AWAIT_L2"] = await_l2
    consts["PAIR_ORDER"] = pair_order and blocks is None   # (expert blocks: the down launch's block order)
    args = (*pu.args, *pd.args, buf[n_up + n_dn:], h_rows)
    units = pu.units + pd.units
    if interpreting():
        programs = 1   # programs run one after another: a second one's first unit would come after all others
    else:
        key = ("pair", x.device, tuple(sorted((k, str(v)) for k, v in consts.items())))
        per_sm = scratch.resident(key, lambda: resident_ctas(
            _moe_pair_kernel.warmup(*args, grid=(1,), **consts), up.num_warps, x.device)) \
            if scratch is not None else 4
        programs = min(units, num_sms(x.device) * per_sm)
    _moe_pair_kernel[(programs,)](*args, **consts)
