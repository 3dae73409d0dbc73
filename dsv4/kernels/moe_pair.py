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
from . import gemv, gemv_launch
from .gemv import COLS_TOKENS_C, _gemv_unit, _launch_layout, waits_per_unit
from .gemv_launch import Geometry, resident_ctas
from .host import Scratch, cached, interpreting, num_sms
from .policy import ROWS_PAIR, ROWS_TOKEN, GemvConfig, cdiv
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


@triton.jit(do_not_specialize=["up_units", "dn_units", "h_rows"])
def _moe_pair_kernel(up_io, up_units, up_w, up_sw, dn_io, dn_units, dn_w, dn_sw, sync_ptr, h_rows,
                     UP: tl.constexpr, UP_F: tl.constexpr, UP_FS: tl.constexpr, DN: tl.constexpr, DN_F: tl.constexpr,
                     DN_FS: tl.constexpr, PAIR_ORDER: tl.constexpr = True):
    """The MoE decode pair in one launch: the gate/up launch's units (its `gemv._gemv_kernel` arguments, prefixed
    up_ / UP, ROWS_PAIR, GATED) then the down launch's (prefixed dn_ / DN, ROWS_TOKEN). A program's first unit is its
    own id; each later one comes from a ticket (the sync line 0), drawn near the end of the unit before, units in
    that order until none is left. A down unit only waits for gate/up units of lower numbers: first units of programs
    that are resident (`launch_pair` starts no more programs than fit on the GPU at once, and the hardware starts them
    in id order) or units running programs drew. Every gate/up output tile written counts into its h row's flag
    (line 2 + row, one 128-byte line each); a down unit waits for its row's count, so down's first wave runs while
    gate/up finishes - no launch gap (COLS: the shared expert's h rows are one block, its tiles counting into the flag
    of its first row PAIRS, on which its down units wait). The last program out (line 1 counts them) re-arms every
    flag. Split partials are summed in split order as in two launches: the same bits."""
    tl.static_assert(UP.ROWS == 1 and UP.GATED, "the first part of the pair is the gate/up launch")
    up = _launch_layout(up_io.N, up_units, UP)
    dn = _launch_layout(dn_io.N, dn_units, DN)
    total = up[0] + dn[0]
    done_ptr = sync_ptr + SYNC_LINE
    ready_ptr = sync_ptr + 2 * SYNC_LINE
    if UP.PDL:   # as `gemv._gemv_kernel`; the tickets are this kernel's own scratch, which routing never touches
        gdc_launch_dependents()
        if not waits_per_unit(UP.X_READY, UP.ROWS, UP.SHARED):
            gdc_wait()
    t = tl.program_id(0)   # the first unit: the program's own; later ones: tickets
    while t < total:
        if t < up[0]:
            nxt = _gemv_unit(t, up, up_io, up_units, up_w, up_sw, (ready_ptr, 0, sync_ptr), UP, UP_F, UP_FS,
                             SIGNAL=True, TICKET=True)
        else:
            if UP.PDL:
                gdc_wait()   # reads the expert ids
            u = t - up[0]
            if PAIR_ORDER:
                u = _pair_down_unit(u, dn_units.R, dn[2], dn[1], dn_units.SPLIT, dn_units.SPLIT_S, dn_units.TOPK,
                                    DN.SHARED, UP.X_READY, DN.COLS)
            nxt = _gemv_unit(u, dn, dn_io, dn_units, dn_w, dn_sw, (ready_ptr, up[2], sync_ptr), DN, DN_F, DN_FS,
                             AWAIT=True, TICKET=True)
        # the next unit, drawn near the end of this one, not at its start (docs/tuning.md#one-launch-pair)
        t = tl.num_programs(0) + nxt
    if UP.PDL:
        gdc_wait()   # (a program that drew no unit) nothing below runs before the previous kernel is done
    if tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        # the last program out: every unit is done and every ticket drawn; re-arm for the next launch
        for c in range(0, h_rows, 128):
            offs = c + tl.arange(0, 128)
            tl.store(ready_ptr + offs * SYNC_LINE, tl.zeros((128,), dtype=tl.int32), mask=offs < h_rows)
        tl.store(sync_ptr, 0)
        tl.store(done_ptr, 0)


# what gate/up and down may choose apart in one launch (the rest of their layouts must agree)
_OWN_CHOICES = ("ROWS", "GATED", "BN", "PDL", "PDL_L2", "GROUP_COLS", "X_READY")


