"""The engine: requests in, one ragged model step at a time, tokens and text out.

A step flattens the scheduled chunks of all sequences (prefill chunks and single decode tokens alike) into
one [1, N] batch described by a `SeqBatch`, runs the model against the runtime-owned `KVCache`, computes
logits only at each sequence's last token when that token completes what is known of it (the last prompt
token, or the last sampled one), and samples them in one batch with per-request parameters. A sequence
ends on its SamplingParams (EOS, stop ids/strings, max_tokens) or, with finish_reason "length", when it
reaches max_model_len; its cache slot and pages are freed in the same step. When the cache's pages run out, the
scheduler preempts the youngest sequence, which recomputes its tokens later (scheduler.py).

The host's work on a step's tokens stays off the device's critical path. A step launches its work (the model, the
head, the sampler: no host sync on CUDA), then renders the tokens the previous step sampled (detokenization, stop
strings, logprobs, callbacks) while the device runs, and only then reads its own tokens back. Taking a token
(`OutputTracker.accept`) already decides whether it ends the sequence by EOS, a stop token id, max_tokens or
max_model_len: such a token, and a sequence's first, render at once. A stop string is found one step late: the
sequence has then been given a row in the running step, whose token is dropped. With async scheduling a decode step
of the runner launches the next decode step before its own tokens are read back, fed with them on the device, when
that step is known in advance (`_launch_ahead`); a sequence that its token ends by EOS or a stop id then also has a
row there, which is dropped.

A step is a transaction per sequence. A sequence's step commits when its cache state, `num_cached` and (if
it is due one) its sampled token have all advanced; until then a failure ends it, frees its slot and resets
it, and touches no other sequence:
* the model forward (or the head) raises: the sequences it was computing end with finish_reason "error";
* one request's own work raises (its sampling, detokenization, stop handling or `on_output` callback): that
  request ends with "error" (keeping the tokens rendered before), and every other one goes on with exactly the
  tokens it would have had alone;
* an interrupt (KeyboardInterrupt) or an error in the engine itself: the step's uncommitted sequences end
  ("abort" for an interrupt, "error" otherwise) and the exception propagates to the caller.
Every failure is logged with its traceback (logger `dsv4.runtime.engine`) and named in the output's `error`.

On several ranks (`driver`, runtime/spmd.py) this engine is rank 0's: it schedules and samples, and the driver runs
each step on every rank (the model and cache here are rank 0's parts). A failure of any rank during a step stops the
whole group: the step's requests end with "error" and the driver's WorkerFailure propagates, at this step and every
later one.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable

import torch

from ..model import Transformer
from ..model.state import SeqBatch
from .cache import PAGE_TOKENS, CacheCapacityError, KVCache, PageAllocator, pages_for, pages_that_fit
from .params import (
    OutputTracker,
    RequestError,
    RequestTypeError,
    SamplingParams,
    check_token_ids,
)
from .sampler import SamplingBatch, device_column, sample
from .graphs import DecodeGraphs
from .scheduler import Scheduler
from .sequence import Sequence
from .spmd import Driver

__all__ = ["Engine", "RequestError", "RequestTypeError", "TokenIdsOnly"]

log = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 4096
DEFAULT_MAX_NUM_SEQS = 8
DEFAULT_MAX_NUM_BATCHED_TOKENS = 1024
DEFAULT_MAX_LOGPROBS = 20                  # vLLM's max_logprobs
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9       # vLLM's: the share of the GPU's memory this engine may use


class TokenIdsOnly:
    """Stands in for a tokenizer when none is loaded: token ids in and out, no text."""

    def __init__(self, eos_id: int, vocab_size: int):
        self.eos_id, self.vocab_size = eos_id, vocab_size

    def bytes_of(self, token_id: int, skip_special_tokens: bool = False) -> bytes:
        return b""

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return ""


@dataclasses.dataclass(frozen=True)
class _Ahead:
    """A decode step launched before the tokens it feeds were read back (async scheduling)."""
    seqs: tuple[Sequence, ...]             # its rows, in order: each feeds its next token at position num_cached
    logits: torch.Tensor | Exception       # [len(seqs), vocab rows] on the device, or what its launch raised


class Engine:
    def __init__(self, model: Transformer, tokenizer=None, *, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                 max_model_len: int | None = None, max_num_batched_tokens: int | None = None,
                 max_logprobs: int = DEFAULT_MAX_LOGPROBS, num_cache_pages: int | None = None,
                 gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION, driver: Driver | None = None,
                 enforce_eager: bool = False, kv_cache_dtype: str = "auto", async_scheduling: bool = True):
        """The cache holds `num_cache_pages` pages of PAGE_TOKENS positions shared by all sequences; by default, on
        a GPU, as many as fit in `gpu_memory_utilization` of its memory after the weights and the largest step's
        activations, and elsewhere enough for max_num_seqs sequences of max_model_len tokens. driver: rank 0's side
        of a parallel engine, whose cache (rank 0's stage of it, sized with the other ranks) this engine uses.
        On CUDA, decode steps go through the decode runner (`graphs.DecodeGraphs`): they replay CUDA graphs captured
        here, or with `enforce_eager` (vLLM's name) run the same padded steps uncaptured, so that both give the same
        tokens (the kernels plan by the step's batch and length buckets, not its exact sizes); the graphs' memory is
        logged and kept in `graph_memory`. A driver's ranks have made their own runners (`driver.graphs`;
        runtime/workers.py), whose steps every rank replays. kv_cache_dtype (vLLM's name;
        `runtime.cache.pool_shapes`): "auto" keeps the cache in the compute dtype; "fp8-indexer" keeps the
        lightning indexer's keys as fp8 e4m3 with a power-of-two scale per key (132 instead of 256 bytes a key at
        V4's 128 channels); "fp8" also the attention's compressed entries as packed fp8 rows (584 instead of 1,024
        bytes), with the K = V rows rounded as DeepSeek's reference rounds them. async_scheduling (vLLM's name): a
        decode step of the runner whose successor is known before its tokens are read back launches that successor
        at once, fed with the sampled tokens on the device (`_launch_ahead`), so that the device does not wait for
        the host between decode steps; the tokens are the same either way."""
        self.kv_cache_dtype, self.async_scheduling = kv_cache_dtype, async_scheduling
        cfg = model.config
        self.model, self.driver = model, driver
        self.device, self.dtype = model.embed.weight.device, model.embed.weight.dtype
        self.max_model_len = max_model_len or min(cfg.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        if self.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                             f"({cfg.max_position_embeddings})")
        if tokenizer is not None:
            tokenizer.check_model(cfg)
        self.tokenizer = tokenizer or TokenIdsOnly(cfg.eos_token_id, cfg.vocab_size)
        self.text = tokenizer is not None
        # The head may have more rows than the tokenizer has ids (padding): those are never sampled.
        self.vocab_size = self.tokenizer.vocab_size
        self.max_logprobs = max_logprobs
        budget = max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_num_seqs)
        if driver is not None:
            num_cache_pages = driver.cache.num_pages
        elif num_cache_pages is None:
            num_cache_pages = self._pages_that_fit(max_num_seqs + 1, budget, gpu_memory_utilization)
        if num_cache_pages * PAGE_TOKENS < self.max_model_len:
            raise CacheCapacityError(f"the cache holds {num_cache_pages} pages of {PAGE_TOKENS} tokens "
                                     f"({num_cache_pages * PAGE_TOKENS} tokens), fewer than one sequence of "
                                     f"max_model_len={self.max_model_len}; lower max_model_len or give the cache more "
                                     "memory (gpu_memory_utilization, num_cache_pages)")
        padded = driver is None and self.device.type == "cuda"
        # the decode runner's cache has one more slot than sequences: the padding rows of its steps use it
        self.cache = driver.cache if driver else KVCache(cfg, max_num_seqs + padded, num_cache_pages, self.dtype,
                                                         self.device, kv_cache_dtype)
        self.scheduler = Scheduler(max_num_seqs, budget, PageAllocator(num_cache_pages))
        if driver is not None:                    # its ranks' runners, made and captured with them (or none)
            self.graphs = driver.graphs
        else:
            self.graphs = DecodeGraphs(model, self.cache.layers, max_num_seqs, self.max_model_len,
                                       pad_slot=max_num_seqs, capture=not enforce_eager) if padded else None
        self.graph_memory = self.graphs.memory if self.graphs else 0
        self._ids = itertools.count()
        self._live: dict[str, Sequence] = {}      # unfinished requests by id
        # Requests without a seed draw with this one (from torch's global generator) and the count of such draws.
        self._unseeded_seed = int(torch.randint(0, 2**62, ()))
        self._unseeded_draws = 0
        self._sampling: tuple[tuple[Sequence, ...], SamplingBatch] | None = None   # the last step's, by its rows
        self._unrendered: list[Sequence] = []     # took a token in the last step, rendered in the next
        self._ahead: _Ahead | None = None         # the next decode step, launched before this one's tokens were read

    def _pages_that_fit(self, slots: int, step_tokens: int, utilization: float) -> int:
        cfg = self.model.config
        if self.device.type != "cuda":
            return slots * pages_for(self.max_model_len)
        if not 0 < utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
        total = torch.cuda.get_device_properties(self.device).total_memory
        budget = total * utilization - torch.cuda.memory_allocated(self.device) - self._step_workspace(step_tokens)
        return pages_that_fit(cfg, budget, self.dtype, self.kv_cache_dtype, slots)

    @torch.inference_mode()
    def _step_workspace(self, tokens: int) -> int:
        """Peak bytes the activations of a `tokens`-token prefill step take (one profiling forward on a scratch
        cache of one sequence)."""
        tokens = min(tokens, self.max_model_len)
        scratch = KVCache(self.model.config, 1, pages_for(tokens), self.dtype, self.device, self.kv_cache_dtype)
        batch = SeqBatch((0,), (0,), (tokens,), (tuple(range(pages_for(tokens))),))
        ids = torch.zeros(1, tokens, dtype=torch.long, device=self.device)
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        streams = self.model(ids, batch.positions(self.device)[None], scratch.layers, batch)
        self.model.head_logits(streams[:, -1:])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del scratch, streams
        torch.cuda.empty_cache()
        return peak

    def cache_usage(self) -> float:
        """The share of the cache's pages in use."""
        pages = self.scheduler.pages
        return 1 - pages.num_free / pages.num_pages

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt_token_ids, params: SamplingParams | None = None, request_id: str | None = None,
                    prompt: str | None = None, on_output: Callable[[Sequence], None] | None = None) -> Sequence:
        """Queue one request; nothing runs until `step`. prompt_token_ids: a list / tuple of ints or a 1-D integer
        array or tensor. params are copied and checked (a later change to the caller's object has no effect).
        on_output(seq) is called each time the request's output advances (a token rendered, or the end); if it raises,
        the request ends with "error". Raises RequestError (a ValueError; RequestTypeError is also a TypeError) naming
        what is wrong, and then leaves the engine as it was."""
        if request_id is None:
            request_id = next(i for i in map(str, self._ids) if i not in self._live)
        request_id = str(request_id)
        if request_id in self._live:
            raise RequestError(f"request {request_id!r}: a request with this id is already running or waiting")
        ids, params = self.check_request(prompt_token_ids, params, f"request {request_id!r}")
        seq = Sequence(request_id, prompt, ids, params, OutputTracker(params, self.tokenizer), on_output)
        self.scheduler.add(seq)
        self._live[request_id] = seq
        return seq

    def check_request(self, prompt_token_ids, params: SamplingParams | None = None,
                      where: str = "request") -> tuple[list[int], SamplingParams]:
        """What `add_request` checks, without adding: -> (the prompt as a list of ints, a checked copy of params).
        `where` begins every error message."""
        def refuse(why: str, error=RequestError):
            raise error(f"{where}: {why}")

        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            refuse(f"params must be a SamplingParams, got {type(params).__name__}", RequestTypeError)
        try:
            params = dataclasses.replace(params)          # a copy, normalised and checked again
            ids = check_token_ids("prompt token ids", prompt_token_ids)
        except RequestError as e:
            refuse(str(e), type(e))
        vocab = self.model.config.vocab_size
        if not ids:
            refuse("the prompt is empty")
        if ids and not (0 <= min(ids) and max(ids) < vocab):
            bad = [i for i in ids if not 0 <= i < vocab]
            refuse(f"token ids {bad[:8]} are outside the model's vocabulary [0, {vocab})")
        if len(ids) > self.max_model_len:
            refuse(f"the prompt has {len(ids)} tokens, more than max_model_len={self.max_model_len}")
        bad = [i for i in params.stop_token_ids if i >= self.vocab_size]
        if bad:
            refuse(f"SamplingParams.stop_token_ids {bad[:8]} are outside the vocabulary [0, {self.vocab_size})")
        if params.logprobs is not None and params.logprobs > self.max_logprobs:
            refuse(f"SamplingParams.logprobs={params.logprobs} is more than this engine's max_logprobs="
                   f"{self.max_logprobs} (raise it with max_logprobs=...)")
        if params.stop and not self.text:
            refuse(f"stop strings {params.stop} need a tokenizer, and this engine has none (token ids only)")
        return ids, params

    def abort(self, request_id: str) -> None:
        """End a request with "abort" (its accepted tokens rendered first); an unknown or finished id is ignored."""
        seq = self._live.get(str(request_id))
        if seq is None:
            return
        try:
            seq.tracker.finish("abort")
        except Exception as e:
            self._fail(seq, e)
            return
        self._release(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def step(self, while_running: Callable[[list[Sequence]], None] | None = None) -> list[Sequence]:
        """Run one model step. Returns the sequences whose output changed: those whose previous token was rendered in
        this call, those that got their first token, and those that ended (failed ones included).

        The step's work is launched first; then, while the device runs it, the tokens sampled by the previous step are
        rendered (detokenized, checked for stop strings, their callbacks called) and `while_running(rendered)` is
        called, if given; only then are this step's tokens read back. A sequence that a stop string ends while it
        renders has already been given a row in this step: that row's token is dropped."""
        plan, logits = self._take_ahead()
        if not plan:
            plan, logits = self.scheduler.schedule(), None
        if not plan:
            rendered = self._render()
            if while_running is not None:
                while_running(rendered)
            return rendered
        uncommitted = {seq.request_id: seq for seq, _ in plan}
        try:
            return self._step(plan, uncommitted, while_running, logits)
        except BaseException as e:
            reason = "error" if isinstance(e, Exception) else "abort"
            if uncommitted:
                log.log(logging.WARNING if reason == "error" else logging.INFO, "step stopped by %s; requests %s end "
                        "with %r", type(e).__name__, list(uncommitted), reason)
            for seq in uncommitted.values():
                if not seq.finished:
                    self._end(seq, reason, e)
            raise

    def _take_ahead(self) -> tuple[list[tuple[Sequence, int]], torch.Tensor | Exception | None]:
        """The step launched ahead by the last one, as a plan and its logits (or what its launch raised), less the
        rows of sequences that have ended since (their tokens are dropped); ([], None) if there is none."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return [], None
        live = [i for i, s in enumerate(ahead.seqs) if not s.finished]
        for i in live:
            if ahead.seqs[i].num_pending != 1:
                raise RuntimeError(f"{ahead.seqs[i]} was launched ahead to feed one token but has "
                                   f"{ahead.seqs[i].num_pending} pending")
        logits = ahead.logits
        if len(live) < len(ahead.seqs) and live and not isinstance(logits, Exception):
            logits = logits[device_column(live, torch.int64, self.device)]
        return [(ahead.seqs[i], 1) for i in live], logits

    def _step(self, plan: list[tuple[Sequence, int]], uncommitted: dict[str, Sequence],
              while_running: Callable[[list[Sequence]], None] | None,
              logits: torch.Tensor | None = None) -> list[Sequence]:
        """Run the plan's step (or, with `logits`, take those of the step launched ahead for it)."""
        for slot in self.scheduler.vacated:       # slots freed by preemption: reset before anyone writes them
            self._reset(slot)
        self.scheduler.vacated.clear()
        offsets = list(itertools.accumulate((n for _, n in plan[:-1]), initial=0))
        decode_runner = logits is not None        # a step of this engine's runner: launched ahead, or below
        if isinstance(logits, Exception):         # launching the step ahead failed
            return self._end_all([s for s, _ in plan], uncommitted, logits)
        if logits is None and self.graphs is not None and self.graphs.takes(plan):
            decode_runner = self.driver is None
            seqs = [s for s, _ in plan]           # a decode step: one graph replay (it reads the page tables itself)
            if self.driver is not None:           # on every rank; a failure of any propagates
                logits = self.driver.graph_step(seqs)
            else:
                try:
                    logits = self.graphs.run(seqs)
                except Exception as e:
                    return self._end_all(seqs, uncommitted, e)
        elif logits is None:
            batch = SeqBatch(tuple(s.slot for s, _ in plan), tuple(s.num_cached for s, _ in plan),
                             tuple(n for _, n in plan), tuple(tuple(s.page_table.pages) for s, _ in plan))
            ids = torch.tensor([t for s, n in plan for t in s.chunk(n)], dtype=torch.long)
            if self.driver is not None:           # every rank runs the step; a failure of any propagates
                rows = [off + n - 1 for (s, n), off in zip(plan, offsets) if s.num_pending == n]
                logits = self.driver.step(ids, batch, rows)
            else:
                ids, positions = ids.to(self.device), batch.positions(self.device)
                try:
                    streams = self.model(ids[None], positions[None], self.cache.layers, batch)
                except Exception as e:
                    return self._end_all([s for s, _ in plan], uncommitted, e)
        due = []                                   # (sequence, row of its last token): it gets a token now
        for (seq, n), off in zip(plan, offsets):
            seq.num_cached += n
            if seq.num_pending == 0:
                due.append((seq, off + n - 1))
            else:                                  # a prefill chunk short of the prompt's end: committed
                del uncommitted[seq.request_id]
        seqs = [s for s, _ in due]
        draws = None
        if seqs:
            if logits is None:
                try:
                    rows = device_column([row for _, row in due], torch.int64, self.device)   # no wait
                    logits = self.model.head_logits(streams[:, rows])[0]
                except Exception as e:
                    return self._end_all(seqs, uncommitted, e)
            out, logits, counters = self._launch_sampling(seqs, logits[:, :self.vocab_size])
            ahead = decode_runner and self.async_scheduling and len(seqs) == len(plan)
            host = self._host_copy(out) if ahead else out   # queued before the step ahead, which would hold it
            draws = (host, logits, counters)
            if ahead and not isinstance(host, Exception):     # (host is out where the sampler failed)
                self._ahead = self._launch_ahead(seqs, out)
        rendered = self._render()                  # overlaps the device's work on this step
        if while_running is not None:
            while_running(rendered)
        changed = {id(s): s for s in rendered}
        if draws is not None:
            results = self._read_samples(seqs, *draws)
            if results is None:
                return self._recompute(seqs, uncommitted) + list(changed.values())
            for seq, result in zip(seqs, results):
                del uncommitted[seq.request_id]
                if seq.finished:                   # a stop string or a fault ended it while it rendered
                    continue
                if isinstance(result, Exception):
                    self._fail(seq, result)
                else:
                    self._accept(seq, *result)
                changed[id(seq)] = seq
        return list(changed.values())

    @staticmethod
    def _host_copy(out):
        """The sampler's output copied to the host without waiting (`SamplerOutput.to_host`), or what it or the
        copy raised."""
        if isinstance(out, Exception):
            return out
        try:
            return out.to_host()
        except Exception as e:
            return e

    def _launch_ahead(self, seqs: list[Sequence], out) -> _Ahead | None:
        """With async_scheduling (the caller's check), after a decode step of the runner has launched its sampler
        and the copy of its tokens to the host (`out`: the sampler's output on the device):
        launch the next decode step now, its token ids this step's sampled ones on the device, if that step is known
        before the tokens are: the sampler has launched, every sequence's next position has its page without
        preempting, and no waiting request could be admitted (no slot and pages for it, and no sequence ends by
        count). Its sequences are this step's less those whose token ends them by count (max_tokens, max_model_len);
        one that its token ends otherwise (EOS, a stop id or string, a fault) keeps its row there, which is dropped
        (`_take_ahead`), and its slot is reset behind it."""
        keep = [i for i, s in enumerate(seqs)
                if not s.tracker.next_ends_by_count() and s.num_tokens + 1 < self.max_model_len]
        sched = self.scheduler
        if not keep or len(seqs) != len(sched.running) or (sched.waiting and len(keep) < len(seqs)):
            return None
        nxt = [seqs[i] for i in keep]
        if not sched.grow_ahead(nxt) or sched.would_admit():
            return None
        ids = out.token_ids
        if len(keep) < len(seqs):
            ids = ids[device_column(keep, torch.int64, self.device)]
        try:
            logits = self.graphs.replay(self.graphs.prepare(nxt, ahead=True), ids)[:len(nxt)]
        except Exception as e:                    # the next step fails as it would have there
            logits = e
        return _Ahead(tuple(nxt), logits)

    def _recompute(self, seqs: list[Sequence], uncommitted: dict[str, Sequence]) -> list[Sequence]:
        """The step's tokens could not be read back in one batch after the step ahead was launched on them, whose
        logits may have taken the place of this step's: the step ahead is dropped, and each of the step's sequences
        takes no token now and goes back to the waiting queue to recompute its tokens (as a preempted one does)."""
        log.warning("reading a step's sampled tokens failed after the next step was launched on them; requests %s "
                    "recompute", [s.request_id for s in seqs])
        self._ahead = None
        for seq in reversed(seqs):                # each goes first in the queue: the oldest ends up first
            del uncommitted[seq.request_id]
            if not seq.finished:
                self.scheduler.preempt(seq)
        return []

    def _launch_sampling(self, seqs: list[Sequence], logits: torch.Tensor):
        """Start sampling one token per sequence (no host sync): -> (the SamplerOutput or the exception the batch
        raised, the logits, each row's counter). A request with a seed makes its n-th draw with counter n; the others
        take the next numbers of the engine's count of unseeded draws."""
        counters = [s.tracker.num_sampled if s.params.seed is not None else self._unseeded_draws + i
                    for i, s in enumerate(seqs)]
        self._unseeded_draws += len(seqs)
        try:
            out = sample(logits, self._sampling_batch(seqs, counters))
        except Exception as e:
            out = e
        return out, logits, counters

    def _read_samples(self, seqs: list[Sequence], out, logits: torch.Tensor,
                      counters: list[int]) -> list[tuple | Exception] | None:
        """(token, logprobs) per sequence, or the exception its sampling raised. If the batch raised, each row is
        sampled alone with the same draw (its seed and counter), so a request's failure leaves the others' tokens as
        they would be without it; None if reading the batch raised after a step was launched ahead on its tokens
        (the caller recomputes)."""
        if not isinstance(out, Exception):
            try:
                out.wait()
                return list(zip(out.token_ids.tolist(), out.host_logprobs([s.params for s in seqs])))
            except Exception as e:
                if self._ahead is not None:       # the logits may be the step ahead's now
                    log.warning("reading a batch of %d sampled tokens failed (%s: %s)", len(seqs), type(e).__name__, e)
                    return None
                out = e
        if len(seqs) == 1:
            return [out]
        log.warning("sampling a batch of %d failed (%s: %s); sampling each request alone",
                    len(seqs), type(out).__name__, out)
        results = []
        for i, seq in enumerate(seqs):
            try:
                params = [seq.params]
                batch = SamplingBatch.build(params, counters[i:i + 1], self.vocab_size, self.device,
                                            unseeded_seed=self._unseeded_seed)
                row = sample(logits[i:i + 1], batch)
                results.append((row.token_ids.item(), row.host_logprobs(params)[0]))
            except Exception as e:
                results.append(e)
        return results

    def _sampling_batch(self, seqs: list[Sequence], counters: list[int]) -> SamplingBatch:
        """The step's SamplingBatch: built when the batch's sequences change, else the last one with new counters."""
        key = tuple(seqs)
        if self._sampling is not None and self._sampling[0] == key:
            batch = dataclasses.replace(self._sampling[1],
                                        counters=device_column(counters, torch.int64, self.device))
        else:
            batch = SamplingBatch.build([s.params for s in seqs], counters, self.vocab_size, self.device,
                                        unseeded_seed=self._unseeded_seed)
        self._sampling = (key, batch)
        return batch

    def _accept(self, seq: Sequence, token: int, logprobs) -> None:
        """The sequence's new token. It is rendered now if it ends the sequence (EOS, stop id, max_tokens,
        max_model_len) or is its first; otherwise in the next step, while the device runs (`_render`)."""
        try:
            ends = seq.tracker.accept(token, logprobs)
            at_max_len = seq.num_tokens >= self.max_model_len
        except Exception as e:
            self._fail(seq, e)
            return
        if ends or at_max_len or seq.tracker.num_sampled == 1:
            self._show(seq, "length" if at_max_len else None)
        else:
            self._unrendered.append(seq)

    def _render(self) -> list[Sequence]:
        """Render the tokens accepted in the previous step; -> the sequences rendered."""
        seqs, self._unrendered = self._unrendered, []
        seqs = [s for s in seqs if not s.finished and s.tracker.has_unrendered]
        for seq in seqs:
            self._show(seq)
        return seqs

    def _show(self, seq: Sequence, finish: str | None = None) -> None:
        """Render the sequence's accepted tokens, end it with `finish` if they do not, call its callback; it ends
        with "error" if any of that raises."""
        try:
            seq.tracker.render()
            if finish is not None and not seq.finished:
                seq.tracker.finish(finish)
            if seq.on_output is not None:
                seq.on_output(seq)
        except Exception as e:
            self._fail(seq, e)
            return
        if seq.finished:
            self._release(seq)

    # ------------------------------------------------------------------ ending sequences
    def _end_all(self, seqs: list[Sequence], uncommitted: dict[str, Sequence], error: Exception) -> list[Sequence]:
        """The model failed on `seqs`: each ends with "error" (their cache state is half-written)."""
        log.error("the model step failed; requests %s end with 'error'", [s.request_id for s in seqs], exc_info=error)
        for seq in seqs:
            self._end(seq, "error", error)
            del uncommitted[seq.request_id]
        return seqs

    def _fail(self, seq: Sequence, error: Exception) -> None:
        log.warning("request %r ends with 'error'", seq.request_id, exc_info=error)
        self._end(seq, "error", error)

    def _end(self, seq: Sequence, reason: str, error: BaseException) -> None:
        """End the sequence with `reason`; a token it took before (accepted, not yet rendered) is rendered first,
        if that works."""
        try:
            seq.tracker.render()
        except Exception:
            pass
        seq.tracker.fail(reason, error)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        """Drop a finished sequence: reset its cache slot (so a free slot is always empty) and free it."""
        if seq.slot is not None:
            self._reset(seq.slot)
        self.scheduler.finish(seq)
        self._live.pop(seq.request_id, None)

    def _reset(self, slot: int) -> None:
        """Empty a cache slot (on every rank: a driver sends the reset with the next step)."""
        if self.driver is not None:
            self.driver.reset(slot)
        else:
            self.cache.reset(slot)
        if self.graphs is not None:
            self.graphs.forget(slot)
