"""Decode steps as CUDA graph replays: embedding, every layer, the head and its logits in one launch.

A decode step (every scheduled sequence feeds one token) of b sequences runs the graph captured for the smallest
batch bucket B >= b (1, 2, 4, ... 256, and max_num_seqs) and the smallest length bucket L (4K, 16K, 64K, ... and
max_model_len) that holds every sequence's positions: the indexer scores and sorts rows of L / 4 keys and attention
splits its keys by L, so a short sequence does not pay for the longest one the engine allows. The graph reads static
device buffers, filled in place before each replay: token ids, positions and cache slots (a pinned host buffer, one
non-blocking copy; two such buffers in turns), or ids taken from an earlier step's sampled tokens on the device (a
step launched ahead: `Engine.async_scheduling`); its step's page tables are gathered inside the graph from a device
table of every slot's pages, which is written only when a sequence's pages change (every PAGE_TOKENS positions).
Rows b..B-1 are padding: token 0 at position 0 in the cache's padding slot (a slot no sequence holds), where no
compressed window closes and nothing a real sequence reads is written. Kernel plans are made at capture (a warm-up
run per bucket on the padding slot first); every launch of the step is then on the device, with no host
synchronization until the caller reads the sampled tokens.

Without capture (`capture=False`: the engine's `enforce_eager` on CUDA, and the tests on the CPU) `run` executes the
same padded static-buffer step eagerly, with the graphs' kernel plans and so their tokens; the tests compare it
against the engine's plain step on the CPU.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

import torch

from ..kernels.steps import StepTokens
from ..model import Transformer
from ..model.state import LayerState, SeqBatch
from .cache import pages_for
from .sequence import Sequence

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
FIRST_LENGTH, LENGTH_STEP = 4096, 4           # length buckets: 4K, 16K, 64K, ... then max_model_len


@dataclass(frozen=True)
class GraphStep:
    """One decode step of the runner, as every rank of a parallel engine replays it: the first len(ids) rows of the
    (bucket, length) bucket feed these token ids at these positions in these cache slots (the other rows are
    padding); `pages` rewrites the page-table rows of the listed slots first, and `resets` (a parallel engine's, sent
    with the step) empties cache slots before that."""
    bucket: int
    length: int
    ids: tuple[int, ...]
    positions: tuple[int, ...]
    slots: tuple[int, ...]
    pages: tuple[tuple[int, tuple[int, ...]], ...] = ()
    resets: tuple[int, ...] = ()


def length_buckets(max_model_len: int) -> list[int]:
    out, n = [], FIRST_LENGTH
    while n < max_model_len:
        out.append(n)
        n *= LENGTH_STEP
    return out + [max_model_len]


class DecodeGraphs:
    def __init__(self, model: Transformer, layers: list[LayerState], max_num_seqs: int, max_model_len: int,
                 pad_slot: int, capture: bool = True, lengths: list[int] | None = None):
        """`layers`: the cache's layer states, whose slot `pad_slot` no sequence holds. `lengths`: the length
        buckets (by default `length_buckets(max_model_len)`)."""
        self.model, self.layers, self.pad_slot = model, layers, pad_slot
        self.device = model.embed.weight.device
        self.max_model_len = max_model_len
        self.buckets = sorted({b for b in BUCKETS if b < max_num_seqs} | {max_num_seqs})
        self.lengths = sorted(lengths or length_buckets(max_model_len))
        width, largest = pages_for(max_model_len), self.buckets[-1]
        self.tables = torch.zeros(pad_slot + 1, width, dtype=torch.int32, device=self.device)
        self._rows: dict[int, tuple[int, int]] = {}       # slot -> (id of its sequence, pages on the device)
        pin = self.device.type == "cuda"
        # Pinned host buffers, two of each used in turns: a step launched ahead (`replay(ids=...)`) fills one while
        # the copy out of the other may still be queued. `_copied[i]` is recorded after the copies out of buffer i,
        # and its next filling waits for it (on the CPU a copy is done when it returns).
        self.host = [torch.zeros(3, largest, dtype=torch.int64, pin_memory=pin)      # token ids, positions, slots
                     for _ in range(2)]
        self.host_array = [h.numpy() for h in self.host]  # the same memory, which `replay` fills through numpy
        self.host_rows = [torch.zeros(largest * width, dtype=torch.int32, pin_memory=pin)   # changed page-table rows
                          for _ in range(2)]
        self.host_row_slots = [torch.zeros(largest, dtype=torch.int64, pin_memory=pin) for _ in range(2)]  # and slots
        self._copied = [torch.cuda.Event() for _ in range(2)] if pin else None
        self._turn = 0
        self.inputs = torch.zeros(3, largest, dtype=torch.int64, device=self.device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}       # by (batch, length) bucket
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.memory = 0                                   # bytes the captured graphs hold
        if capture and self.device.type == "cuda":
            self._capture()

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def takes(self, plan: list[tuple[Sequence, int]]) -> bool:
        """Whether the step is a decode step this runner can replay: every sequence feeds its one pending token (a
        one-token chunk of a longer prompt gets no token from the step, so its row would have no place)."""
        return 0 < len(plan) <= self.max_batch and all(n == 1 and s.num_pending == 1 for s, n in plan)

    def forget(self, slot: int) -> None:
        """The slot was freed or reset: its page table row is rewritten when a sequence next uses it."""
        self._rows.pop(slot, None)

    @torch.inference_mode()
    def run(self, seqs: list[Sequence]) -> torch.Tensor:
        """Logits [len(seqs), vocab rows] of the next token of each sequence, which feeds its one pending token."""
        return self.replay(self.prepare(seqs))[:len(seqs)]

    def prepare(self, seqs: list[Sequence], ahead: bool = False) -> GraphStep:
        """The step of these decoding sequences: its buckets, inputs and the page-table rows that changed since the
        runner last saw each slot (noted as sent). ahead: the step is launched before the tokens it feeds are known
        on the host (each sequence's next token, at position num_cached): its ids are zeros here, and `replay` takes
        them from the device."""
        longest = max(s.num_cached for s in seqs) + 1
        pages = []
        for seq in seqs:
            table = seq.page_table.pages
            if self._rows.get(seq.slot) != (id(seq), len(table)):
                pages.append((seq.slot, tuple(table)))
                self._rows[seq.slot] = (id(seq), len(table))
        return GraphStep(next(x for x in self.buckets if x >= len(seqs)),
                         next((x for x in self.lengths if x >= longest), self.lengths[-1]),
                         (0,) * len(seqs) if ahead else tuple(s.chunk(1)[0] for s in seqs),
                         tuple(s.num_cached for s in seqs),
                         tuple(s.slot for s in seqs), tuple(pages))

    @torch.inference_mode()
    def replay(self, step: GraphStep, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Run a prepared step (its graph, or the same padded step eagerly) -> logits [bucket, vocab rows]. ids: the
        step's token ids as a device tensor [len(step.ids)] (an earlier step's sampled tokens, not yet read back),
        in place of step.ids."""
        turn, self._turn = self._turn, 1 - self._turn
        if self._copied is not None:             # the copies out of this turn's buffers (two replays ago) are done
            self._copied[turn].synchronize()
        if step.pages:          # every changed row in one copy (a step that admits a batch changes them all)
            n, cols = len(step.pages), max(len(table) for _, table in step.pages)
            rows = self.host_rows[turn][:n * cols].view(n, cols)     # contiguous: an asynchronous copy
            slots = self.host_row_slots[turn][:n]
            rows.zero_()
            for i, (slot, table) in enumerate(step.pages):
                rows[i, :len(table)] = torch.tensor(table, dtype=torch.int32)
                slots[i] = slot
            self.tables[:, :cols].index_copy_(0, slots.to(self.device, non_blocking=True),
                                              rows.to(self.device, non_blocking=True))
        b, bucket, host = len(step.ids), step.bucket, self.host_array[turn]   # numpy: less host time than torch's
        host[:2, b:bucket] = 0
        host[2, b:bucket] = self.pad_slot
        host[:, :b] = (step.ids, step.positions, step.slots)
        self.inputs[:, :bucket].copy_(self.host[turn][:, :bucket], non_blocking=True)
        if self._copied is not None:
            self._copied[turn].record(torch.cuda.current_stream(self.device))
        if ids is not None:
            self.inputs[0, :b].copy_(ids)
        key = (bucket, step.length)
        if key in self.graphs:
            self.graphs[key].replay()
            return self.outputs[key]
        return self._forward(bucket, step.length)

    def _forward(self, bucket: int, length: int) -> torch.Tensor:
        """The padded step of the static inputs' first `bucket` rows, sequences of at most `length` positions ->
        logits [bucket, vocab rows]."""
        ids, pos, slot = self.inputs[0, :bucket], self.inputs[1, :bucket], self.inputs[2, :bucket]
        row = torch.arange(bucket, dtype=torch.int32, device=self.device)
        pos32, slot32 = pos.to(torch.int32), slot.to(torch.int32)
        steps = StepTokens(seq=row, pos=pos32, slot=slot32, start=pos32, first=row, pages=self.tables[slot])
        batch = SeqBatch(tuple(range(bucket)), (0,) * bucket, (1,) * bucket, tokens=steps,
                         end_bound=length)
        streams = self.model(ids[None], pos[None], self.layers, batch)
        return self.model.head_logits(streams)[0]

    @torch.inference_mode()
    def _capture(self) -> None:
        """One graph per (batch, length) bucket, the largest first, all in one memory pool; a warm-up run on the
        padding slot before each capture compiles and plans its kernels."""
        # what the graphs hold is the device memory they take from a state with no cached free blocks on either
        # side (torch.cuda.graph itself empties the cache on entry, which would otherwise count as memory gained)
        torch.cuda.synchronize(self.device)
        gc.collect()
        torch.cuda.empty_cache()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        self.inputs[2].fill_(self.pad_slot)
        pool = None
        for key in sorted(((b, n) for b in self.buckets for n in self.lengths), reverse=True):
            self._forward(*key)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(*key)
            pool = graph.pool()
            self.graphs[key], self.outputs[key] = graph, out
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        self.memory = max(0, free_before - torch.cuda.mem_get_info(self.device)[0])
        log.info("captured decode CUDA graphs for batch sizes %s x lengths %s (%.2f GiB)", self.buckets, self.lengths,
                 self.memory / 2**30)
