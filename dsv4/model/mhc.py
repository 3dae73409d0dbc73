"""Manifold-constrained hyper-connections: hc_mult residual streams, collapsed before and expanded after each block.

Per token, with streams X [n, d] (n = hc_mult):
    m    = fn @ rms(flatten(X))                 one RMS over all n*d values; fn [(2+n)*n, n*d], fp32
    pre  = sigmoid(m[:n] * scale[0] + base[:n]) + eps
    post = 2 * sigmoid(m[n:2n] * scale[1] + base[n:2n])              (no eps)
    comb = sinkhorn(m[2n:].view(n, n) * scale[2] + base[2n:])        comb[j, k]: source stream j -> k
    u    = sum_j pre[j] X[j]                    on the un-normalised streams
    X'   = post (x) F(u) + comb^T X             i.e. X'[k] = post[k] F(u) + sum_j comb[j, k] X[j]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .norm_rope import rms


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[..., n, n] -> doubly stochastic: row softmax + eps, a column normalisation, then iters-1 (row, column)."""
    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def _mixes(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    flat = rms(x.flatten(-2).float(), norm_eps)
    return F.linear(flat, fn.float())


def hc_pre(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, sinkhorn_iters: int,
           hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Streams x [B, S, n, d] -> (collapsed [B, S, d] in x.dtype, post fp32 [B, S, n], comb fp32 [B, S, n, n])."""
    n = x.shape[-2]
    pre_w, post_w, comb_w = _mixes(x, fn, norm_eps).split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = sinkhorn(comb_w.unflatten(-1, (n, n)) * scale[2] + comb_b.view(n, n), sinkhorn_iters, hc_eps)
    collapsed = (pre.unsqueeze(-1) * x).sum(dim=-2).to(x.dtype)
    return collapsed, post, comb


def hc_post(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Block output [B, S, d] and the block's input streams [B, S, n, d] -> new streams [B, S, n, d].

    comb is applied transposed (the first axis is the source stream). post and comb are cast to the stream
    dtype before mixing, as transformers does.
    """
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


def hc_head(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
            norm_eps: float) -> torch.Tensor:
    """Final collapse of the streams [B, S, n, d] -> [B, S, d]: a `pre` only (no post, no comb, no Sinkhorn)."""
    pre = torch.sigmoid(_mixes(x, fn, norm_eps) * scale.float() + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * x).sum(dim=-2).to(x.dtype)
