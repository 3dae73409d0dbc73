"""Starting, watching and stopping the ranks of a parallel engine (docs/parallel.md).

One machine: the caller's process is rank 0 and spawns ranks 1..world-1 (torch.multiprocessing, spawn), one per GPU
(cuda:rank) with NCCL, or on the CPU with gloo (tests). Several machines: every node runs the same command under
torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR / MASTER_PORT in the environment); rank 0 serves, every other
rank runs the worker loop inside `start` and the process exits when rank 0 stops.

Every rank then does the same (`build_rank`): joins the process groups (the default one, NCCL or gloo, whose
collectives time out after COLLECTIVE_TIMEOUT; a gloo control group for the step messages, whose timeout IDLE_TIMEOUT
lets a worker wait for the next request for days; one group per pipeline stage for its TP ranks), loads its part of
the model (its slices only), sizes its stage's cache (the same slots and pages on every rank), with the decode runner
(CUDA, pp = 1) captures its decode graphs together with the others (unless enforce_eager: the runner's steps then run
uncaptured), and meets them at a barrier.

Failure: a watchdog thread of rank 0 waits on the spawned workers' process sentinels. When one ends unasked it
records the rank and its cause (the exception the worker reported through its pipe, or the signal that killed it),
stops the other workers and aborts rank 0's NCCL collectives (gloo's fail by themselves once a peer's socket closes);
rank 0's step then raises `WorkerFailure` naming that rank and cause. A worker whose collective fails (rank 0 died)
exits. Shutdown sends STOP, joins the workers (killing any that do not leave) and destroys rank 0's process groups.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..checkpoint.dummy import dummy_model
from ..checkpoint.loader import load
from ..config import ModelConfig
from ..kernels import ops_for
from ..model.state import SeqBatch
from ..parallel import Communicator, Layout
from .cache import KVCache, pages_for, pages_that_fit
from .graphs import DecodeGraphs
from .spmd import ControlChannel, Driver, StageRunner, StepInputs, WorkerFailure

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = timedelta(minutes=10)   # a step's collectives (and the start-up rendezvous)
IDLE_TIMEOUT = timedelta(days=90)            # a worker waiting for rank 0's next step
FAILURE_GRACE = 5.0                          # seconds a failed step waits for the watchdog to name the dead rank
JOIN_TIMEOUT = 10.0                          # seconds a stopping worker gets before it is killed


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs to build its part of the engine (pickled to spawned workers)."""

    layout: Layout
    config: ModelConfig
    checkpoint: str | None            # a checkpoint folder, or None: dummy weights (load_format="dummy")
    dummy_format: str
    seed: int
    device: str                       # "cpu" or "cuda"
    dtype: torch.dtype
    kernels: str
    w4a4: bool
    max_num_seqs: int
    num_cache_pages: int | None       # None: as many as fit on every rank (CUDA)
    max_num_batched_tokens: int
    gpu_memory_utilization: float
    progress: bool = False
    max_model_len: int = 4096
    decode_runner: str = "plain"      # "plain" steps; "graphs" (CUDA, pp = 1): the decode runner, captured;
                                      # "padded": the same runner without capture (enforce_eager on CUDA, and
                                      # the CPU tests)
    one_shot_all_reduce: bool = True  # small all-reduces through symmetric memory where torch has it
    kv_cache_dtype: str = "auto"   # "fp8" / "fp8-indexer": runtime.cache.pool_shapes


