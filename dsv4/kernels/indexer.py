"""The lightning indexer's picks for every token of a ragged step (`ref.index_picks`'s contract): one scoring launch
over the keys each token's sequence has emitted, read through its page table, then a top-k on the device.

    q        [N, H, hd]     rotated index queries
    weights  [N, H]         weights_proj(x); the head weights are these in fp32 times weight_scale (H^-1/2)
    entries  [pages, E, hd] the indexer compressor's keys
    scores   [N, max_keys]  fp32: scale * sum_h weights[h] relu(q[h] . key_j) for j < (pos + 1) // ratio,
                            -inf beyond

Program (token t, block of BT keys): the token's H x hd queries (H padded to a power of two >= 16) against BT keys
in one dot (all heads share each key row). max_keys, the width of the score rows, is a host bound on any sequence's
keys, so the launch has no data-dependent shape. The picks are `torch.topk` of each row (k = min(topk, max_keys));
picks past a token's visible keys (-inf scores) become -1, and the rows are padded with -1 to topk columns.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .policy import next_pow2
from .steps import StepTokens


class Shape(NamedTuple):
    """The launch's compile-time values (one constexpr)."""
    HP: int                    # index heads, padded to a power of two >= 16
    HD: int                    # index head_dim
    E: int                     # keys per page
    RATIO: int
    BT: int                    # keys per program
    DOT: object                # operand dtype of the products


@triton.jit
def _scores_kernel(q, w, entries, out, steps, H, q_t, w_t, out_t, pages_seq, max_keys, scale, w_scale,
                   L: tl.constexpr):
    HP: tl.constexpr = L.HP
    HD: tl.constexpr = L.HD
    E: tl.constexpr = L.E
    BT: tl.constexpr = L.BT
    DOT: tl.constexpr = L.DOT
    t = tl.program_id(0)
    j = tl.program_id(1) * BT + tl.arange(0, BT)
    b = tl.load(steps.seq + t)
    visible = (tl.load(steps.pos + t) + 1) // L.RATIO
    valid = j < visible
    score = tl.full([BT], float("-inf"), tl.float32)
    if tl.program_id(1) * BT < visible:
        h = tl.arange(0, HP)
        d = tl.arange(0, HD)
        qt = tl.load(q + t.to(tl.int64) * q_t + h[:, None] * HD + d[None, :], mask=(h < H)[:, None], other=0.0)
        page = tl.load(steps.pages + b * pages_seq + j // E, mask=valid, other=0).to(tl.int64)
        k = tl.load(entries + (page * E + j % E)[:, None] * HD + d[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(qt.to(DOT), tl.trans(k.to(DOT)), out_dtype=tl.float32)                 # [H, BT]
        wt = tl.load(w + t.to(tl.int64) * w_t + h, mask=h < H, other=0.0).to(tl.float32) * w_scale
        score = tl.where(valid, tl.sum(tl.maximum(s, 0.0) * scale * wt[:, None], axis=0), float("-inf"))
    tl.store(out + t.to(tl.int64) * out_t + j, score, mask=j < max_keys)


def index_scores(q: torch.Tensor, weights: torch.Tensor, entries: torch.Tensor, steps: StepTokens, ratio: int,
                 scale: float, max_keys: int, weight_scale: float = 1.0) -> torch.Tensor:
    """Score rows fp32 [N, max_keys] (module docstring)."""
    N, H, hd = q.shape
    if hd & (hd - 1) or hd < 16:
        raise ValueError(f"index_scores needs a power-of-two head_dim >= 16, got q {tuple(q.shape)}")
    out = torch.empty(N, max_keys, dtype=torch.float32, device=q.device)
    if N == 0 or max_keys == 0:
        return out
    interp = q.device.type != "cuda"
    dot = tl.float32 if interp or q.dtype == torch.float32 else tl.bfloat16
    bt = max(16, min(64, next_pow2(max_keys)))
    q, weights = q.contiguous(), weights if weights.stride(-1) == 1 else weights.contiguous()   # weights: row stride
    shape = Shape(max(16, next_pow2(H)), hd, entries.shape[1], ratio, bt, dot)
    _scores_kernel[(N, triton.cdiv(max_keys, bt))](q, weights, entries, out, steps, H, q.stride(0), weights.stride(0),
                                                  out.stride(0), steps.pages.stride(0), max_keys, scale,
                                                  weight_scale, shape, num_warps=4)
    return out


def index_picks(q: torch.Tensor, weights: torch.Tensor, entries: torch.Tensor, steps: StepTokens, topk: int,
                ratio: int, scale: float, max_keys: int | None = None, weight_scale: float = 1.0) -> torch.Tensor:
    """[N, topk] int64 entry ids, -1 past each token's picks (module docstring). max_keys: a bound on any sequence's
    keys after the step (by default every key the pages could hold)."""
    if max_keys is None:
        max_keys = steps.pages.shape[1] * entries.shape[1]
    scores = index_scores(q, weights, entries, steps, ratio, scale, max_keys, weight_scale)
    picks = torch.full((q.shape[0], topk), -1, dtype=torch.long, device=q.device)
    k = min(topk, max_keys)
    if k:
        top = scores.topk(k, dim=-1)
        picks[:, :k] = top.indices.masked_fill(top.values == float("-inf"), -1)
    return picks
