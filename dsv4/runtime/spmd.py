"""The step protocol of several ranks (SPMD with a driver): rank 0 schedules and samples, every rank runs the step.

Rank 0's `Engine` owns the scheduler, the requests and sampling. For each step its `Driver` broadcasts the step's
inputs over the control group (gloo, CPU): a header, then one int64 tensor holding the token ids and the `SeqBatch`
columns (slots, starts, lengths, page tables), the rows whose logits are wanted and the cache slots to reset first:

    header  [op, tokens N, sequences S, page entries P, rows R, resets Z, batch.end_bound, micro-batches M]
            (op: STEP or STOP)
    payload [ids (N) | slots (S) | starts (S) | lengths (S) | pages per sequence (S) | pages (P) | rows (R) |
             resets (Z)]

Then every rank runs the same `StageRunner.run` on its part of the model and its stage's cache (every rank holds the
same slots and page ids; a reset the engine makes between steps travels with the next step): a pipeline stage after
the first receives the previous stage's 4-stream residual [1, N, hc_mult, d] from the same TP rank of that stage
(point to point), runs its layers and sends its output on; the last stage computes the logits of the R rows (the
head's vocabulary slices gathered over its TP group) and its TP rank 0 sends them to rank 0, which samples. Workers
(every rank but 0) loop on `ControlChannel.receive` until STOP.

Decode steps of the graph runner (`runtime/graphs.py`; pp = 1) travel as a GRAPH message instead, a `GraphStep`:

    header  [GRAPH, rows b, page-table rows U, pages P, bucket, resets Z, length, 0]
    payload [ids (b) | positions (b) | slots (b) | page-row slots (U) | their lengths (U) | pages (P) | resets (Z)]

and every rank replays the same (bucket, length) graph of its part (`StageRunner.run_graph`), its collectives inside
the graph; every rank captured its graphs together at start-up, in the same order (runtime/workers.py).

Micro-batches: with several stages, a step of many tokens runs as M parts, its flattened tokens cut into M contiguous
ranges (`SeqBatch.tokens_between`; a prompt may be split at any token). A stage runs the parts in order and sends each
part's output on without waiting for the send, so stage s runs part m while stage s + 1 runs part m - 1: the step
takes about (M + P - 1) / M of one stage's time for the whole step instead of P times it. Rank 0 chooses M
(`Driver.micro_batches`): one part under pp = 1, else one part per `micro_batch_tokens` tokens, at most 4 per stage. A
part re-reads its stage's weights, so a decode step, whose time is the weights' bytes, is not split.

Failure: the ranks run in lockstep, so any failure during a step (a worker that dies, a collective that times out,
an exception on any rank) stops the whole group. `Driver.step` then raises `WorkerFailure` naming the rank and the
cause (what the launcher's watchdog saw, runtime/workers.py) and every later step raises it again at once; the
engine's requests of that step end with "error" and the exception reaches the API caller.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ..model import Transformer
from ..model.state import SeqBatch
from ..parallel import Shard
from .cache import KVCache
from .graphs import DecodeGraphs, GraphStep

STEP, STOP, GRAPH = 1, 2, 3
HEADER = 8
PP_MICRO_BATCH_TOKENS = 2048   # the fewest tokens of a pipeline micro-batch: an estimate (docs/parallel.md, Pipeline)
PP_MICRO_BATCHES_PER_STAGE = 4


def micro_batch_bounds(num_tokens: int, parts: int) -> list[tuple[int, int]]:
    """[a, b) token ranges of `parts` micro-batches as equal as integers allow (parts <= num_tokens)."""
    cuts = [num_tokens * k // parts for k in range(parts + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


class WorkerFailure(RuntimeError):
    """A rank of a parallel engine failed (died, raised, or a collective timed out); the whole group has stopped."""


@dataclass(frozen=True)
class StepInputs:
    ids: torch.Tensor                    # int64 [N] on the CPU: the step's flattened tokens
    batch: SeqBatch                      # their sequences (slots, starts, lengths, page tables)
    rows: tuple[int, ...]                # rows of the step's tokens whose logits rank 0 samples
    resets: tuple[int, ...] = ()         # cache slots to reset before the step
    micro_batches: int = 1               # parts the step's tokens run in, through the pipeline

    def encode(self) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.batch
        pages = b.pages or ((),) * len(b.slots)
        cols = [self.ids.tolist(), b.slots, b.starts, b.lengths, [len(p) for p in pages],
                [page for table in pages for page in table], self.rows, self.resets]
        header = torch.tensor([STEP, len(cols[0]), len(b.slots), len(cols[5]), len(self.rows), len(self.resets),
                               b.end_bound, self.micro_batches], dtype=torch.long)
        return header, torch.tensor([v for col in cols for v in col], dtype=torch.long)

    @staticmethod
    def decode(header: torch.Tensor, payload: torch.Tensor) -> StepInputs:
        n, s, p, r, z, end_bound, micro_batches = header[1:8].tolist()
        values = payload.tolist()
        cut = [n, s, s, s, s, p, r, z]
        cols, at = [], 0
        for size in cut:
            cols.append(values[at:at + size])
            at += size
        ids, slots, starts, lengths, counts, flat, rows, resets = cols
        tables, at = [], 0
        for c in counts:
            tables.append(tuple(flat[at:at + c]))
            at += c
        batch = SeqBatch(tuple(slots), tuple(starts), tuple(lengths), tuple(tables) if any(counts) else (),
                         end_bound=end_bound)
        return StepInputs(torch.tensor(ids, dtype=torch.long), batch, tuple(rows), tuple(resets), micro_batches)


class ControlChannel:
    """Rank 0 -> every rank: step messages broadcast over the control group (gloo on the CPU, with a timeout long
    enough for an idle server: a worker waits here between requests)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def send(self, inputs: StepInputs | GraphStep | None) -> None:
        """A step's inputs (a plain step, or a decode step of the graph runner), or None: STOP."""
        if inputs is None:
            dist.broadcast(torch.tensor([STOP] + [0] * (HEADER - 1), dtype=torch.long), src=0, group=self.group)
            return
        header, payload = _encode_graph_step(inputs) if isinstance(inputs, GraphStep) else inputs.encode()
        dist.broadcast(header, src=0, group=self.group)
        dist.broadcast(payload, src=0, group=self.group)

    def receive(self) -> StepInputs | GraphStep | None:
        header = torch.empty(HEADER, dtype=torch.long)
        dist.broadcast(header, src=0, group=self.group)
        op = int(header[0])
        if op == STOP:
            return None
        if op == GRAPH:
            size = 3 * int(header[1]) + 2 * int(header[2]) + int(header[3]) + int(header[5])
        else:
            size = int(header[1:6].sum()) + 3 * int(header[2])
        payload = torch.empty(size, dtype=torch.long)
        dist.broadcast(payload, src=0, group=self.group)
        return _decode_graph_step(header, payload) if op == GRAPH else StepInputs.decode(header, payload)


