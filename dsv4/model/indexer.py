"""The lightning indexer of CSA layers: picks, per query, the top-k compressed entries the attention may read.

Keys K_j come from the indexer's own ratio-4 compressor (width index_head_dim). Queries are
q_t = rope_t(W_qb qr_t) per index head (qr = the q_norm'ed query latent). Head weights
w_t = weights_proj(x_t) * index_n_heads^-1/2, and the scale index_head_dim^-1/2. Score
I[t, j] = scale * sum_h w[t,h] relu(q[t,h].K_j) (ReLU before the head sum). Only entries with (j+1)*4 <= t+1 are
candidates; the top min(index_topk, T) are taken and picks past the causal limit become -1 (invalid).

A fresh prefill (`forward`) scores against this chunk's keys; a cached step rotates its queries here and runs
`Ops.index_picks` over every sequence's emitted keys in the layer's pages (the Triton kernel on the GPU).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..kernels.ref import index_scores, index_select
from .compressor import Compressor
from .linear import Builder
from .norm_rope import Rope


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig, b: Builder):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.scale = self.head_dim ** -0.5
        self.head_scale = self.n_heads ** -0.5             # on weights_proj's outputs (the head weights)
        self.wq_b = b.linear("wq_b", cfg.q_lora_rank, self.n_heads * self.head_dim)
        self.weights_proj = b.linear("weights_proj", cfg.hidden_size, self.n_heads)
        self.compressor = Compressor(cfg, 4, self.head_dim, b.sub("compressor"))
        self.ops = b.ops

    def rotated_queries(self, qr: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        product: torch.Tensor | None = None) -> torch.Tensor:
        """Queries [B, S, H, hd] of the q_norm'ed latents qr [B, S, q_lora_rank] whose positions' rope is cos / sin
        [B, S, rope / 2] (the layer's, which attention computed). product: wq_b(qr) [B, S, H hd] where the caller
        computed it (attention's product of qr with its own wq_b, `Attention.fuse_queries_`)."""
        B, S, _ = qr.shape
        product = self.wq_b(qr) if product is None else product
        return self.ops.norm_rope(product.view(B, S, self.n_heads, self.head_dim), cos, sin)

    def forward(self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, rope: Rope) -> torch.Tensor:
        """Picks [B, S, k] of a fresh prefill (keys from this chunk only) for queries at `positions`."""
        keys = self.compressor(x, positions, rope)
        q, w = self.rotated_queries(qr, *rope(positions)), self.weights_proj(x).float() * self.head_scale
        return index_select(index_scores(q, w, keys, self.scale), positions, self.topk, self.compressor.ratio)
