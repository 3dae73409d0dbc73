"""Where the tokens of a ragged step belong, as device tensors: built once per step from the `SeqBatch` columns and
read by every layer's attention (the Triton kernel and its reference alike)."""

from __future__ import annotations

from typing import NamedTuple

import torch


class StepTokens(NamedTuple):
    """Where each token of a ragged step belongs, as device tensors (int32)."""
    seq: torch.Tensor          # [N] the token's sequence
    pos: torch.Tensor          # [N] its absolute position
    slot: torch.Tensor         # [B] each sequence's cache slot
    start: torch.Tensor        # [B] its tokens cached before the step
    first: torch.Tensor        # [B] its first token's index in the step
    pages: torch.Tensor        # [B, max pages] its page table (rows padded with 0)

    def spans(self) -> list[tuple[int, int, int, int]]:
        """(slot, start, first token, token count) of each sequence, on the host (one synchronisation): what the
        references loop over."""
        counts = torch.bincount(self.seq.long(), minlength=self.slot.shape[0]).tolist()
        return list(zip(self.slot.tolist(), self.start.tolist(), self.first.tolist(), counts))

    @classmethod
    def build(cls, slots, starts, lengths, pages, device) -> "StepTokens":
        """From a step's host columns (a `SeqBatch`'s slots, starts, lengths and page tables)."""
        seq = [i for i, n in enumerate(lengths) for _ in range(n)]
        pos = [s + k for s, n in zip(starts, lengths) for k in range(n)]
        first, total = [], 0
        for n in lengths:
            first.append(total)
            total += n
        pages = pages or ((),) * len(slots)          # a batch without page tables (no compressed layer reads them)
        width = max((len(p) for p in pages), default=0) or 1
        table = [list(p) + [0] * (width - len(p)) for p in pages] or [[0]]
        i32 = dict(dtype=torch.int32, device=device)
        return cls(torch.tensor(seq, **i32), torch.tensor(pos, **i32), torch.tensor(slots, **i32),
                   torch.tensor(starts, **i32), torch.tensor(first, **i32), torch.tensor(table, **i32))
