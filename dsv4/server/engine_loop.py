"""The engine's own thread: it alone touches the Engine, which is not thread-safe.

Requests and aborts reach it through a queue; it steps the engine while there is work and blocks on the queue when there
is none. It sends every request that moved an `Update` (its new text, tokens and logprobs, and how it ended) to the
asyncio loop with `call_soon_threadsafe`, into the asyncio.Queue the request was submitted with: the text the previous
step sampled while the device runs the next step (`Engine.step`'s while_running), first tokens and endings after the
step. It keeps the metrics and logs one line per finished request. An abort takes effect before the next step, so an
aborted request's cache slot is free within one step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass

from ..runtime.engine import Engine
from ..runtime.params import Logprob, RequestError, SamplingParams
from ..runtime.sequence import Sequence
from ..runtime.spmd import WorkerFailure
from .metrics import Metrics

log = logging.getLogger("dsv4.server")


@dataclass(frozen=True)
class Job:
    """One engine request: a choice of an HTTP request."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None


@dataclass(frozen=True)
class Update:
    index: int                                   # the job's position in its submission
    text: str                                    # text that became final since the last update
    token_ids: tuple[int, ...]                   # tokens since the last update
    logprobs: tuple[dict[int, Logprob], ...]     # their logprobs (empty unless requested)
    prompt_tokens: int
    output_tokens: int                           # so far
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class QueueFull(Exception):
    pass


class NotAccepting(Exception):
    pass


@dataclass
class _Live:
    """The engine thread's record of one running request."""
    seq: Sequence
    sink: asyncio.Queue
    index: int
    arrival: float
    first: float | None = None
    last: float = 0.0
    sent: int = 0                                # tokens already sent
    started: bool = False                        # has (had) a cache slot


