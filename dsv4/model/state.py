"""Decode-time state: what one attention layer keeps per sequence, as views into runtime-owned pools.

The runtime allocates every tensor here and hands the model these views; the forward reads them and writes the new
tokens' rows in place, and never allocates persistent memory. No count is stored: a sequence's `start` (tokens
already cached) determines which rows are live, so a slot needs only `reset` (the CSA Ca half back to "no previous
window") before a new sequence uses it.

Per layer (dsv4-architecture.md §15), for `slots` sequences:
  window       [slots, window, D]          rotated K=V of the last `window` tokens; token p at row p mod window
  compressor   rolling state of the open (incomplete) window per slot, for CSA the Ca half of the last complete
               window (the next entry's first `ratio` slots), and the emitted entries in pages shared by all
               sequences: entry j of a sequence is row j mod E of page pages[j // E] (E entries per page)
  indexer      (CSA only) the same for the indexer's own ratio-4 compressor, width index_head_dim

`SeqBatch` describes one ragged step: which slots take part, where each sequence starts, how many of the flattened
tokens are its own, and its page table. The reference model loops over it; a batched kernel takes the same
columns as device tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

import torch

from ..kernels.steps import StepTokens


@dataclass(frozen=True)
class CompressorState:
    open_kv: torch.Tensor                # [slots, ratio, width] compute dtype: open window, token p at row p mod ratio
    open_score: torch.Tensor             # [slots, ratio, width] fp32: its gate logits incl. ape[p mod ratio]
    prev_kv: torch.Tensor | None         # CSA: [slots, ratio, head_dim] Ca half (kv) of the last complete window
    prev_score: torch.Tensor | None      # CSA: [slots, ratio, head_dim] fp32; -inf = no window yet (weight 0)
    entries: torch.Tensor                # [pages, E, head_dim] compute dtype: emitted entries, paged (all slots)
    entry_scales: torch.Tensor | None = None   # [pages, E] fp32: then entries hold fp8 e4m3 codes of entry / scale
    packed_nope: int = 0                 # > 0: entries are packed fp8 rows uint8 [pages, E, kv_row_bytes]
                                         # (`kernels.ref.fp8_kv_pack`) with this many fp8 channels

    def reset(self, slot: int) -> None:
        if self.prev_kv is not None:
            self.prev_kv[slot].zero_()
            self.prev_score[slot].fill_(float("-inf"))


@dataclass(frozen=True)
class LayerState:
    window: torch.Tensor                 # [slots, window, D] compute dtype
    compressor: CompressorState | None   # CSA and HCA layers
    indexer: CompressorState | None      # CSA layers
    fp8_nope: int = 0                    # > 0 (the fp8 cache): the step's K = V rows keep the values of packed fp8
                                         # rows (`kernels.ref.fp8_kv_round`), in the window as in the entries

    def reset(self, slot: int) -> None:
        for part in (self.compressor, self.indexer):
            if part is not None:
                part.reset(slot)


@dataclass(frozen=True)
class SeqBatch:
    """One ragged step: sequence i owns flattened tokens [offsets[i], offsets[i] + lengths[i]) at positions
    starts[i] .. starts[i] + lengths[i] - 1, and its state lives in cache slot slots[i]."""

    slots: tuple[int, ...]
    starts: tuple[int, ...]              # tokens of the sequence already in its cache slot
    lengths: tuple[int, ...]             # tokens of the sequence in this step (>= 1)
    pages: tuple[tuple[int, ...], ...] = ()   # page table per sequence, covering starts[i] + lengths[i] tokens
    tokens: StepTokens | None = field(default=None, compare=False)   # the same columns on the device (`on`)
    end_bound: int = 0                   # a bound on starts[i] + lengths[i] that kernels size by (0: the largest)

    def __post_init__(self):
        if not len(self.slots) == len(self.starts) == len(self.lengths):
            raise ValueError(f"SeqBatch columns differ in length: {len(self.slots)} slots, {len(self.starts)} "
                             f"starts, {len(self.lengths)} lengths")
        if len(set(self.slots)) != len(self.slots):
            raise ValueError(f"SeqBatch: a cache slot appears twice in {self.slots}")
        if self.pages and len(self.pages) != len(self.slots):
            raise ValueError(f"SeqBatch: {len(self.pages)} page tables for {len(self.slots)} sequences")
        if any(n < 1 for n in self.lengths) or any(s < 0 for s in self.starts):
            raise ValueError(f"SeqBatch: lengths must be >= 1 and starts >= 0, got {self.lengths} / {self.starts}")

    def on(self, device: torch.device | str) -> SeqBatch:
        """This batch with its columns also on `device` as `StepTokens` (built once per step, read by every layer)."""
        if self.tokens is not None and self.tokens.seq.device == torch.device(device):
            return self
        return replace(self, tokens=StepTokens.build(self.slots, self.starts, self.lengths, self.pages, device))

    def check_pages(self, entries_per_page: int, ratio: int) -> None:
        """Raise unless every page table covers its sequence's compressed entries of ratio `ratio` after the step."""
        for table, start, n in zip(self.pages or ((),) * len(self.slots), self.starts, self.lengths):
            if (start + n) // ratio > len(table) * entries_per_page:
                raise ValueError(f"the sequence's {len(table)} cache pages hold {len(table) * entries_per_page} "
                                 f"entries of ratio {ratio}; position {start + n - 1} needs entry "
                                 f"{(start + n) // ratio - 1}")

    @cached_property
    def max_length(self) -> int:
        """The most tokens any sequence feeds in the step."""
        return max(self.lengths)

    @cached_property
    def max_end(self) -> int:
        """The most tokens any sequence holds after the step (or `end_bound`, where given)."""
        return self.end_bound or max(s + n for s, n in zip(self.starts, self.lengths))

    def key_bound(self, ratio: int) -> int:
        """The most compressed entries of ratio `ratio` any sequence holds after the step (or `end_bound` allows)."""
        return self.max_end // ratio

    @property
    def offsets(self) -> tuple[int, ...]:
        out, total = [], 0
        for n in self.lengths:
            out.append(total)
            total += n
        return tuple(out)

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    def positions(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Absolute positions of the flattened tokens, int64 [num_tokens]."""
        return torch.cat([torch.arange(s, s + n, device=device) for s, n in zip(self.starts, self.lengths)])

    def tokens_between(self, a: int, b: int) -> SeqBatch:
        """The part of this step made of its flattened tokens [a, b): each sequence keeps the tokens it has there, at
        their positions (a sequence cut by a moves its start), with its slot, page table and end_bound. Running
        the parts in order writes the cache as the whole step does (a prompt may be split at any token)."""
        if not 0 <= a < b <= self.num_tokens:
            raise ValueError(f"token range [{a}, {b}) is not a non-empty part of the step's {self.num_tokens} tokens")
        keep = [i for i, (off, n) in enumerate(zip(self.offsets, self.lengths)) if off < b and off + n > a]
        skip = [max(0, a - self.offsets[i]) for i in keep]
        return SeqBatch(tuple(self.slots[i] for i in keep),
                        tuple(self.starts[i] + k for i, k in zip(keep, skip)),
                        tuple(min(self.offsets[i] + self.lengths[i], b) - self.offsets[i] - k
                              for i, k in zip(keep, skip)),
                        tuple(self.pages[i] for i in keep) if self.pages else (),
                        end_bound=self.end_bound)

    def spans(self):
        """(slot, start, token slice, page table) per sequence (an empty table where the batch has none)."""
        pages = self.pages or ((),) * len(self.slots)
        for slot, start, off, n, table in zip(self.slots, self.starts, self.offsets, self.lengths, pages):
            yield slot, start, slice(off, off + n), table