def launch_pair(x: torch.Tensor, w13: QWeight, h: torch.Tensor, w2: QWeight, out: torch.Tensor, up: GemvConfig,
                down: GemvConfig, *, tokens: int, topk: int, ids, rw, limit: float, shared: tuple | None = None,
                scratch: Scratch | None = None, x_ready: bool = False, fused: bool | None = None,
                pair_order: bool = True, up_alone: GemvConfig | None = None, blocks: torch.Tensor | None = None):
    """The MoE decode pair (`dispatch.moe`): gate/up (`up`: ROWS_PAIR over the tokens * topk pairs, then the shared
    expert's rows, SwiGLU) into h, and the down projection (`down`: ROWS_TOKEN, the routing weights and the top-k
    sum fused) from h into out. `shared`: (w13, w2) of the shared expert; `x_ready` as in `gemv_launch.launch`.

    `fused`: both in one launch (`_moe_pair_kernel`), each unit as its own launch would run it with the same split
    plan, so out holds the same bits as the two launches give. None: one launch where the down projection takes
    more than one wave of CTAs (its first wave then overlaps the tail of gate/up), else two
    (docs/tuning.md#one-launch-pair). `pair_order` False: down units in their own launch's order instead of the
    order gate/up completes h rows (the same bits). `up_alone`: gate/up's configuration where the pair runs as two
    launches (default `up`; the same BN). `blocks`: the pairs' expert-block table (`moe.expert_blocks`): both stages
    stream each distinct expert once; in one launch the down units then come in their own launch's order.

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
    n_up, n_dn = h_rows * cdiv(w13.out_features, up.BN), tokens * cdiv(w2.out_features, down.BN)
    need = n_up + n_dn + (2 + h_rows) * SYNC_LINE
    buf = scratch.counters(x.device, need) if scratch is not None else \
        torch.zeros(need, dtype=torch.int32, device=x.device)
    pd = gemv_launch.prepare(h, w2, out, down, M=tokens, rows=ROWS_TOKEN, R=tokens, topk=topk, ids=ids, rw=rw,
                             shared=sw2, pairs=pairs, scratch=scratch, cnt=buf[n_up:n_up + n_dn], blocks=blocks)
    if fused is None:
        fused = pd.units > pd.geo.slots and polls
    pu = gemv_launch.prepare(x, w13, h, up if fused or up_alone is None else up_alone, M=h_rows, rows=ROWS_PAIR,
                             R=h_rows, gated=True, x_div=topk, ids=ids, limit=limit, shared=sw13, pairs=pairs,
                             scratch=scratch, x_ready=x_ready, cnt=buf[:n_up], blocks=blocks)
    if not fused:
        gemv._gemv_kernel[(pu.geo.programs,)](*pu.args, **pu.consts)
        gemv._gemv_kernel[(pd.geo.programs,)](*pd.args, **pd.consts)
        return
    args = (*pu.args, *pd.args, buf[n_up + n_dn:], h_rows)
    consts, programs = cached(scratch, ("pair", pu.geo, pd.geo, pair_order and blocks is None),
                              lambda: _one_launch(pu.geo, pd.geo, pair_order and blocks is None, args, up.num_warps,
                                                  x.device, scratch))
    _moe_pair_kernel[(programs,)](*args, **consts)


def _one_launch(up: Geometry, down: Geometry, pair_order: bool, args: tuple, num_warps: int, device, scratch):
    """(constexprs and launch options, programs) of the pair in one launch: both layouts and formats, gate/up's
    launch options (programmatic dependent launch as gate/up's), and no more programs than fit on the GPU at once."""
    for name, mine, theirs in zip(up.layout._fields, up.layout, down.layout):
        if name not in _OWN_CHOICES and mine != theirs:
            raise ValueError(f"the one-launch MoE pair needs the same {name} for gate/up and down, got {mine} and "
                             f"{theirs}")
    if {k: v for k, v in up.options.items() if k != "launch_pdl"} != \
            {k: v for k, v in down.options.items() if k != "launch_pdl"}:
        raise ValueError(f"the one-launch MoE pair needs the same launch options for gate/up and down, got "
                         f"{up.options} and {down.options}")
    consts = dict(UP=up.layout, UP_F=up.stored, UP_FS=up.stored_s, DN=down.layout, DN_F=down.stored,
                  DN_FS=down.stored_s, PAIR_ORDER=pair_order, **up.options)
    units = up.splits.units + down.splits.units
    if interpreting():
        return consts, 1   # programs run one after another: a second one's first unit would come after all others
    per_sm = resident_ctas(_moe_pair_kernel.warmup(*args, grid=(1,), **consts), num_warps, device) \
        if scratch is not None else 4
    return consts, min(units, num_sms(device) * per_sm)
