"""The whole engine, end to end: decode step time and prefill speed of `dsv4.runtime.Engine` (what `dsv4.LLM` runs)
on dummy weights at real dimensions, against the bytes each step must read.

    python bench/e2e.py --model v4-flash --layers 4,8 --format nvfp4-experts,official --out $OUT    # H200
    python bench/e2e.py --toy --out /tmp/e2e                                                         # CPU dry run

For each weight format and layer count: the model from `checkpoint.dummy` (random weights drawn on the device in
that format's storage), then
* decode: for each batch x context, an engine of `batch` slots whose sequences hold `context` tokens of cache
  state (random values written into the pools: timing needs consistent counts, not meaningful values), timed over
  `--steps` decode steps (median); output tokens/s; the bytes the step must read (every weight but the routed
  experts, the experts the batch is expected to touch, each sequence's cache rows it attends to) and the time
  they take at the copy bandwidth (`--bandwidth`, 4.27 TB/s: the floor); the mean step of as many more in a row
  (no synchronization between them: with async scheduling the host's work overlaps the next step); kernel
  launches, GPU-busy share (a profiled step's kernel time over the median step's time, and over the mean step in a
  row) and the kernels taking the most GPU time in one step
  from torch.profiler (on CPU: ATen ops per step); each case in the engine's default mode (`--modes graphs`: CUDA
  graphs for decode on a GPU) and / or `eager` (enforce_eager);
* prefill: one prompt of each `--prefill` length through chunked prefill, tokens/s;
* us per layer: the difference of two layer counts' decode step times, divided by the layer difference, and the
  same of their profiled steps' kernel time (steadier: the wall times of two engines drift apart with the clocks;
  kernels of the second stream that overlap the first's count in full, so the sum then exceeds the time they take),
  in all and by kernel name (`kernels_per_layer`), and the GPU's idle time a layer, by the kernel it comes before
  (`idle_before_per_layer`);
* `--one-stream`: a layer's compressors and indexer on the step's one stream, the CSA layers' query products fused
  (as on a table without a second stream), for an A/B against the second stream (`Ops.start`);
* `--repeats R` (one GPU): each decode case on R fresh engines (new pools, new graphs), whose step times differ;
  the case is the median engine's record (the lower one for even R), every engine's step kept (`step_ms_runs`);
* `--sequence` (CUDA): each decode case's profiled step also as its kernels in order (name, start, duration), where
  a layer's time goes launch by launch;
* `--kv-cache-dtype fp8` / `fp8-indexer`: the attention's entries (584-byte packed rows) and the indexer's keys, or
  the keys only, cached in fp8 (the floor counts their bytes so);
* with `--tensor-parallel-size N` (`--enable-expert-parallel`): the same on a parallel `dsv4.LLM` of N ranks, one
  per GPU (dummy weights drawn per rank), one engine per format, layer count and mode whose cache holds the largest
  case; the floor is one GPU's share of the bytes (rank 0's weights);
* with `--one-rank-of N` instead (one GPU, the dry run of a parallel layout): rank 0's part of that layout alone,
  its collectives absent (`AbsentPeers`): its weights, memory and kernels at their real shapes, a step without the
  communication (whose cost adds to it) and whose sums are not the model's; the floor is rank 0's bytes;
* transformers' eager `DeepseekV4ForCausalLM` at the same dims, batch 1 (`--hf`; skipped with the reason if it
  cannot run). Writes e2e.json and prints a table.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import on_one_stream  # noqa: E402
from dsv4.checkpoint.dummy import dummy_model  # noqa: E402
from dsv4.config import ModelConfig  # noqa: E402
from dsv4.kernels import ops_for  # noqa: E402
from dsv4.kernels.ref import kv_row_bytes  # noqa: E402
from dsv4.parallel.layout import Layout  # noqa: E402
from dsv4.runtime.cache import KV_CACHE_DTYPES, CacheCapacityError, pages_for  # noqa: E402
from dsv4.runtime.engine import Engine  # noqa: E402
from dsv4.runtime.params import SamplingParams  # noqa: E402

COPY_BYTES_PER_S = 4.27e12          # H200 device-to-device copy, measured (bench/RESULTS.md)
TOP_KERNELS = 12                     # kernels listed per profiled step
DECODE = SamplingParams(temperature=0, ignore_eos=True, max_tokens=None)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class AbsentPeers:
    """The collectives of a tensor-parallel group whose other ranks are absent (`--one-rank-of`): `all_reduce` keeps
    the local partial and `gather_last` repeats the local logits over the absent ranks' vocabulary shares, so rank 0's
    part runs its kernels at their real shapes on one GPU, without communication. Its sums are not the model's."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather_last(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        return torch.cat([F.pad(x, (0, n - x.shape[-1])) if n > x.shape[-1] else x[..., :n] for n in sizes], dim=-1)