class EngineLoop:
    def __init__(self, engine: Engine, metrics: Metrics, max_waiting: int | None = None):
        """max_waiting: how many submitted requests may wait for a cache slot; more are refused (QueueFull)."""
        self.engine, self.metrics, self.max_waiting = engine, metrics, max_waiting
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}          # the engine thread's alone
        self._lock = threading.Lock()
        self._unstarted = 0                        # submitted, not yet in a slot (under _lock)
        self._accepting = True
        self.failure: WorkerFailure | None = None  # a parallel engine's rank failed: nothing can run any more
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ any thread
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="dsv4-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, jobs: list[Job], sink: asyncio.Queue, arrival: float | None = None) -> None:
        """Queue jobs; their Updates go to `sink` (tagged with each job's index in `jobs`). Raises QueueFull or
        NotAccepting (shutting down), having queued nothing."""
        with self._lock:
            if self.failure is not None:
                raise NotAccepting(str(self.failure))
            if not self._accepting or not self.alive:
                raise NotAccepting("the server is shutting down")
            if self.max_waiting is not None and self._unstarted + len(jobs) > self.max_waiting:
                raise QueueFull(f"{self._unstarted} requests are already waiting (--max-waiting {self.max_waiting})")
            self._unstarted += len(jobs)
        self._inbox.put(("add", jobs, sink, time.monotonic() if arrival is None else arrival))

    def abort(self, request_ids) -> None:
        self._inbox.put(("abort", tuple(request_ids)))

    def abort_all(self) -> None:
        self._inbox.put(("abort_all",))

    def stop(self, timeout: float = 10.0) -> None:
        """Refuse new work, abort what runs, and end the thread."""
        with self._lock:
            self._accepting = False
        self._inbox.put(("stop",))
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        while True:
            try:
                if not self._iteration():
                    return
            except Exception:              # a bug here must not end the thread: log it, go on
                log.exception("engine loop error")

    def _iteration(self) -> bool:
        """Take the commands, run one step; False once stopped."""
        commands = [] if self.engine.has_unfinished() else [self._inbox.get()]     # idle: block
        try:
            while True:
                commands.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        running = True
        for cmd in commands:
            running = running and cmd[0] != "stop"
            try:
                if cmd[0] == "add":
                    self._add(*cmd[1:])
                else:                      # abort, abort_all, stop
                    for rid in cmd[1] if cmd[0] == "abort" else list(self._live):
                        self.engine.abort(rid)
            except Exception:              # a bug: log it; the other commands still count
                log.exception("engine loop: %s failed", cmd[0])
        stepped: list[Sequence] = []
        if running and self.engine.has_unfinished():
            try:
                stepped = self.engine.step(while_running=self._deliver)
            except WorkerFailure as e:     # the step's requests ended ("error"); every later step fails the same
                log.exception("the parallel engine stopped; refusing requests")
                self.failure = e
            except Exception:              # the engine ended the step's requests ("error") and stays usable
                log.exception("engine step failed")
        self._deliver(stepped)
        return running

    def _add(self, jobs: list[Job], sink: asyncio.Queue, arrival: float) -> None:
        for index, job in enumerate(jobs):
            try:
                seq = self.engine.add_request(job.prompt_token_ids, job.params, request_id=job.request_id,
                                              prompt=job.prompt)
            except Exception as e:         # the server checks first (RequestError): a race or a bug, not a crash
                if not isinstance(e, RequestError):
                    log.exception("engine loop: adding %s failed", job.request_id)
                with self._lock:
                    self._unstarted -= 1
                self._post(sink, Update(index, "", (), (), len(job.prompt_token_ids), 0, "error", None, str(e)))
                continue
            self._live[job.request_id] = _Live(seq, sink, index, arrival)
            self.metrics.prompt_tokens.inc(len(job.prompt_token_ids))

    def _deliver(self, stepped: list[Sequence]) -> None:
        now = time.monotonic()
        started = [live for live in self._live.values()
                   if not live.started and (live.seq.slot is not None or live.seq.finished)]
        for live in started:
            live.started = True
        with self._lock:                   # before the updates go out: a client that saw its first token is
            self._unstarted -= len(started)    # no longer counted as waiting
            waiting = self._unstarted
        moved = {s.request_id for s in stepped}
        for rid, live in list(self._live.items()):
            if rid in moved or live.seq.finished:
                try:
                    self._send(live, now)
                except Exception as e:     # a bug: end this request (its client gets the error), not the loop
                    log.exception("engine loop: sending %s failed", rid)
                    self.engine.abort(rid)
                    self._live.pop(rid, None)
                    self._post(live.sink, Update(live.index, "", (), (), len(live.seq.prompt_token_ids), live.sent,
                                                 "error", None, f"{type(e).__name__}: {e}"))
        sched = self.engine.scheduler
        self.metrics.running.set(len(sched.running))
        self.metrics.waiting.set(waiting)
        self.metrics.cache_usage.set(self.engine.cache_usage())

    def _send(self, live: _Live, now: float) -> None:
        seq, tracker = live.seq, live.seq.tracker
        new = tuple(tracker.token_ids[live.sent:])
        if new:
            if live.first is None:
                live.first = now
                self.metrics.ttft.observe(now - live.arrival)
            else:
                self.metrics.itl.observe(now - live.last)
            live.last = now
            self.metrics.generation_tokens.inc(len(new))
        logprobs = () if tracker.logprobs is None else tuple(tracker.logprobs[live.sent:])
        live.sent = len(tracker.token_ids)
        text = tracker.take_delta()
        out = seq.output().outputs[0] if seq.finished else None
        if not (text or new or out):
            return
        self._post(live.sink, Update(live.index, text, new, logprobs, len(seq.prompt_token_ids), live.sent,
                                     out and out.finish_reason, out and out.stop_reason, out and out.error))
        if out is not None:
            del self._live[seq.request_id]
            self.metrics.e2e.observe(now - live.arrival)
            self.metrics.finished(out.finish_reason)
            ttft = "-" if live.first is None else f"{live.first - live.arrival:.3f} s"
            log.info("%s: %s, prompt %d tokens, completion %d tokens, TTFT %s, %.3f s%s", seq.request_id,
                     out.finish_reason, len(seq.prompt_token_ids), live.sent, ttft, now - live.arrival,
                     f" ({out.error})" if out.error else "")

    def _post(self, sink: asyncio.Queue, update: Update) -> None:
        try:
            self._loop.call_soon_threadsafe(sink.put_nowait, update)
        except RuntimeError:               # the event loop has closed (shutdown): nobody is listening
            pass
