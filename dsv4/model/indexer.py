"""The lightning indexer of CSA layers: picks, per query, the top-k compressed entries the attention may read.

Keys K_j come from the indexer's own ratio-4 compressor (width index_head_dim). Queries are
q_t = rope_t(W_qb qr_t) per index head (qr = the q_norm'ed query latent). Head weights
w_t = weights_proj(x_t) * index_n_heads^-1/2, and the scale index_head_dim^-1/2. Score
I[t, j] = scale * sum_h w[t,h] relu(q[t,h].K_j) (ReLU before the head sum). Only entries with (j+1)*4 <= t+1 are
candidates; the top min(index_topk, T) are taken and picks past the causal limit become -1 (invalid).

A fresh prefill (`forward`) scores against this chunk's keys; a cached step projects `queries` here and runs
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
        self.head_scale = self.n_heads ** -0.5             # on weights_proj's outputs
        self.wq_b = b.linear("wq_b", cfg.q_lora_rank, self.n_heads * self.head_dim)
        self.weights_proj = b.linear("weights_proj", cfg.hidden_size, self.n_heads)
        self.compressor = Compressor(cfg, 4, self.head_dim, b.sub("compressor"))
        self.ops = b.ops

    def queries(self, x: torch.Tensor, qr: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rotated queries [B, S, H, hd], weights_proj(x) [B, S, H]) of tokens x, qr whose positions' rope is
        cos / sin [B, S, rope / 2] (the layer's, which attention computed). The head weights are the second in fp32
        times `head_scale` (`Ops.index_picks` scales them as it reads them)."""
        B, S, _ = x.shape
        q = self.ops.norm_rope(self.wq_b(qr).view(B, S, self.n_heads, self.head_dim), cos, sin)
        return q, self.weights_proj(x)

    def forward(self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, rope: Rope) -> torch.Tensor:
        """Picks [B, S, k] of a fresh prefill (keys from this chunk only) for queries at `positions`."""
        keys = self.compressor(x, positions, rope)
        q, w = self.queries(x, qr, *rope(positions))
        return index_select(index_scores(q, w.float() * self.head_scale, keys, self.scale), positions, self.topk,
                            self.compressor.ratio)