# ------------------------------------------------------------------------------------------------ bytes
def module_bytes(module: torch.nn.Module) -> int:
    return sum(b.numel() * b.element_size() for b in module.buffers())


def step_bytes(model, cfg: ModelConfig, batch: int, context: int, cache_itemsize: int,
               kv_cache_dtype: str = "auto") -> int:
    """Bytes one decode step of `batch` sequences at `context` tokens must read: the weights (the routed experts
    only as many distinct ones as `batch` random routings are expected to touch; the embedding's `batch` rows) and
    each sequence's cache rows that attention, compressor and indexer read."""
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    touched = E * (1 - (1 - k / E) ** batch)
    total = module_bytes(model) - module_bytes(model.embed) - sum(module_bytes(m) for m in model.mtp)
    total += batch * cfg.hidden_size * model.embed.weight.element_size()
    for layer in model.layers:
        experts = layer.ffn.experts
        total -= module_bytes(experts) * (1 - touched / E)
    D, window = cfg.head_dim, min(cfg.sliding_window, context)
    entry_bytes, key_bytes = cache_row_bytes(cfg, kv_cache_dtype, cache_itemsize)
    per_seq = 0
    for i in range(cfg.num_hidden_layers):
        ratio = cfg.compress_ratio(i)
        per_seq += window * D * cache_itemsize
        if ratio == 4:      # CSA: the picked entries, and every indexer key to score them
            per_seq += min(cfg.index_topk, context // 4) * entry_bytes + context // 4 * key_bytes
        elif ratio == 128:  # HCA: every entry
            per_seq += (context // 128) * entry_bytes
    return int(total + batch * per_seq)


def cache_row_bytes(cfg: ModelConfig, kv_cache_dtype: str, cache_itemsize: int) -> tuple[int, int]:
    """Bytes of one compressed entry and of one indexer key in the cache: the cache dtype's, or fp8's (a packed row;
    a key's codes and its fp32 scale)."""
    entry = kv_row_bytes(cfg.head_dim, cfg.nope_head_dim) if kv_cache_dtype == "fp8" else cfg.head_dim * cache_itemsize
    key = cfg.index_head_dim + 4 if kv_cache_dtype != "auto" else cfg.index_head_dim * cache_itemsize
    return entry, key


# ------------------------------------------------------------------------------------------------ engine
def engine_at_context(model, batch: int, context: int, steps: int, gen: torch.Generator,
                      eager: bool = False, kv_cache_dtype: str = "auto",
                      async_scheduling: bool = True) -> tuple[Engine, list]:
    """An engine whose `batch` sequences each hold `context - 1` tokens of (random) cache state, so that every
    following step decodes one token per sequence."""
    engine = Engine(model, max_num_seqs=batch, max_model_len=context + steps + 1,
                    max_num_batched_tokens=max(batch, 1024), num_cache_pages=batch * pages_for(context + steps + 1),
                    enforce_eager=eager, kv_cache_dtype=kv_cache_dtype, async_scheduling=async_scheduling)
    for pool in engine.cache.pools.values():
        if pool.dtype == torch.float8_e4m3fn:
            pool.view(torch.uint8).random_(0, 120)      # finite e4m3 codes
        elif pool.dtype == torch.uint8:                 # packed fp8 rows: small finite codes, scales and bf16 values
            pool.random_(0, 60)
        else:
            pool.normal_()
    return engine, admit_at_context(engine, batch, context, gen)


def admit_at_context(engine: Engine, batch: int, context: int, gen: torch.Generator) -> list:
    """Add `batch` sequences to a free engine as if each held `context - 1` tokens in its cache (whatever the pools
    hold: timing needs the counts, not the values); every following step decodes one token per sequence."""
    vocab = engine.model.config.vocab_size
    seqs = [engine.add_request(torch.randint(2, vocab, (context,), generator=gen).tolist(), DECODE)
            for _ in range(batch)]
    sched = engine.scheduler
    while sched.waiting:                   # admit every sequence, as `Scheduler.schedule` would
        seq = sched.waiting.popleft()
        seq.slot = sched.free_slots.popleft()
        seq.num_cached = context - 1
        sched.running.append(seq)
    return seqs


def profile_step(engine: Engine, device: torch.device, sequence: bool = False) -> dict:
    """Kernel launches, the GPU's busy time (the union of its kernels' intervals) and its share of the profiled
    step's wall time, its idle time between the first kernel's start and the last one's end, and where that idle
    time falls: before which kernels, by name; with `sequence`, the step's kernels in order (name, start and duration
    in us from the first one's start) (CUDA); ATen ops per step elsewhere."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    t = time.perf_counter()
    with profile(activities=activities) as prof:
        engine.step()
        sync(device)
    wall_us = (time.perf_counter() - t) * 1e6
    events = prof.events()
    if device.type != "cuda":
        return {"aten_ops": sum(1 for e in events if e.name.startswith("aten::") and e.cpu_parent is None)}
    gpu = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    kernels = [(e.time_range.start, e.time_range.end) for e in gpu]
    busy, end = 0.0, float("-inf")
    idle: dict[str, list[float]] = {}    # the GPU's idle time before each kernel (no kernel runs), by its name
    for e, (start, stop) in zip(gpu, kernels):   # the union of kernel intervals
        if end > float("-inf") and start > end:
            t = idle.setdefault(e.name[:90], [0.0, 0])
            t[0] += start - end
            t[1] += 1
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    by_name: dict[str, list[float]] = {}
    for e in gpu:                        # where the GPU time goes: kernels by name, the longest first
        t = by_name.setdefault(e.name[:90], [0.0, 0])
        t[0] += e.time_range.end - e.time_range.start
        t[1] += 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]
    out = {"kernel_launches": len(kernels), "gpu_busy": busy / wall_us if wall_us else 0.0,
           "gpu_us": busy, "idle_us": sum(t for t, _ in idle.values()),
           "kernels": [dict(name=n, us=round(t, 1), count=c) for n, (t, c) in top],
           "kernels_all": {n: [round(t, 1), c] for n, (t, c) in by_name.items()},
           "idle_before_all": {n: [round(t, 1), c] for n, (t, c) in idle.items()}}
    if sequence and kernels:
        t0 = kernels[0][0]
        out["sequence"] = [[e.name[:70], round(start - t0, 1), round(stop - start, 1)]
                           for e, (start, stop) in zip(gpu, kernels)]
    return out


def failed(seqs) -> None:
    """Raise if a sequence ended with an error (the engine ends a failed step's sequences instead of raising)."""
    for seq in seqs:
        if seq.tracker.finish_reason == "error":
            raise RuntimeError(f"request {seq.request_id} failed: {seq.tracker.error}")


def time_decode(model, batch: int, context: int, steps: int, device, gen, eager: bool = False,
                kv_cache_dtype: str = "auto", sequence: bool = False, async_scheduling: bool = True) -> dict:
    t = time.perf_counter()
    engine, seqs = engine_at_context(model, batch, context, 2 * steps + 2, gen, eager, kv_cache_dtype,
                                     async_scheduling)
    out = {"setup_s": time.perf_counter() - t, **time_steps(engine, seqs, steps, device, sequence)}
    del engine
    gc.collect()                          # its pools go before the next case's are allocated
    return out


def time_steps(engine: Engine, seqs: list, steps: int, device, sequence: bool = False) -> dict:
    """A warm-up step, then the median of `steps` timed decode steps, then one profiled step (`profile_step`;
    `sequence`: its kernels in order too), then the mean step of `steps` more in a row (`step_ms_in_a_row`: no
    synchronization between them, so a step launched ahead runs while the host takes the last one's tokens; the
    first step's ahead ran before the timer and the last one's inside it)."""
    engine.step()                         # warm-up (compiles kernels on first use)
    failed(seqs)
    times = []
    for _ in range(steps):
        sync(device)
        t = time.perf_counter()
        engine.step()
        sync(device)
        times.append(time.perf_counter() - t)
    out = {"step_ms": statistics.median(times) * 1e3, "graph_memory": engine.graph_memory}
    out.update(profile_step(engine, device, sequence))
    sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(device)
    out["step_ms_in_a_row"] = (time.perf_counter() - t) / steps * 1e3
    if "gpu_us" in out:                   # the profiled step's kernel time over the timed step's (the profiler slows
        out["gpu_busy"] = min(1.0, out["gpu_us"] / (out["step_ms"] * 1e3))   # the step it watches)
        out["gpu_busy_in_a_row"] = min(1.0, out["gpu_us"] / (out["step_ms_in_a_row"] * 1e3))
    failed(seqs)
    return out


def parallel_cases(args, fmt: str, layers: int, mode: str, device, gen, res: dict) -> dict:
    """Decode cases and prefills on one parallel LLM (dummy weights, `--tensor-parallel-size` ranks, one per GPU)
    whose cache holds the largest case; each case admits its sequences and aborts them after.
    -> {(batch, context): step ms}."""
    import dsv4

    ints = lambda text: [int(v) for v in text.split(",") if v]  # noqa: E731
    batches, contexts, prefills = ints(args.batch), ints(args.context), ints(args.prefill)
    longest = max(contexts + [p - 2 * args.steps for p in prefills]) + 2 * args.steps + 3   # `time_steps`' steps
    pages = max([b * pages_for(c + 2 * args.steps + 3) for b in batches for c in contexts] + [pages_for(longest)])
    t = time.perf_counter()
    steps_ms = {}
    with dsv4.LLM(args.model, device=device.type, load_format=f"dummy-{fmt}",
                  hf_overrides={"num_hidden_layers": layers}, tensor_parallel_size=args.tensor_parallel_size,
                  enable_expert_parallel=args.enable_expert_parallel,
                  disable_custom_all_reduce=args.disable_custom_all_reduce, max_num_seqs=max(batches),
                  max_model_len=longest, num_cache_pages=pages, max_num_batched_tokens=max(max(batches), args.chunk),
                  enforce_eager=mode == "eager", kv_cache_dtype=args.kv_cache_dtype, skip_tokenizer_init=True,
                  progress=False) as llm:
        build_s, engine, cfg = time.perf_counter() - t, llm.engine, llm.model.config
        comm = llm.model.layers[0].comm
        res["all_reduce"] = comm.path if comm is not None else None
        for batch in batches:
            for context in contexts:
                case = dict(format=fmt, layers=layers, batch=batch, context=context, mode=mode, build_s=build_s,
                            tensor_parallel_size=args.tensor_parallel_size)
                seqs = admit_at_context(engine, batch, context, gen)
                try:
                    case.update(time_steps(engine, seqs, args.steps, device, args.sequence))
                except Exception:
                    res["errors"].append(f"decode {case}: {traceback.format_exc()[-1500:]}")
                    continue
                finally:
                    for seq in seqs:
                        engine.abort(seq.request_id)
                nbytes = step_bytes(llm.model, cfg, batch, context, torch.finfo(engine.dtype).bits // 8,
                                    args.kv_cache_dtype)
                case.update(tokens_per_s=batch / case["step_ms"] * 1e3, step_bytes=nbytes,
                            floor_ms=nbytes / args.bandwidth * 1e3)     # rank 0's share: every GPU reads as much
                steps_ms[(batch, context)] = case["step_ms"]
                res["decode"].append(case)
                print(json.dumps(case), flush=True)
        for length in prefills if mode == args.modes.split(",")[0] else ():
            row = dict(format=fmt, layers=layers, length=length, tensor_parallel_size=args.tensor_parallel_size,
                       **prefill_on(engine, length, device, gen))
            res["prefill"].append(row)
            print(json.dumps(row), flush=True)
    return steps_ms


def time_prefill(model, length: int, chunk: int, device, gen) -> dict:
    """`prefill_on` with an engine whose cache holds the one prompt, after an untimed prompt of two chunks through it
    (the kernels of every chunk shape compiled and planned first)."""
    gc.collect()
    engine = Engine(model, max_num_seqs=1, max_model_len=length + 1, max_num_batched_tokens=chunk,
                    num_cache_pages=pages_for(length + 1))
    prefill_on(engine, min(length, 2 * chunk), device, gen)
    return prefill_on(engine, length, device, gen)


def prefill_on(engine: Engine, length: int, device, gen) -> dict:
    """One random prompt of `length` tokens through the engine's chunked prefill, to its first token: seconds and
    tokens/s."""
    prompt = torch.randint(2, engine.model.config.vocab_size, (length,), generator=gen).tolist()
    seq = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    sync(device)
    t = time.perf_counter()
    while not seq.finished:
        engine.step()
    sync(device)
    s = time.perf_counter() - t
    failed([seq])
    return {"prefill_s": s, "tokens_per_s": length / s}


# ------------------------------------------------------------------------------------------------ transformers
def hf_decode_ms(cfg: ModelConfig, device, dtype, steps: int, prompt: int) -> dict:
    """transformers' eager DeepseekV4ForCausalLM at the same dims (random weights), batch 1: ms per new token."""
    try:
        from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    except ImportError as e:
        return {"skipped": f"transformers has no DeepseekV4ForCausalLM ({e})"}
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            hf = DeepseekV4ForCausalLM(DeepseekV4Config(**cfg.to_hf_dict())).eval()
    finally:
        torch.set_default_dtype(default)
    ids = torch.randint(2, cfg.vocab_size, (1, prompt), device=device)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0, use_cache=True)
    with torch.inference_mode():
        hf.generate(ids, max_new_tokens=2, **kw)
        times = []
        for n in (1, steps + 1):
            sync(device)
            t = time.perf_counter()
            hf.generate(ids, max_new_tokens=n, **kw)
            sync(device)
            times.append(time.perf_counter() - t)
    del hf
    return {"ms_per_token": (times[1] - times[0]) / steps * 1e3, "prompt": prompt}


# ------------------------------------------------------------------------------------------------ driver
def per_layer(fmt: str, cases: dict[tuple[int, int, int, str], dict], counts: list[int]) -> list[dict]:
    """us per layer of each (batch, context, mode) timed at the fewest and the most layers in `counts`: the step
    times' difference over the layer difference, and (where both steps were profiled) the same of their kernel time,
    which is steadier: the wall times of two engines drift apart with the GPU's clocks."""
    rows = []
    for (layers, batch, context, mode), case in cases.items():
        fewest = cases.get((counts[0], batch, context, mode))
        if layers != counts[-1] or fewest is None or counts[0] >= layers:
            continue
        row = dict(format=fmt, batch=batch, context=context, mode=mode,
                   us_per_layer=1e3 * (case["step_ms"] - fewest["step_ms"]) / (layers - counts[0]))
        if "gpu_us" in case and "gpu_us" in fewest:
            row["kernel_us_per_layer"] = (case["gpu_us"] - fewest["gpu_us"]) / (layers - counts[0])
        if "kernels_all" in case and "kernels_all" in fewest:
            row["kernels_per_layer"] = kernels_per_layer(case["kernels_all"], fewest["kernels_all"],
                                                         layers - counts[0])
        if "idle_before_all" in case and "idle_before_all" in fewest:
            row["idle_us_per_layer"] = (case["idle_us"] - fewest["idle_us"]) / (layers - counts[0])
            row["idle_before_per_layer"] = kernels_per_layer(case["idle_before_all"], fewest["idle_before_all"],
                                                             layers - counts[0])
        rows.append(row)
    return rows


def kernels_per_layer(most: dict[str, list], fewest: dict[str, list], layers: int) -> list[dict]:
    """Each kernel's share of a layer: its time and launches in the step of more layers less those in the step of
    fewer (`profile_step`'s `kernels_all`: name -> [us, count], or `idle_before_all`: the idle time before it and
    how often), over the layer difference; the TOP_KERNELS largest by time. Under programmatic dependent launch a
    kernel's time includes its wait for the one before."""
    rows = []
    for name in most.keys() | fewest.keys():
        (us, n), (us0, n0) = most.get(name, [0.0, 0]), fewest.get(name, [0.0, 0])
        rows.append(dict(name=name, us=round((us - us0) / layers, 1), count=(n - n0) / layers))
    return sorted(rows, key=lambda r: -r["us"])[:TOP_KERNELS]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="v4-flash", help="preset (v4-flash, v4-pro, tiny) or a config.json path")
    ap.add_argument("--layers", default="4,8", help="layer counts (two or more give us per layer)")
    ap.add_argument("--format", default="nvfp4-experts,official", help="dummy weight formats")
    ap.add_argument("--batch", default="1,8,64,256")
    ap.add_argument("--context", default="1024,8192,65536")
    ap.add_argument("--prefill", default="4096,32768", help="prompt lengths for prefill tokens/s")
    ap.add_argument("--chunk", type=int, default=1024, help="prefill chunk (max_num_batched_tokens)")
    ap.add_argument("--steps", type=int, default=5, help="timed decode steps per case")
    ap.add_argument("--repeats", type=int, default=1, help="one GPU: each decode case on this many fresh engines, "
                    "the median engine's record taken")
    ap.add_argument("--hf", default="on", choices=("on", "off"), help="transformers eager reference at batch 1")
    ap.add_argument("--bandwidth", type=float, default=COPY_BYTES_PER_S, help="bytes/s of the floor")
    ap.add_argument("--device", default=None)
    ap.add_argument("--modes", default="graphs", help="decode step modes: graphs (CUDA graphs where the engine "
                    "captures them), eager (enforce_eager), or both: graphs,eager")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks (GPUs) of a parallel engine; the "
                    "floor is then one GPU's share of the bytes")
    ap.add_argument("--enable-expert-parallel", action="store_true",
                    help="with --tensor-parallel-size or --one-rank-of > 1")
    ap.add_argument("--one-rank-of", type=int, default=1, help="one GPU: rank 0 of a tensor-parallel layout of this "
                    "many ranks alone, its collectives absent (module docstring)")
    ap.add_argument("--disable-custom-all-reduce", action="store_true", help="every all-reduce through NCCL (with "
                    "--tensor-parallel-size > 1; default: small ones through the symmetric-memory one-shot kernel)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                    help="fp8: the attention's entries and the indexer's keys in fp8; fp8-indexer: the keys only")
    ap.add_argument("--sequence", action="store_true", help="keep each decode case's profiled step as its kernels "
                    "in order in the JSON (`sequence`: name, start and duration in us)")
    ap.add_argument("--one-stream", action="store_true", help="a layer's compressors and picks on the step's one "
                    "stream, not beside the query products on a second (and the CSA layers' query products fused)")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                    help="each decode step launched as soon as the last one's sampler has (the engine's "
                         "async_scheduling; default: on, as the engine's)")
    ap.add_argument("--toy", action="store_true", help="the tiny model on the CPU at toy sizes (checks the script)")
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args(argv)
    if args.toy:
        args.model, args.layers, args.batch, args.context = "tiny", "3,5", "1,2", "64,160"
        args.prefill, args.chunk, args.steps, args.device = "96", 32, 2, args.device or "cpu"
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    base = (ModelConfig.from_json(args.model) if args.model.endswith(".json") else ModelConfig.preset(args.model))
    ints = lambda text: [int(v) for v in text.split(",") if v]  # noqa: E731
    gen = torch.Generator().manual_seed(0)
    command = " ".join(["python", "bench/e2e.py", *(sys.argv[1:] if argv is None else argv)])
    res = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": command,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "model": args.model,
           "dtype": str(dtype), "bandwidth": args.bandwidth, "decode": [], "prefill": [], "per_layer": [],
           "errors": []}
    res.update(tensor_parallel_size=args.tensor_parallel_size, enable_expert_parallel=args.enable_expert_parallel,
               kv_cache_dtype=args.kv_cache_dtype, one_rank_of=args.one_rank_of, one_stream=args.one_stream,
               async_scheduling=args.async_scheduling)
    if args.one_stream and args.tensor_parallel_size > 1:
        raise SystemExit("--one-stream changes the model of this process: not with --tensor-parallel-size")
    if args.one_rank_of > 1 and args.tensor_parallel_size > 1:
        raise SystemExit("--one-rank-of runs one rank of a layout on one GPU: not with --tensor-parallel-size")
    for fmt in args.format.split(","):
        step_by_layers: dict[tuple[int, int, int, str], dict] = {}     # (layers, batch, context, mode) -> case
        for layers in ints(args.layers) if args.tensor_parallel_size > 1 else ():
            for mode in args.modes.split(","):
                try:
                    steps_ms = parallel_cases(args, fmt, layers, mode, device, gen, res)
                except Exception:
                    res["errors"].append(f"parallel {fmt} {layers} {mode}: {traceback.format_exc()[-1500:]}")
                    continue
                step_by_layers.update({(layers, b, c, mode): dict(step_ms=ms) for (b, c), ms in steps_ms.items()})
        for layers in ints(args.layers) if args.tensor_parallel_size == 1 else ():
            cfg = base.with_layers(layers)
            t = time.perf_counter()
            try:
                if args.one_rank_of > 1:              # rank 0's part of the layout, its peers absent
                    layout = Layout(args.one_rank_of, 1, args.enable_expert_parallel)
                    model = dummy_model(cfg, fmt, device, dtype, ops_for(device), shard=layout.shard(cfg, 0),
                                        comm=AbsentPeers())
                else:
                    model = dummy_model(cfg, fmt, device, dtype, ops_for(device))
            except Exception:           # (a layout the model cannot be split into is refused, naming the tensor)
                res["errors"].append(f"build {fmt} {layers} layers: {traceback.format_exc()[-1500:]}")
                continue
            if device.type == "cuda":
                model.prepare_for_kernels_()
            if args.one_stream:
                on_one_stream(model, fuse_queries=True)
            sync(device)
            build_s = time.perf_counter() - t
            for batch in ints(args.batch):
                for context, mode in [(c, m) for c in ints(args.context) for m in args.modes.split(",")]:
                    case = dict(format=fmt, layers=layers, batch=batch, context=context, mode=mode, build_s=build_s)
                    try:
                        runs = sorted((time_decode(model, batch, context, args.steps, device, gen, mode == "eager",
                                                   args.kv_cache_dtype, args.sequence, args.async_scheduling)
                                     for _ in range(args.repeats)),
                                      key=lambda r: r["step_ms"])
                        case.update(runs[(len(runs) - 1) // 2])         # the median engine's record
                        if args.repeats > 1:
                            case["step_ms_runs"] = [r["step_ms"] for r in runs]
                    except CacheCapacityError as e:
                        case["skipped"] = str(e)
                    except Exception:
                        res["errors"].append(f"decode {case}: {traceback.format_exc()[-1500:]}")
                        continue
                    if "step_ms" in case:
                        nbytes = step_bytes(model, cfg, batch, context, torch.finfo(dtype).bits // 8,
                                            args.kv_cache_dtype)
                        case.update(tokens_per_s=batch / case["step_ms"] * 1e3, step_bytes=nbytes,
                                    floor_ms=nbytes / args.bandwidth * 1e3)
                        step_by_layers[(layers, batch, context, mode)] = case
                    res["decode"].append(case)
                    print(json.dumps(case), flush=True)
            for length in ints(args.prefill):
                try:
                    row = dict(format=fmt, layers=layers, length=length, **time_prefill(model, length, args.chunk,
                                                                                       device, gen))
                    res["prefill"].append(row)
                    print(json.dumps(row), flush=True)
                except Exception:
                    res["errors"].append(f"prefill {fmt} {layers} {length}: {traceback.format_exc()[-1500:]}")
            del model
        res["per_layer"] += per_layer(fmt, step_by_layers, sorted(ints(args.layers)))
    if args.hf == "on":
        try:
            res["hf"] = hf_decode_ms(base.with_layers(min(ints(args.layers))), device, dtype, args.steps,
                                     min(ints(args.context)))
        except Exception:
            res["hf"] = {"error": traceback.format_exc()[-1500:]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "e2e.json").write_text(json.dumps(res, indent=1))
    print(table(res), flush=True)
    return res


def table(res: dict) -> str:
    tp = res.get("tensor_parallel_size", 1)
    ep = " + expert parallel" if res.get("enable_expert_parallel") else ""
    split = f", {tp} ranks{ep}, all-reduce {res.get('all_reduce')}" if tp > 1 else ""
    if res.get("one_rank_of", 1) > 1:
        split = f", rank 0 of {res['one_rank_of']}{ep} alone, no communication"
    lines = [f"dsv4 e2e {res['started']} on {res['device']} ({res['model']}, {res['dtype']}{split})",
             f"{'format':14s} {'mode':6s} {'layers':>6s} {'batch':>5s} {'context':>7s} {'step ms':>9s} {'tok/s':>9s} "
             f"{'floor ms':>9s} {'of floor':>8s} {'launches':>8s} {'busy':>5s} {'in a row ms':>11s} {'busy':>5s}"]
    for c in res["decode"]:
        if "step_ms" not in c:
            lines.append(f"{c['format']:14s} {c.get('mode', ''):6s} {c['layers']:6d} {c['batch']:5d} "
                         f"{c['context']:7d}  skipped: {c.get('skipped', '')[:80]}")
            continue
        launches = c.get("kernel_launches", c.get("aten_ops", 0))
        busy = f"{100 * c['gpu_busy']:4.0f}%" if "gpu_busy" in c else "    -"
        row_busy = f"{100 * c['gpu_busy_in_a_row']:4.0f}%" if "gpu_busy_in_a_row" in c else "    -"
        in_a_row = f"{c['step_ms_in_a_row']:11.2f}" if "step_ms_in_a_row" in c else f"{'-':>11s}"
        lines.append(f"{c['format']:14s} {c.get('mode', ''):6s} {c['layers']:6d} {c['batch']:5d} {c['context']:7d} "
                     f"{c['step_ms']:9.2f} "
                     f"{c['tokens_per_s']:9.1f} {c['floor_ms']:9.3f} {100 * c['floor_ms'] / c['step_ms']:7.1f}% "
                     f"{launches:8d} {busy} {in_a_row} {row_busy}")
    for c in res["decode"]:
        if c.get("kernels"):
            lines.append(f"kernels of one step: {c['format']} {c.get('mode', '')} {c['layers']} layers, batch "
                         f"{c['batch']}, context {c['context']} (GPU busy {c['gpu_us']:.0f} us):")
            lines += [f"    {k['us']:9.1f} us {k['count']:5d}x  {k['name']}" for k in c["kernels"]]
    for p in res["per_layer"]:
        kernels = f" (kernels {p['kernel_us_per_layer']:.0f})" if "kernel_us_per_layer" in p else ""
        lines.append(f"us per layer: {p['format']} {p.get('mode', '')} batch {p['batch']} context {p['context']}: "
                     f"{p['us_per_layer']:.0f}{kernels}")
        lines += [f"    {k['us']:9.1f} us {k['count']:5.2f}x  {k['name']}" for k in p.get("kernels_per_layer", [])]
        if "idle_us_per_layer" in p:
            lines.append(f"  GPU idle per layer: {p['idle_us_per_layer']:.1f} us, before:")
            lines += [f"    {k['us']:9.1f} us {k['count']:5.2f}x  {k['name']}" for k in p["idle_before_per_layer"]]
    for p in res["prefill"]:
        lines.append(f"prefill: {p['format']} {p['layers']} layers, {p['length']} tokens: "
                     f"{p['tokens_per_s']:.1f} tok/s")
    if "hf" in res:
        lines.append(f"transformers eager, batch 1: {res['hf']}")
    if res["errors"]:
        lines.append("errors: " + " | ".join(e.strip().splitlines()[-1][:200] for e in res["errors"]))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
