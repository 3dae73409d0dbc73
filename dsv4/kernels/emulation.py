"""NVFP4 W4A4 emulation as a variant of an `Ops` table (`Ops.reference(w4a4=True)`, `Ops.triton(w4a4=True)`).

Every product with an NVFP4 weight that carries a calibrated input_scale runs the table's `linear_w4a4`
(activations staged to NVFP4 as Blackwell stages them, alpha = input_scale * weight_scale_2 applied once); every
other product runs the table's own op. A block-diagonal projection runs group by group, an emulated shared expert
or routed expert stack expert by expert (the fused MoE kernels stream weights only). The variant changes numerics,
never the model: the model calls the same ops either way.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch

from ..formats import QWeight
from .ref import swiglu


def emulated(w: QWeight) -> bool:
    """W4A4 is defined for NVFP4 weights with a calibrated input_scale."""
    return w.fmt == "nvfp4" and w.input_scale is not None


def variant(base):
    """The W4A4 variant of an Ops table."""
    linear = partial(_linear, base=base.linear, w4a4=base.linear_w4a4)
    mlp = partial(_mlp, base=base.mlp, linear=linear)
    return replace(base, name=base.name + "+w4a4", w4a4=True, linear=linear, mlp=mlp,
                   grouped_linear=partial(_grouped_linear, base=base.grouped_linear, w4a4=base.linear_w4a4),
                   moe=partial(_moe, base=base.moe, linear=linear, mlp=mlp))


def expert(x: torch.Tensor, w13: QWeight, w2: QWeight, index: tuple, limit: float, linear) -> torch.Tensor:
    """One SwiGLU expert of a stack at `index` (() for the shared expert), each of its three products by `linear`."""
    h = swiglu(linear(x, w13.index(*index, 0)), linear(x, w13.index(*index, 1)), limit).to(x.dtype)
    return linear(h, w2.index(*index))


def _linear(x, w: QWeight, *, base, w4a4):
    return (w4a4 if emulated(w) else base)(x, w)


def _grouped_linear(x, w: QWeight, groups: int, *, base, w4a4):
    if not emulated(w):
        return base(x, w, groups)
    r = w.out_features // groups
    return torch.stack([w4a4(x[..., g, :], w.rows(g * r, (g + 1) * r)) for g in range(groups)], dim=-2)


def _mlp(x, w13: QWeight, w2: QWeight, limit: float, *, base, linear):
    if not (emulated(w13) or emulated(w2)):
        return base(x, w13, w2, limit)
    return expert(x, w13, w2, (), limit, linear)


def _moe(x, ids, weights, w13: QWeight, w2: QWeight, limit: float, shared=None, after_route: bool = False, *,
         base, linear, mlp):
    """The table's MoE where no weight is emulated; else the routed experts one at a time (their outputs weighted
    and summed in fp32, as `ref.moe` sums them) and the shared expert by the variant's `mlp`."""
    shared_emulated = shared is not None and (emulated(shared[0]) or emulated(shared[1]))
    if not (emulated(w13) or emulated(w2)):
        if not shared_emulated:
            return base(x, ids, weights, w13, w2, limit, shared=shared, after_route=after_route)
        out = base(x, ids, weights, w13, w2, limit, after_route=after_route)
    else:
        acc = torch.zeros(x.shape[0], w2.out_features, dtype=torch.float32, device=x.device)
        for e in ids.unique().tolist():
            tok, slot = torch.where(ids == e)
            acc.index_add_(0, tok, expert(x[tok], w13, w2, (e,), limit, linear).float() * weights[tok, slot, None])
        out = acc.to(x.dtype)
    return out if shared is None else out + mlp(x, *shared, limit)