def _encode_graph_step(step: GraphStep) -> tuple[torch.Tensor, torch.Tensor]:
    """header [GRAPH, rows b, page rows U, pages P, bucket, resets Z, length, 0]; payload [ids (b) | positions (b) |
    slots (b) | page-row slots (U) | their lengths (U) | pages (P) | resets (Z)]."""
    tables = [t for _, t in step.pages]
    values = [*step.ids, *step.positions, *step.slots, *(slot for slot, _ in step.pages), *map(len, tables),
              *(page for t in tables for page in t), *step.resets]
    header = torch.tensor([GRAPH, len(step.ids), len(tables), sum(map(len, tables)), step.bucket, len(step.resets),
                           step.length, 0], dtype=torch.long)
    return header, torch.tensor(values, dtype=torch.long)


def _decode_graph_step(header: torch.Tensor, payload: torch.Tensor) -> GraphStep:
    b, u, _, bucket, z, length = header[1:7].tolist()
    v = payload.tolist()
    ids, positions, slots, page_slots, counts = v[:b], v[b:2 * b], v[2 * b:3 * b], v[3 * b:3 * b + u], \
        v[3 * b + u:3 * b + 2 * u]
    at, pages = 3 * b + 2 * u, []
    for slot, n in zip(page_slots, counts):
        pages.append((slot, tuple(v[at:at + n])))
        at += n
    return GraphStep(bucket, length, tuple(ids), tuple(positions), tuple(slots), tuple(pages), tuple(v[at:at + z]))


