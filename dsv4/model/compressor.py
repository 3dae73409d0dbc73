"""The KV compressor: pools every `ratio` tokens into one compressed entry. One implementation serves three users:

* HCA (ratio 128): one series of width head_dim; entry j pools window W_j = {128j .. 128j+127}.
* CSA (ratio 4) and the indexer's own compressor (ratio 4, width index_head_dim): two series per token,
  `[Ca | Cb]` (first half / second half of wkv, wgate and ape). Entry j pools 2*ratio slots: the Ca half
  of window j-1 (slots 0..ratio-1; for j = 0 value 0 and gate -inf, i.e. weight 0) and the Cb half of
  window j (slots ratio..2*ratio-1). The Ca half of a window therefore belongs to the *next* entry.

For each slot s and channel c: score[s, c] = (W_gate x_s)[c] + ape[pos_s mod ratio, c]; the entry is
sum_s softmax_s(score[:, c]) * (W_kv x_s)[c] (softmax per channel over the slots, fp32), then RMSNorm and
the layer's rope at position j*ratio (the window start) on the trailing rope channels.
Entry j is complete once token j*ratio + ratio - 1 is seen; query t may use it iff (j+1)*ratio <= t+1.

The math lives with the kernels' references (`kernels.ref.compress_pool` / `compress_finish`): the stateless
prefill (`forward`) pools the complete windows of a fresh sequence here; a cached step runs `Ops.compress` on the
rows of wkv and wgate (ape added as they are read) of every sequence at once (the Triton kernel on the GPU), which
keeps the open window's rows and, for the overlapping scheme, the Ca half of the last complete window in the layer's
`CompressorState`, so chunk boundaries may fall anywhere relative to the windows and the entries equal those of a
one-shot prefill.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..kernels.ref import compress_finish, compress_pool
from .linear import Builder
from .norm_rope import RMSNorm, Rope


class Compressor(nn.Module):
    def __init__(self, cfg: ModelConfig, ratio: int, head_dim: int, b: Builder):
        super().__init__()
        self.ratio, self.head_dim = ratio, head_dim
        self.overlap = ratio == 4
        width = head_dim * (2 if self.overlap else 1)
        self.wkv = b.linear("wkv", cfg.hidden_size, width)
        self.wgate = b.linear("wgate", cfg.hidden_size, width)
        self.register_buffer("ape", torch.empty(ratio, width, dtype=torch.float32))
        self.norm = RMSNorm(head_dim, cfg.rms_norm_eps)

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, S, d] at `positions` [B, S] -> (kv, score) [B, S, width]; score includes ape[pos mod ratio]."""
        return self.wkv(x), self.wgate(x) + self.ape[positions % self.ratio]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: Rope) -> torch.Tensor:
        """Stateless: entries [B, n, head_dim] of a fresh sequence at positions 0..S-1 (the incomplete tail
        window is dropped)."""
        B, S, _ = x.shape
        n = S // self.ratio
        kv, score = self.project(x[:, : n * self.ratio], positions[:, : n * self.ratio])
        kv, score = kv.unflatten(1, (n, self.ratio)), score.unflatten(1, (n, self.ratio))
        cos, sin = rope(torch.arange(n, device=x.device) * self.ratio)
        return compress_finish(compress_pool(kv, score, None, self.overlap, self.head_dim), cos, sin,
                               self.norm.weight, self.norm.eps)