def build_rank(spec: RankSpec, rank: int, local_rank: int, init_method: str) -> tuple[StageRunner, ControlChannel]:
    """Join the groups, load this rank's part and size its cache; returns its runner and the control channel."""
    layout, cfg = spec.layout, spec.config
    device = torch.device("cpu") if spec.device == "cpu" else torch.device("cuda", local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method, rank=rank,
                            world_size=layout.world_size, timeout=COLLECTIVE_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    tp_groups = [dist.new_group(list(layout.stage_ranks(s))) for s in range(layout.pp)] if layout.tp > 1 else []
    shard = layout.shard(cfg, rank)
    comm = Communicator(tp_groups[shard.stage], device, spec.dtype, spec.one_shot_all_reduce) if tp_groups else None
    ops = ops_for(device, spec.kernels, spec.w4a4)
    if spec.checkpoint is None:
        model = dummy_model(cfg, spec.dummy_format, device, spec.dtype, ops, spec.seed, shard=shard, comm=comm)
        if ops.reads_tiled and device.type == "cuda":
            model.prepare_for_kernels_()
    else:
        model = load(spec.checkpoint, device, spec.dtype, ops, progress=spec.progress and rank == 0, shard=shard,
                     comm=comm)
    runner = StageRunner(model, None, shard, device, spec.dtype)
    slots = spec.max_num_seqs + (spec.decode_runner != "plain")     # the runner's padding rows use one more slot
    pages = spec.num_cache_pages
    if pages is None:
        pages = _pages_that_fit_everywhere(runner, spec, slots, control)
    runner.cache = KVCache(shard.stage_config(), slots, pages, spec.dtype, device, spec.kv_cache_dtype)
    if spec.decode_runner != "plain":
        # Every rank captures the same graphs in the same order, so the collectives inside them meet.
        runner.graphs = DecodeGraphs(model, runner.cache.layers, spec.max_num_seqs, spec.max_model_len,
                                     pad_slot=spec.max_num_seqs, capture=spec.decode_runner == "graphs")
    dist.barrier(group=control)
    return runner, ControlChannel(control)


def _pages_that_fit_everywhere(runner: StageRunner, spec: RankSpec, slots: int, control: dist.ProcessGroup) -> int:
    """Cache pages that fit on every rank: each measures a full-budget prefill step (every rank runs it together,
    on a scratch cache of one sequence), keeps gpu_memory_utilization of its GPU for weights, that step and the
    per-slot state; the least over the ranks wins."""
    cfg, device, dtype = runner.shard.stage_config(), runner.device, runner.dtype
    tokens = spec.max_num_batched_tokens
    runner.cache = KVCache(cfg, 1, pages_for(tokens), dtype, device, spec.kv_cache_dtype)
    batch = SeqBatch((0,), (0,), (tokens,), (tuple(range(pages_for(tokens))),))
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    runner.run(StepInputs(torch.zeros(tokens, dtype=torch.long), batch, (tokens - 1,)))
    torch.cuda.synchronize(device)
    workspace = torch.cuda.max_memory_allocated(device) - base
    runner.cache = None
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    budget = total * spec.gpu_memory_utilization - torch.cuda.memory_allocated(device) - workspace
    pages = torch.tensor([pages_that_fit(cfg, budget, dtype, spec.kv_cache_dtype, slots)], dtype=torch.long)
    dist.all_reduce(pages, op=dist.ReduceOp.MIN, group=control)
    return int(pages)


def _worker_main(spec: RankSpec, rank: int, local_rank: int, init_method: str, report) -> None:
    """A spawned worker: build its rank, run steps until STOP; an exception is reported to rank 0 and ends it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)        # Ctrl-C is rank 0's to handle (it stops the workers)
    try:
        runner, channel = build_rank(spec, rank, local_rank, init_method)
        runner.serve(channel)
        dist.destroy_process_group()
    except BaseException as e:
        try:
            report.send(f"raised {type(e).__name__}: {e}")
        except OSError:
            pass
        traceback.print_exc()
        sys.exit(1)


def _exit_cause(proc, report) -> str:
    try:
        if report.poll():
            return report.recv()
    except (EOFError, OSError):
        pass
    code = proc.exitcode
    if code is not None and code < 0:
        return f"was killed by signal {signal.Signals(-code).name}"
    return f"exited with status {code}"


class Watchdog:
    """Waits on the spawned workers; the first that ends unasked is the group's failure (rank and cause), and the
    others are stopped so that no rank waits on a collective that cannot complete."""

    def __init__(self, procs: dict, reports: dict):
        self.procs, self.reports = procs, reports
        self.cause: str | None = None
        self.found = threading.Event()
        self.stopping = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="dsv4-watchdog", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self.stopping.is_set():
            wait([p.sentinel for p in self.procs.values()], timeout=0.5)
            if self.stopping.is_set():
                return
            for rank, p in self.procs.items():
                if p.exitcode is not None:
                    self.cause = f"rank {rank} (pid {p.pid}) {_exit_cause(p, self.reports[rank])}"
                    log.error("parallel engine: %s; stopping every rank", self.cause)
                    self.found.set()
                    stop_processes(self.procs.values())
                    if dist.is_initialized() and dist.get_backend() == "nccl":
                        dist.distributed_c10d._abort_process_group()     # NCCL waits would not notice
                    return

    def wait_cause(self, timeout: float) -> str | None:
        self.found.wait(timeout)
        return self.cause

    def stop(self) -> None:
        self.stopping.set()
        self._thread.join()


def stop_processes(procs, leave: float = 0.0, timeout: float = JOIN_TIMEOUT) -> None:
    """Give the live ones `leave` seconds to exit by themselves, then terminate them, then kill those still there
    after `timeout` seconds."""
    procs = list(procs)
    for p in procs:
        p.join(leave)
        if p.exitcode is None:
            p.terminate()
    for p in procs:
        p.join(timeout)
        if p.exitcode is None:
            p.kill()
            p.join()


class ParallelGroup:
    """Rank 0's handle on the ranks of a parallel engine: its own part (`model`, `driver`), the workers it spawned
    and their watchdog (none under torchrun, whose agent watches the nodes)."""

    def __init__(self, spec: RankSpec, init_method: str, procs: dict, reports: dict, store_dir: str | None):
        self.spec, self.procs, self.store_dir = spec, procs, store_dir
        self.watchdog = Watchdog(procs, reports) if procs else None
        try:
            runner, channel = build_rank(spec, 0, 0, init_method)
        except Exception as e:
            raise self._stopped(e) from e
        self.model = runner.model
        self.driver = Driver(runner, channel, self._stopped)
        self.closed = False

    def _stopped(self, error: BaseException) -> WorkerFailure:
        """The group failed: name the rank and cause, stop every rank, free rank 0's groups."""
        cause = self.watchdog.wait_cause(FAILURE_GRACE) if self.watchdog else None
        cause = cause or f"rank 0 saw {type(error).__name__}: {error}"
        self._teardown()
        return WorkerFailure(f"the parallel engine ({self.spec.layout.describe()}) stopped: {cause}")

    def _teardown(self, leave: float = 0.0) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        stop_processes(self.procs.values(), leave)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as e:        # a broken group may refuse; its sockets close with the process
                log.warning("destroying the process groups failed: %s", e)
        if self.store_dir:
            shutil.rmtree(self.store_dir, ignore_errors=True)
        self.closed = True

    def shutdown(self) -> None:
        """Stop every rank and free rank 0's process groups (idempotent)."""
        if getattr(self, "closed", True):
            return
        driver = getattr(self, "driver", None)
        if driver is not None and driver.failure is None:
            if self.watchdog is not None:
                self.watchdog.stop()          # workers leaving now are not a failure
            try:
                driver.stop()
            except Exception as e:
                log.warning("stopping the workers failed: %s", e)
            self._teardown(leave=JOIN_TIMEOUT)
            return
        self._teardown()


def start(spec: RankSpec) -> ParallelGroup:
    """Start the ranks of `spec.layout`: spawned here on one machine, or this process's rank under torchrun.
    Returns rank 0's ParallelGroup; on any other rank serves steps until rank 0 stops, then exits the process."""
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group (another parallel LLM that "
                           "is not shut down?); one parallel engine per process")
    world = spec.layout.world_size
    if "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        if int(os.environ["WORLD_SIZE"]) != world:
            raise ValueError(f"torchrun started {os.environ['WORLD_SIZE']} processes, but {spec.layout.describe()} "
                             f"needs {world} (nproc_per_node x nnodes)")
        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        if rank != 0:
            runner, channel = build_rank(spec, rank, local_rank, "env://")
            runner.serve(channel)
            dist.destroy_process_group()
            sys.exit(0)
        return ParallelGroup(spec, "env://", {}, {}, None)
    store_dir = tempfile.mkdtemp(prefix="dsv4-dist-")
    init_method = f"file://{store_dir}/store"
    ctx = mp.get_context("spawn")
    procs, reports = {}, {}
    for rank in range(1, world):
        receive, send = ctx.Pipe(duplex=False)
        procs[rank] = ctx.Process(target=_worker_main, args=(spec, rank, rank, init_method, send), daemon=True,
                                  name=f"dsv4-rank{rank}")
        procs[rank].start()
        send.close()
        reports[rank] = receive
    return ParallelGroup(spec, init_method, procs, reports, store_dir)
