"""Question: How long does sampling one token per row take, the Triton kernel against the PyTorch reference?

`runtime.sampler.sample` (on CUDA: one `kernels/sampling.py` launch, the kept set found by rejection) against
`runtime.sampler.sample_reference` (PyTorch: the kept set found by sorting each row) at V4's vocabulary; issue 39's
target is <= 50 us a step at batch 64.

    python bench/lab/sampler.py [--batches 1,8,64,256] [--vocab 129280] [--rounds 3] [--candidates 2,8] [--out DIR]
    python bench/lab/sampler.py --toy                                                             # CPU dry run
    python bench/lab/sampler.py --logits equal --batches 64         # every logit equal: top-k's worst case
    python bench/lab/sampler.py --batches 64 --profile                  # + each launch's time (torch.profiler)
    python bench/lab/sampler.py --dtype fp32                     # fp32 logits (default bf16, as the engine's)

For each mix of sampling parameters and batch size: random logits (N(0, 3^2) in `--dtype`, bf16 by default: the model's
logits, which the engine samples in place; a new set per rotated call; with
`--logits equal` every logit 0, where every key shares every byte of top-k's radix select and every token is kept), one
batch of parameters, and the two samplers timed in turn, `--rounds` times; the median of each is printed with
their ratio and how many rows drew a different token. The kernel's exp and log may differ from torch's in the last
bit, which can move a token only at a near-tie (expect 0 rows in thousands); more than 1 % of the rows is an error.
On CUDA the calls are captured in one CUDA graph (`common.Timer`), which also checks that they can be; a capture
that fails is reported and the calls are then timed without a graph. Mixes: "plain" (temperature 1, no filter),
"top-p 0.95", "top-k 50, top-p 0.95" (temperature 0.8), and "mixed, all filters" (rows with and without seeds,
greedy and filtered, built with all_filters=True: the batch a CUDA graph of the decode step holds). `--candidates`
also times the kernel with other counts of draws a top-p row checks (`kernels.sampling.sample_tokens(candidates=)`,
default `sampling.CANDIDATES`) as "kernel, N candidates", their tokens checked against the reference's with as many. `--profile` (CUDA)
also runs the kernel sampler 16 times, eagerly, under torch.profiler and prints each of a call's launches in order
with its mean time (the JSON row's "launches").
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository: dsv4
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # bench: common

from common import Timer, lab_parser, write_record  # noqa: E402

from dsv4.kernels import ref, sampling  # noqa: E402
from dsv4.runtime.params import SamplingParams  # noqa: E402
from dsv4.runtime.sampler import SamplerOutput, SamplingBatch, sample, sample_reference  # noqa: E402

SAMPLERS = {"reference": sample_reference, "kernel": sample}
MIXED = [SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=1), SamplingParams(temperature=0.0),
         SamplingParams(top_p=0.9, min_p=0.05), SamplingParams(temperature=0.6, top_k=20)]


def mixes(batch: int) -> dict[str, tuple[list[SamplingParams], bool]]:
    """name -> (one SamplingParams per row, all_filters)."""
    return {
        "plain": ([SamplingParams()] * batch, False),
        "top-p 0.95": ([SamplingParams(top_p=0.95)] * batch, False),
        "top-k 50, top-p 0.95": ([SamplingParams(temperature=0.8, top_k=50, top_p=0.95)] * batch, False),
        "mixed, all filters": ([MIXED[i % len(MIXED)] for i in range(batch)], True),
    }


def main():
    ap = lab_parser("CPU dry run at a small vocabulary (checks the script)")
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--candidates", default="", help="other counts of draws a top-p row checks, to time, e.g. 2,8")
    ap.add_argument("--logits", choices=("normal", "equal"), default="normal", help="N(0, 3^2) logits, or all 0")
    ap.add_argument("--profile", action="store_true", help="each launch's mean time under torch.profiler (CUDA)")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                    help="the logits' dtype: bf16 as the engine hands the model's logits over, or fp32")
    args = ap.parse_args()
    if args.toy:
        args.device, args.batches, args.vocab, args.rounds = "cpu", "1,8", 1000, 1
    dev = torch.device(args.device)
    gen = torch.Generator(device=dev).manual_seed(0)
    timer, label = Timer(dev), "toy" if args.toy else dev.type
    rot = 4 if dev.type == "cuda" else 2
    print(f"{label:5s} {'mix':22s} {'B':>4s} {'V':>7s} | {'ref us':>10s} {'kernel us':>10s} {'kernel/ref':>10s} "
          f"| rows differ | graph")
    rows = []
    for b in map(int, args.batches.split(",")):
        dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
        logits = [(torch.randn(b, args.vocab, device=dev, generator=gen) * (3 if args.logits == "normal" else 0))
                  .to(dtype) for _ in range(rot)]
        for name, (params, all_filters) in mixes(b).items():
            batch = SamplingBatch.build(params, range(b), args.vocab, dev, unseeded_seed=7, all_filters=all_filters)
            samplers = dict(SAMPLERS)
            expected = {"kernel": sample_reference(logits[0], batch).token_ids}
            for n in map(int, filter(None, args.candidates.split(","))) if dev.type == "cuda" else ():
                samplers[f"kernel, {n} candidates"] = lambda x, batch, n=n: _kernel_draw(x, batch, n)
                expected[f"kernel, {n} candidates"] = _reference_draw(logits[0], batch, n)
            differ = {sampler_name: int((fn(logits[0], batch).token_ids != expected[sampler_name]).sum())
                      for sampler_name, fn in samplers.items() if sampler_name != "reference"}
            row = dict(mix=name, B=b, V=args.vocab, logits=args.logits, dtype=args.dtype,
                       rows_differ=max(differ.values()), rows_differ_by=differ, graph=dev.type == "cuda")
            calls = {sampler_name: [lambda x=x, fn=fn, batch=batch: fn(x, batch) for x in logits]
                     for sampler_name, fn in samplers.items()}
            for sampler_name in samplers if row["graph"] else ():
                try:                                 # a capture that fails: say so, then time both without graphs
                    timer.per_call_ms(calls[sampler_name][:1], rep=1)
                except Exception as e:
                    row.update(graph=False, graph_error=f"{sampler_name}: {type(e).__name__}: {e}"[:500])
                    print(f"{label:5s} {name}: capture failed ({row['graph_error']}); timing without a graph")
            times = {sampler_name: [] for sampler_name in samplers}
            for _ in range(args.rounds):
                for sampler_name in samplers:
                    times[sampler_name].append(timer.per_call_ms(calls[sampler_name], graph=row["graph"]) * 1e3)
            for sampler_name, us in times.items():
                row[sampler_name] = dict(us=statistics.median(us), all_us=us)
            row["kernel/reference"] = row["kernel"]["us"] / row["reference"]["us"]
            print(f"{label:5s} {name:22s} {b:4d} {args.vocab:7d} | {row['reference']['us']:10.1f} "
                  f"{row['kernel']['us']:10.1f} {row['kernel/reference']:10.2f} | {differ['kernel']:11d} | "
                  f"{row['graph']}", flush=True)
            for sampler_name in list(samplers)[len(SAMPLERS):]:
                print(f"{label:5s} {name:22s} {b:4d} {args.vocab:7d} | {sampler_name:>21s} "
                      f"{row[sampler_name]['us']:10.1f} | {differ[sampler_name]:11d}", flush=True)
            if args.profile and dev.type == "cuda":
                row["launches"] = launch_profile(lambda x, batch=batch: sample(x, batch), logits)
                print(f"{label:5s} {name:22s} {b:4d} launches: "
                      + ", ".join(f"{n} {us:.1f}" for n, us in row["launches"]), flush=True)
            rows.append(row)
    write_record(args.out, "sampler.json", dict(device=str(dev), rows=rows))
    bad = [f"{r['mix']} B={r['B']}: {r['rows_differ']} rows" for r in rows if r["rows_differ"] > 0.01 * r["B"]]
    if bad:
        raise SystemExit(f"sample and sample_reference drew different tokens in more than 1 % of the rows: {bad}")


def launch_profile(fn, logits: list[torch.Tensor], calls: int = 16) -> list[tuple[str, float]]:
    """Each of a call's CUDA launches in order -> (kernel name, mean us over `calls` eager calls of fn over the rotated
    logits); copies and fills left out."""
    from torch.profiler import ProfilerActivity, profile
    for x in logits:
        fn(x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            fn(logits[i % len(logits)])
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA" and not e.name.startswith(("Memcpy", "Memset"))]
    per_call = len(events) // calls
    return [(events[i].name.split("_kernel")[0].lstrip("_"),
             statistics.mean(e.device_time_total for e in events[i:per_call * calls:per_call]))
            for i in range(per_call)]


def _kernel_draw(logits, batch, candidates: int):
    """`sample`'s kernel path with `candidates` draws checked a top-p row (no logprobs: the lab asks for none)."""
    return SamplerOutput(sampling.sample_tokens(logits, batch.inv_temperature, batch.greedy, batch.min_p, batch.top_k,
                                                batch.drop_share, batch.seeds, batch.counters, candidates=candidates),
                         None, None, None)


def _reference_draw(logits, batch, candidates: int):
    """The reference's tokens with `candidates` draws checked a top-p row."""
    return ref.sample_tokens(logits.float(), batch.inv_temperature, batch.greedy, batch.min_p, batch.top_k,
                             batch.drop_share, batch.seeds, batch.counters, candidates=candidates)


if __name__ == "__main__":
    main()
