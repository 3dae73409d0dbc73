"""Question: How far do the compressed caches (`kv_cache_dtype` "fp8-indexer" and "fp8") move the engine's outputs
from the default cache's ("auto": the compute dtype, bf16 on the GPU)?

The same greedy requests run on one model with each cache dtype, decode steps as CUDA graphs (dummy V4-Flash
weights, 4 layers, on CUDA; the tiny preset on the CPU). Per request it reports the first step whose token differs
from the "auto" run's, and over the steps before it (the same context in both runs) the largest and the mean
difference of the chosen token's log-probability. For scale, the same figures for the "auto" cache with plain
eager steps (`plain`: kernels planned for the exact batch, so they round differently from the graphs' padded
steps): the differences that bf16 rounding alone makes. Prompts of 300 to 3,000 tokens, so that decode reads
compressed entries from many pages and crosses CSA and HCA window closes.

    python bench/cache_dtype_check.py --out DIR                  # CUDA: dummy V4-Flash dims, 4 layers
    python bench/cache_dtype_check.py --model tiny --out DIR     # CPU: the tiny preset, short prompts

Prints one line per cache; writes DIR/cache_dtype_check.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import dummy_bench_model  # noqa: E402

from dsv4.runtime.engine import Engine  # noqa: E402
from dsv4.runtime.params import SamplingParams  # noqa: E402

CACHES = ("auto", "fp8-indexer", "fp8")


def generate(engine: Engine, prompts: list[list[int]], new: int) -> list[tuple[list[int], list[float]]]:
    """(greedy tokens, each one's log-probability) per request."""
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, logprobs=0)
    seqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    errors = [s.tracker.error for s in seqs if s.tracker.error]
    if errors:
        raise RuntimeError(f"requests failed: {errors[:2]}")
    return [(list(s.tracker.token_ids), [lp[tok].logprob for tok, lp in zip(s.tracker.token_ids, s.tracker.logprobs)])
            for s in seqs]


def compare(runs: list[tuple[list[int], list[float]]], base: list[tuple[list[int], list[float]]]) -> dict:
    """Per request: the first differing step (None: none), and the chosen tokens' log-probability differences over
    the steps before it."""
    first, diffs = [], []
    for (tokens, lps), (base_tokens, base_lps) in zip(runs, base):
        k = next((i for i, (a, b) in enumerate(zip(tokens, base_tokens)) if a != b), None)
        first.append(k)
        diffs += [abs(a - b) for a, b in zip(lps[:k], base_lps[:k])] if k != 0 else []
    return {"first_difference": first, "same_steps": len(diffs),
            "max_logprob_diff": max(diffs, default=0.0), "mean_logprob_diff": sum(diffs) / max(len(diffs), 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="v4-flash", help="preset (v4-flash, tiny) or a config.json path")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--format", default="nvfp4-experts")
    ap.add_argument("--new", type=int, default=24, help="tokens generated per request")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args(argv)
    device, dtype, cfg, model = dummy_bench_model(args.model, args.layers, args.format, args.device)
    lengths = (300, 1500, 3000) if device.type == "cuda" else (40, 70, 130)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, cfg.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    kw = dict(max_num_seqs=4, max_model_len=max(lengths) + args.new + 1, max_num_batched_tokens=1024,
              num_cache_pages=32)
    t = time.perf_counter()
    outputs = {cache: generate(Engine(model, kv_cache_dtype=cache, **kw), prompts, args.new) for cache in CACHES}
    plain_engine = Engine(model, enforce_eager=True, **kw)
    plain_engine.graphs = None                   # plain steps: kernels planned for the exact batch
    outputs["plain"] = generate(plain_engine, prompts, args.new)
    seconds = time.perf_counter() - t
    res = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "model": args.model,
           "layers": args.layers, "format": args.format, "prompt_lengths": lengths, "new": args.new,
           "compute_dtype": str(dtype), "seconds": seconds, "against_auto": {}}
    print(f"{'cache':12s} | first differing step per request | same steps | max |dlogprob| | mean |dlogprob|")
    for name in ("plain", *CACHES[1:]):
        row = compare(outputs[name], outputs["auto"])
        res["against_auto"][name] = row
        print(f"{name:12s} | {str(row['first_difference']):32s} | {row['same_steps']:10d} | "
              f"{row['max_logprob_diff']:14.4f} | {row['mean_logprob_diff']:15.4f}", flush=True)
    res["auto_logprobs"] = [lps for _, lps in outputs["auto"]]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cache_dtype_check.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
