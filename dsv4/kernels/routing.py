"""MoE routing on the GPU: one token's experts and weights (`_route_token`), the contract of `ref.route`.

Biased top-k: score = sqrt(softplus(logit)); the k highest score + bias are picked (ties to the lower expert id),
in selection order; their weights are the unbiased scores normalized to sum 1, times `scaling`. Hash layers take
their k ids from tid2eid[input_id] and weight them the same way. The routing kernel (`moe.route`) runs it once
per token; the decode GEMV pair can run it inside every routed unit (`moe.route_moe`), so that no
kernel sits between the gate logits and the experts' first weight bytes. The same function gives the same bits
in both places.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .ref import Routing

@triton.jit
def _softplus(x):
    """torch's softplus (threshold 20) with a log1p that keeps tiny exp(x) (x << 0) exact to fp32."""
    u = tl.exp(tl.minimum(x, 20.0))
    lg = tl.where(u < 1e-4, u * (1.0 - 0.5 * u), tl.log(1.0 + u))
    return tl.where(x > 20.0, x, lg)


@triton.jit
def _route_token(t, logits_ptr, bias_ptr, tid2eid_ptr, input_ids_ptr, E, scaling, stride_l, stride_tid,
                 TOPK: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr, HASH: tl.constexpr):
    """Token t's (ids int32 [K_PAD], weights fp32 [K_PAD]) in selection order; entries from TOPK on are 0."""
    offs_e = tl.arange(0, E_PAD)
    emask = offs_e < E
    offs_j = tl.arange(0, K_PAD)
    kmask = offs_j < TOPK
    t = t.to(tl.int64)
    if HASH:
        tok = tl.load(input_ids_ptr + t).to(tl.int64)
        ids = tl.load(tid2eid_ptr + tok * stride_tid + offs_j, mask=kmask, other=0).to(tl.int32)
    else:
        logit = tl.load(logits_ptr + t * stride_l + offs_e, mask=emask, other=0.0).to(tl.float32)
        sel = tl.where(emask, tl.sqrt_rn(_softplus(logit))
                       + tl.load(bias_ptr + offs_e, mask=emask, other=0.0).to(tl.float32), float("-inf"))
        ids = tl.zeros((K_PAD,), dtype=tl.int32)
        for j in tl.static_range(TOPK):
            idx = tl.argmax(sel, 0, tie_break_left=True).to(tl.int32)
            ids = tl.where(offs_j == j, idx, ids)
            sel = tl.where(offs_e == idx, float("-inf"), sel)
    # the picked experts' unbiased scores: a gather of their k logits (cache-hot) rather than k reductions
    lg = tl.load(logits_ptr + t * stride_l + ids, mask=kmask, other=0.0).to(tl.float32)
    picked = tl.where(kmask, tl.sqrt_rn(_softplus(lg)), 0.0)
    w = picked / (tl.sum(picked) + 1e-20) * scaling
    return ids, w


@triton.jit
def _route_slot(t, slot, logits_ptr, bias_ptr, tid2eid_ptr, input_ids_ptr, E, scaling, stride_l, stride_tid,
                TOPK: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr, HASH: tl.constexpr):
    """(expert id int32, routing weight fp32) of token t's slot `slot` (< TOPK): `_route_token`'s, picked exactly."""
    ids, w = _route_token(t, logits_ptr, bias_ptr, tid2eid_ptr, input_ids_ptr, E, scaling, stride_l, stride_tid,
                          TOPK, E_PAD, K_PAD, HASH)
    mine = tl.arange(0, K_PAD) == slot
    return tl.sum(tl.where(mine, ids, 0)), tl.sum(tl.where(mine, w, 0.0))


def route_ready(r: Routing) -> bool:
    """Whether the kernels can read `r`'s tensors as they are (unit stride along experts and tid2eid rows)."""
    return r.logits.stride(-1) == 1 and (not r.hashed or r.tid2eid.stride(-1) == 1)


def route_args(r: Routing) -> tuple:
    """(logits, bias, tid2eid, input_ids, E, scaling, stride_l, stride_tid): `_route_token`'s runtime arguments (an
    absent tensor passed as logits, never read)."""
    lg = r.logits
    return (lg, r.bias if r.bias is not None else lg, r.tid2eid if r.hashed else lg,
            r.input_ids.reshape(-1) if r.hashed else lg, lg.shape[1], float(r.scaling), lg.stride(0),
            r.tid2eid.stride(0) if r.hashed else 0)


def route_consts(r: Routing) -> dict:
    """`_route_slot`'s constexprs, as the GEMV kernels name them (`gemv._gemv_unit`)."""
    return dict(ROUTE=True, ROUTE_HASH=r.hashed, ROUTE_K=r.top_k, ROUTE_KP=triton.next_power_of_2(r.top_k),
                ROUTE_EP=triton.next_power_of_2(r.logits.shape[1]))
