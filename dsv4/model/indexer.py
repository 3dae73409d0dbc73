"""The lightning indexer of CSA layers: picks, per query, the top-k compressed entries the attention may read.

Keys K_j come from the indexer's own ratio-4 compressor (width index_head_dim). Queries are
q_t = rope_t(W_qb qr_t) per index head (qr = the q_norm'ed query latent). Head weights
w_t = weights_proj(x_t) * index_head_dim^-1/2 * index_n_heads^-1/2. Score I[t, j] = sum_h w[t,h] relu(q[t,h].K_j)
(ReLU before the head sum). Only entries with (j+1)*4 <= t+1 are candidates; the top min(index_topk, T)
are taken and picks past the causal limit become -1 (invalid).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..kernels.ref import visible_entries
from .compressor import Compressor
from .linear import Builder
from .norm_rope import Rope, apply_rope
from .state import CompressorState


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig, b: Builder):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = b.linear("wq_b", cfg.q_lora_rank, self.n_heads * self.head_dim)
        self.weights_proj = b.linear("weights_proj", cfg.hidden_size, self.n_heads)
        self.compressor = Compressor(cfg, 4, self.head_dim, b.sub("compressor"))

    def scores(self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
               rope: Rope) -> torch.Tensor:
        """Index scores fp32 [B, S, T] of queries (x, qr at `positions`) against keys [B, T, index_head_dim]."""
        B, S, _ = x.shape
        cos, sin = rope(positions)
        q = apply_rope(self.wq_b(qr).view(B, S, self.n_heads, self.head_dim), cos.unsqueeze(2), sin.unsqueeze(2))
        s = torch.matmul(q.float(), keys.transpose(-1, -2).float().unsqueeze(1))      # [B, S, H, T]
        s = F.relu(s) * self.head_dim ** -0.5
        w = self.weights_proj(x).float() * self.n_heads ** -0.5                          # [B, S, H]
        return (s * w.unsqueeze(-1)).sum(dim=2)

    def select(self, scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Top-k entry ids [B, S, k] (int64), -1 where a pick is not a visible entry."""
        limit = visible_entries(positions, self.compressor.ratio).unsqueeze(-1)          # [B, S, 1]
        ids = torch.arange(scores.shape[-1], device=scores.device)
        scores = scores.masked_fill(ids >= limit, float("-inf"))
        picks = scores.topk(min(self.topk, scores.shape[-1]), dim=-1).indices
        return picks.masked_fill(picks >= limit, -1)

    def forward(self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, rope: Rope,
                state: CompressorState | None = None, start: int = 0, pages: tuple[int, ...] = ()) -> torch.Tensor:
        """Picks [B, S, k] for queries at `positions`. state=None: a fresh prefill (keys from this chunk only);
        otherwise one sequence whose first `start` tokens are in `state` (keys in its `pages`), scored against
        every emitted key."""
        if state is None:
            keys = self.compressor(x, positions, rope)
        else:
            self.compressor.append(*self.compressor.project(x, positions), start, state, pages, rope)
            keys = self.compressor.emitted(state, pages, (start + x.shape[1]) // self.compressor.ratio)
        return self.select(self.scores(x, qr, positions, keys, rope), positions)
