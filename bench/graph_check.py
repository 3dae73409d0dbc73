"""Decode CUDA graphs against eager steps: the same greedy tokens from `Engine()` (graphs) and
`Engine(enforce_eager=True)` (the same padded steps, uncaptured) on the same requests, whose decode crosses CSA and
HCA window closes, page boundaries and batch-size buckets (requests of different lengths finish at different steps,
so the batch shrinks through them). On CUDA it also reports, without failing on it, whether the engine's plain
unpadded steps give the same tokens (`plain_identical`): they plan their kernels by the exact batch and length, and
a different key split or tile rounds differently, which can flip a near-tie of dummy weights' logits.

    python bench/graph_check.py --out DIR                       # CUDA: dummy V4-Flash dims, 4 layers
    python bench/graph_check.py --model tiny --out DIR          # CPU: the runner's padded path without capture
    python bench/graph_check.py --tensor-parallel-size 2 --out DIR   # two GPUs: every rank replays its graphs

The graphs' engine launches each decode step before the last one's tokens are read back (async scheduling); the same
engine without it (`async_identical`) must give the same tokens, on the CPU too. On CUDA it also runs the eager
engine once more with the work each layer starts beside its query products (the compressors, the indexer's picks) on
the one stream (`one_stream_identical`): the second stream must change no token (a missing wait would let attention
read entries the compressors have not written yet). On the CPU no graph is captured: the eager engine steps plainly
and the other gets the runner with capture=False (its padded static-buffer path), the comparison the tests make.
With --tensor-parallel-size N the two engines are parallel `dsv4.LLM`s of dummy weights (the same seed: the same
weights), their decode graphs captured on every rank (one-shot all-reduce inside them, or NCCL with
--disable-custom-all-reduce). Writes DIR/graph_check.json; exits 1 if any token differs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import dummy_bench_model, on_one_stream  # noqa: E402

from dsv4.runtime.cache import KVCache  # noqa: E402
from dsv4.runtime.engine import Engine  # noqa: E402
from dsv4.runtime.graphs import DecodeGraphs  # noqa: E402
from dsv4.runtime.params import SamplingParams  # noqa: E402


def generate(engine: Engine, prompts: list[list[int]], new: list[int]) -> list[list[int]]:
    seqs = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            for p, n in zip(prompts, new)]
    while engine.has_unfinished():
        engine.step()
    errors = [s.tracker.error for s in seqs if s.tracker.error]
    if errors:
        raise RuntimeError(f"requests failed: {errors[:2]}")
    return [list(s.tracker.token_ids) for s in seqs]


def first_differences(a: list[list[int]], b: list[list[int]]) -> list[int | None]:
    """Per request, the index of the first token where a and b differ (None: none does)."""
    return [next((i for i, (x, y) in enumerate(zip(u, v)) if x != y), None) for u, v in zip(a, b)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="v4-flash", help="preset (v4-flash, tiny) or a config.json path")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--format", default="nvfp4-experts")
    ap.add_argument("--device", default=None)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--disable-custom-all-reduce", action="store_true")
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args(argv)
    if args.tensor_parallel_size > 1:
        return parallel_check(args)
    device, dtype, cfg, model = dummy_bench_model(args.model, args.layers, args.format, args.device)
    gen = torch.Generator().manual_seed(0)
    lengths, new = (5, 126, 250, 31, 3, 64), (40, 9, 20, 14, 30, 6)     # decode crosses 128 and 256; 6 -> 1 rows
    prompts = [torch.randint(2, cfg.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    kw = dict(max_num_seqs=8, max_model_len=320, num_cache_pages=16, max_num_batched_tokens=256)
    t = time.perf_counter()
    eager = generate(Engine(model, enforce_eager=True, **kw), prompts, list(new))

    def runner_engine(async_scheduling: bool) -> Engine:
        engine = Engine(model, async_scheduling=async_scheduling, **kw)
        if engine.graphs is None:                # the CPU: the runner's padded path, without capture
            engine.cache = KVCache(cfg, kw["max_num_seqs"] + 1, kw["num_cache_pages"], dtype, device)
            engine.graphs = DecodeGraphs(model, engine.cache.layers, kw["max_num_seqs"], kw["max_model_len"],
                                         pad_slot=kw["max_num_seqs"], capture=False)
        return engine
    graphed_engine = runner_engine(True)
    plain = None
    if device.type == "cuda":                    # CUDA: also the plain unpadded steps, reported
        plain_engine = Engine(model, enforce_eager=True, **kw)
        plain_engine.graphs = None
        plain = generate(plain_engine, prompts, list(new))
    graphed = generate(graphed_engine, prompts, list(new))
    in_order = generate(runner_engine(False), prompts, list(new))
    one_stream = None
    if device.type == "cuda":
        on_one_stream(model, fuse_queries=False)
        one_stream = generate(Engine(model, enforce_eager=True, **kw), prompts, list(new))
    same = [a == b for a, b in zip(eager, graphed)]
    res = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "model": args.model,
           "layers": args.layers, "format": args.format, "captured": device.type == "cuda",
           "graph_memory": graphed_engine.graph_memory, "identical": all(same), "per_request": same,
           "first_difference": first_differences(eager, graphed), "async_identical": in_order == graphed,
           "async_first_difference": first_differences(in_order, graphed), "seconds": time.perf_counter() - t}
    if plain is not None:
        res |= {"plain_identical": plain == graphed, "plain_first_difference": first_differences(plain, graphed)}
    if one_stream is not None:
        res |= {"one_stream_identical": one_stream == eager,
                "one_stream_first_difference": first_differences(one_stream, eager)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "graph_check.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res), flush=True)
    return 0 if res["identical"] and res["async_identical"] and res.get("one_stream_identical", True) else 1


def parallel_check(args) -> int:
    """The same comparison on two parallel engines of --tensor-parallel-size ranks (eager, then graphs)."""
    import dsv4

    lengths, new = (5, 126, 250, 31, 3, 64), (40, 9, 20, 14, 30, 6)
    tokens, memory, t = {}, 0, time.perf_counter()
    for eager in (True, False):
        with dsv4.LLM(args.model, device=args.device, load_format=f"dummy-{args.format}", skip_tokenizer_init=True,
                      hf_overrides={"num_hidden_layers": args.layers}, tensor_parallel_size=args.tensor_parallel_size,
                      disable_custom_all_reduce=args.disable_custom_all_reduce, enforce_eager=eager, max_num_seqs=8,
                      max_model_len=320, num_cache_pages=16, max_num_batched_tokens=256, progress=False) as llm:
            vocab = llm.model.config.vocab_size
            prompts = [torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()
                       for n in lengths]
            tokens[eager] = generate(llm.engine, prompts, list(new))
            memory = memory or llm.engine.graph_memory
            runner = llm.engine.graphs
    same = [a == b for a, b in zip(tokens[True], tokens[False])]
    res = {"model": args.model, "layers": args.layers, "format": args.format,
           "tensor_parallel_size": args.tensor_parallel_size, "captured": runner is not None and bool(runner.graphs),
           "graph_memory": memory, "identical": all(same), "per_request": same, "seconds": time.perf_counter() - t}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "graph_check.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res), flush=True)
    return 0 if res["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