class StageRunner:
    """One rank's part of a step: its stage's layers (with its TP slices) over its stage's cache."""

    def __init__(self, model: Transformer, cache: KVCache, shard: Shard, device: torch.device, dtype: torch.dtype):
        self.model, self.cache, self.shard, self.device, self.dtype = model, cache, shard, device, dtype
        self.graphs: DecodeGraphs | None = None      # the decode runner over this rank's cache (pp = 1), if any
        layout = shard.layout
        self.prev_rank = shard.rank - layout.tp if not shard.first_stage else None
        self.next_rank = shard.rank + layout.tp if not shard.last_stage else None
        self.logits_rank = (layout.pp - 1) * layout.tp       # the last stage's TP rank 0 sends rank 0 the logits

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor | None:
        """The step on this rank, part by part; returns the logits [R, vocab] on rank 0 (None elsewhere, or when
        R = 0)."""
        for slot in inputs.resets:
            self.cache.reset(slot)
        cfg, batch = self.model.config, inputs.batch
        ids, positions = inputs.ids.to(self.device), batch.positions(self.device)
        sends, logits, rows = [], [], []            # the parts' sends in flight; the last stage's logits and rows
        for a, b in micro_batch_bounds(batch.num_tokens, inputs.micro_batches):
            part = batch if b - a == batch.num_tokens else batch.tokens_between(a, b)
            streams = None
            if self.prev_rank is not None:
                streams = torch.empty(1, b - a, cfg.hc_mult, cfg.hidden_size, dtype=self.dtype, device=self.device)
                dist.recv(streams, src=self.prev_rank)
            streams = self.model(ids[None, a:b], positions[None, a:b], self.cache.layers, part, streams=streams)
            if self.next_rank is not None:          # in flight while the next part runs
                sends.append((dist.isend(streams, dst=self.next_rank), streams))
            mine = [i for i, r in enumerate(inputs.rows) if a <= r < b]
            if mine and self.shard.last_stage:
                logits.append(self.model.head_logits(streams[:, [inputs.rows[i] - a for i in mine]])[0])
                rows += mine
        for work, _ in sends:
            work.wait()
        if not inputs.rows:
            return None
        rank = self.shard.rank
        if self.shard.last_stage:
            out = logits[0] if len(logits) == 1 else torch.cat(logits)
            if rows != sorted(rows):                # put the rows back in the step's order
                out = out[torch.tensor(rows).argsort().to(out.device)]
            if rank == 0:
                return out
            if rank == self.logits_rank:
                dist.send(out.contiguous(), dst=0)
            return None
        if rank == 0:
            out = torch.empty(len(inputs.rows), cfg.vocab_size, dtype=self.dtype, device=self.device)
            dist.recv(out, src=self.logits_rank)
            return out
        return None

    @torch.inference_mode()
    def run_graph(self, step: GraphStep) -> torch.Tensor | None:
        """A decode step of the graph runner on this rank (every TP rank replays its graph, whose all-reduces meet
        the others'); returns the logits [rows, vocab] on rank 0."""
        for slot in step.resets:
            self.cache.reset(slot)
        logits = self.graphs.replay(step)
        return logits[:len(step.ids)] if self.shard.rank == 0 else None

    def serve(self, channel: ControlChannel) -> None:
        """A worker's loop: run every step rank 0 sends until STOP."""
        while (inputs := channel.receive()) is not None:
            if isinstance(inputs, GraphStep):
                self.run_graph(inputs)
            else:
                self.run(inputs)


class Driver:
    """Rank 0's side: sends each step to the workers and runs its own part; resets are sent with the next step.

    `stopped(error)` is the launcher's hook (runtime/workers.py): it names the failed rank and its cause (waiting
    briefly for the watchdog to see a dying worker) and stops every rank; it returns the WorkerFailure to raise."""

    def __init__(self, runner: StageRunner, channel: ControlChannel, stopped,
                 micro_batch_tokens: int = PP_MICRO_BATCH_TOKENS):
        if micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens must be >= 1, got {micro_batch_tokens}")
        self.runner, self.channel, self._stopped = runner, channel, stopped
        self.cache = runner.cache
        self.micro_batch_tokens = micro_batch_tokens
        self.failure: WorkerFailure | None = None
        self._resets: list[int] = []

    @property
    def graphs(self) -> DecodeGraphs | None:
        """Rank 0's decode runner (every rank has one when the engine replays decode steps as graphs)."""
        return self.runner.graphs

    def micro_batches(self, num_tokens: int) -> int:
        """How many parts a step of num_tokens runs in through the pipeline (module docstring)."""
        pp = self.runner.shard.layout.pp
        if pp == 1:
            return 1
        return max(1, min(num_tokens // self.micro_batch_tokens, PP_MICRO_BATCHES_PER_STAGE * pp))

    def reset(self, slot: int) -> None:
        """Empty a cache slot now on rank 0, and on the other ranks before the next step."""
        self.cache.reset(slot)
        self._resets.append(slot)

    def step(self, ids: torch.Tensor, batch: SeqBatch, rows: list[int]) -> torch.Tensor | None:
        """Every rank runs the step of token ids [N] (CPU) and `batch`; -> logits [len(rows), vocab] (None if no
        rows). Raises WorkerFailure when any rank fails (then and at every later call)."""
        if self.failure is not None:
            raise self.failure
        inputs = StepInputs(ids, batch, tuple(rows), tuple(self._resets), self.micro_batches(len(ids)))
        self._resets.clear()
        return self._everywhere(inputs, self.runner.run)

    def graph_step(self, seqs) -> torch.Tensor:
        """Every rank replays the decode step of these sequences (`DecodeGraphs.prepare`; the pending resets travel
        with it); -> logits [len(seqs), vocab]. Raises WorkerFailure as `step` does."""
        if self.failure is not None:
            raise self.failure
        step = replace(self.runner.graphs.prepare(seqs), resets=tuple(self._resets))
        self._resets.clear()
        return self._everywhere(step, self.runner.run_graph)

    def _everywhere(self, message, run):
        """Send the step to the workers and run rank 0's part (`run(message)`); a failure of any rank stops them all
        (WorkerFailure, kept for every later call)."""
        with _interrupt_after():
            try:
                self.channel.send(message)
                return run(message)
            except Exception as e:
                self.failure = self._stopped(e)
                raise self.failure from e

    def stop(self) -> None:
        """Tell the workers to leave their loop (a clean shutdown)."""
        if self.failure is None:
            self.channel.send(None)


@contextmanager
def _interrupt_after():
    """Hold a Ctrl-C (SIGINT) that arrives during the block and raise it as KeyboardInterrupt after it: a step
    stopped half-way on rank 0 would leave the other ranks waiting in a collective. Only the main thread can."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        raise KeyboardInterrupt
