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

The math is split so the stateless prefill (`forward`) and the cached step (`append`) share it: `project`
(per token), `pool` (complete windows, with the previous window's Ca half handed in), `finish` (norm + rope
at absolute window starts). `append` keeps the open window's rows (kv, score incl. ape) and, for the
overlapping scheme, the Ca half of the last complete window in a `CompressorState`, so chunk boundaries may
fall anywhere relative to the windows and the entries equal those of a one-shot prefill.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..config import ModelConfig
from .linear import Builder
from .norm_rope import RMSNorm, Rope, apply_rope
from .state import CompressorState


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

    def pool(self, kv: torch.Tensor, score: torch.Tensor,
             prev: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Complete windows kv, score [B, n, ratio, width] -> un-normalised entries [B, n, head_dim].

        `prev` is the (kv, score) Ca half [B, ratio, head_dim] of the window before the first one, if any.
        """
        B, n, m, _ = kv.shape
        if n == 0:
            return kv.new_zeros(B, 0, self.head_dim)
        if self.overlap:
            hd = self.head_dim
            if prev is None:
                prev = (kv.new_zeros(B, 1, m, hd), score.new_full((B, 1, m, hd), float("-inf")))
            else:
                prev = (prev[0].unsqueeze(1).to(kv.dtype), prev[1].unsqueeze(1).to(score.dtype))
            kv = torch.cat((torch.cat((prev[0], kv[:, :-1, :, :hd]), dim=1), kv[..., hd:]), dim=2)
            score = torch.cat((torch.cat((prev[1], score[:, :-1, :, :hd]), dim=1), score[..., hd:]), dim=2)
        return (kv * score.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2)

    def finish(self, pooled: torch.Tensor, first_window: int, rope: Rope) -> torch.Tensor:
        """RMSNorm and rope at the window starts: pooled [B, n, head_dim] of windows first_window.. -> entries."""
        starts = (torch.arange(pooled.shape[1], device=pooled.device) + first_window) * self.ratio
        cos, sin = rope(starts)
        return apply_rope(self.norm(pooled), cos, sin)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: Rope) -> torch.Tensor:
        """Stateless: entries [B, n, head_dim] of a fresh sequence at positions 0..S-1 (the incomplete tail
        window is dropped)."""
        B, S, _ = x.shape
        n = S // self.ratio
        kv, score = self.project(x[:, : n * self.ratio], positions[:, : n * self.ratio])
        kv, score = kv.unflatten(1, (n, self.ratio)), score.unflatten(1, (n, self.ratio))
        return self.finish(self.pool(kv, score), 0, rope)

    def append(self, kv: torch.Tensor, score: torch.Tensor, start: int, state: CompressorState, pages: Sequence[int],
               rope: Rope) -> None:
        """One sequence's next tokens (`project`ed kv, score [1, S, width] at positions start..start+S-1) into its
        state; new entries go to its pages (`state.entries` [pages, E, head_dim]: entry j is row j mod E of page
        pages[j // E])."""
        m, first = self.ratio, start // self.ratio
        held = start % m                                   # rows of the open window already in the state
        kv = torch.cat((state.open_kv[:, :held], kv), dim=1)
        score = torch.cat((state.open_score[:, :held], score), dim=1)
        n = kv.shape[1] // m
        per_page = state.entries.shape[1]
        if -(-(first + n) // per_page) > len(pages):
            raise ValueError(f"the sequence's {len(pages)} cache pages hold {len(pages) * per_page} entries of "
                             f"ratio {m}; position {start + kv.shape[1] - held - 1} needs entry {first + n - 1}")
        if n:
            win_kv, win_score = kv[:, :n * m].unflatten(1, (n, m)), score[:, :n * m].unflatten(1, (n, m))
            prev = (state.prev_kv, state.prev_score) if self.overlap else None
            new = self.finish(self.pool(win_kv, win_score, prev), first, rope)[0]
            j = torch.arange(first, first + n)
            page = torch.tensor(pages, dtype=torch.long)[j // per_page]
            state.entries[page.to(new.device), (j % per_page).to(new.device)] = new
            if self.overlap:                               # the Ca half of the last window feeds the next entry
                state.prev_kv.copy_(win_kv[:, -1, :, :self.head_dim])
                state.prev_score.copy_(win_score[:, -1, :, :self.head_dim])
        rest = kv.shape[1] - n * m
        state.open_kv[:, :rest] = kv[:, n * m:]
        state.open_score[:, :rest] = score[:, n * m:]

    @staticmethod
    def emitted(state: CompressorState, pages: Sequence[int], count: int) -> torch.Tensor:
        """The first `count` entries of the sequence whose page table is `pages` -> [1, count, head_dim]."""
        per_page = state.entries.shape[1]
        used = torch.tensor(pages[:-(-count // per_page)], dtype=torch.long, device=state.entries.device)
        return state.entries[used].flatten(0, 1)[None, :count]
