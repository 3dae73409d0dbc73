"""Question: What does the indexer's top-k cost a launch by batch and context, and which program shape (scores per
pass iteration, warps, programs a row) makes it fastest?

At batch 1 and 8K context the select alone takes more than issue 38's 20 us for the whole CSA attention part
(bench/results/round-35.md). `kernels.indexer.index_picks_of_scores` is timed here on score rows of V4-Flash's shape
(one compressed entry per 4 tokens, top-512) for each variant of its launch (`block`, `warps`, `chunks`, `tail`:
a remainder past the whole blocks read in one smaller block; a decode step at 8K context has rows of 2,049-2,050
visible scores, context 8196-8200 here). Every variant's picks must equal the default's (the select is exact and
deterministic), and the default's a stable sort's (score descending, then id; the oracle).

    python bench/lab/topk.py [--batches 1,64] [--contexts 8192,8196,65536,131072] [--out DIR]   # on the GPU
    python bench/lab/topk.py --toy                                                             # CPU dry run

Prints one line per (batch, context, variant): microseconds per call (CUDA graph of rotated inputs) and whether the
picks agree; writes topk.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository: dsv4
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # bench: common

from common import Timer, lab_parser, median_us, record_failure, write_record  # noqa: E402

from dsv4.kernels import indexer  # noqa: E402

RATIO, TOPK = 4, 512                # V4-Flash's CSA: an entry per 4 tokens, index_topk 512
VARIANTS = {                        # name -> index_picks_of_scores options
    "default": {},
    "block 1024, 4 warps": dict(block=1024, warps=4),
    "block 2048": dict(block=2048),
    "4 warps": dict(warps=4),
    "16 warps": dict(warps=16),
    "block 1024": dict(block=1024),
    "block 4096": dict(block=4096),
    "2 chunks": dict(chunks=2),
    "4 chunks": dict(chunks=4),
    "16 chunks": dict(chunks=16),
    "no tail": dict(tail=0),
    "tail 128": dict(tail=128),
    "tail 512": dict(tail=512),
}


def oracle_picks(row: torch.Tensor, topk: int) -> list[int]:
    """The ids of the topk largest finite scores of one row, by a stable sort (score descending, then id)."""
    order = torch.sort(-row.double(), stable=True).indices[:topk]
    return sorted(int(j) for j in order if row[j] > float("-inf"))


def main():
    ap = lab_parser("CPU dry run at small rows (checks the script)")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--contexts", default="8192,8196,65536,131072")
    args = ap.parse_args()
    topk = TOPK
    if args.toy:
        args.device, args.batches, args.contexts, args.rounds, topk = "cpu", "1,3", "2048,8200", 1, 64
    dev = torch.device(args.device)
    gen = torch.Generator(device=dev).manual_seed(0)
    timer, label = Timer(dev), "toy" if args.toy else dev.type
    print(f"{label:5s} {'B':>4s} {'context':>8s} {'variant':22s} | {'us':>8s} {'vs default':>10s} | picks")
    rows = []
    for B in map(int, args.batches.split(",")):
        for context in map(int, args.contexts.split(",")):
            n = context // RATIO
            scores = [torch.randn(B, n, device=dev, generator=gen).clamp(min=0) for _ in range(4)]  # ReLU-like ties
            positions = torch.full((B,), context - 1, dtype=torch.int32, device=dev)
            default = indexer.index_picks_of_scores(scores[0], topk, positions, RATIO)
            first = scores[0][0].cpu()
            want = oracle_picks(first, topk)
            oracle_ok = default[0, :len(want)].cpu().tolist() == want
            base_us = None
            for name, options in VARIANTS.items():
                row = dict(batch=B, context=context, keys=n, variant=name, options=options)
                try:
                    got = indexer.index_picks_of_scores(scores[0], topk, positions, RATIO, **options)
                    row["same_picks"] = bool(torch.equal(got, default))
                    calls = [lambda s=s, o=options: indexer.index_picks_of_scores(s, topk, positions, RATIO, **o)
                             for s in scores]
                    row["us"] = median_us(timer, calls, args.rounds)
                except Exception as e:                    # a variant that does not compile or run: say so, go on
                    record_failure(row, e, f"{label:5s} {B:4d} {context:8d} {name:22s}")
                    rows.append(row)
                    continue
                base_us = base_us or row["us"]
                agree = "= default" if row["same_picks"] else "DIFFER"
                if name == "default":
                    agree = "= stable sort" if oracle_ok else "DIFFERS FROM THE SORT"
                print(f"{label:5s} {B:4d} {context:8d} {name:22s} | {row['us']:8.1f} {row['us'] / base_us:10.2f} | "
                      f"{agree}", flush=True)
                row["default_is_sort"] = oracle_ok
                rows.append(row)
    write_record(args.out, "topk.json", dict(device=str(dev), rows=rows))
    bad = [f"{r['batch']}x{r['context']} {r['variant']}" for r in rows
           if not r.get("same_picks", True) or not r.get("default_is_sort", True)]
    if bad:
        raise SystemExit(f"picks differ from the default's or the sort's: {bad}")


if __name__ == "__main__":
    main()
