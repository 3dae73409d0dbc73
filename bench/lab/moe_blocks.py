"""Question: From how many tokens is the GEMV pair over expert blocks faster than the sorted grouped GEMM?

The routed experts of the MoE layer over expert blocks, against the sorted grouped GEMM.

    python bench/lab/moe_blocks.py [--tokens 64,128,256,512] [--rounds 3] [--out DIR]     # on the GPU
    TRITON_INTERPRET=1 python bench/lab/moe_blocks.py --toy                              # CPU dry run

For each model, format and token count: the same rotated inputs (x, routing logits -> `route`) through
`kernels.moe.moe` without the shared expert, two ways: the GEMV pair over expert blocks (`moe.expert_blocks`) and
the sorted grouped tiles (`block_tokens=None`). The two are timed in turn, `--rounds` times, and the median
of each is printed with its share of the byte floor (the bytes of the distinct experts the routings touch, at the
measured copy bandwidth), their ratio and the blocks' error against the sorted path's output. This decides
`policy.BLOCK_PAIRS_PER_EXPERT`. (Commit e3ae6b6 also timed blocks of 16 pairs; bench/RESULTS.md run 139.)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import FLASH, PRO, TOY, bench_start, nbytes, random_qweight, rel_err, write_record  # noqa: E402

from dsv4.kernels import dispatch, policy, ref, refuse_fallback  # noqa: E402
from dsv4.kernels import moe as tmoe  # noqa: E402
from dsv4.kernels.host import Scratch  # noqa: E402

VARIANTS = {"blocks": dict(block_tokens=(1, 1 << 30)), "sorted": dict(block_tokens=None)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="64,128,256,512")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fmts", default="nvfp4", help="routed experts' formats; the first model also runs mxfp4 if named")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    ap.add_argument("--toy", action="store_true", help="CPU interpreter dry run at toy shapes (checks the script)")
    args = ap.parse_args()
    dev, gen, timer, copy = bench_start(args.toy)
    scratch = Scratch()
    models = [TOY] if args.toy else [FLASH, PRO]
    fmts = args.fmts.split(",")
    rows = []
    for s in models:
        for fmt in fmts if s is models[0] else fmts[:1]:
            w13 = random_qweight(fmt, (s.E, 2), s.I, s.D, dev, gen)
            w2 = random_qweight(fmt, (s.E,), s.D, s.I, dev, gen)
            per_expert = nbytes(w13) // s.E + nbytes(w2) // s.E
            bias = torch.zeros(s.E, device=dev)
            for t in map(int, args.tokens.split(",")):
                rot = 2 if args.toy else 4
                xs = [torch.randn(t, s.D, device=dev, generator=gen).bfloat16() for _ in range(rot)]
                logits = [torch.randn(t, s.E, device=dev, generator=gen) for _ in range(rot)]
                touched = sum(torch.unique(ref.route(lg, bias, s.k, 1.5)[1]).numel() for lg in logits) / rot
                floor = per_expert * touched

                def call(x, lg, kw):
                    wts, ids = tmoe.route(lg, bias, s.k, 1.5, fallback=refuse_fallback)
                    return dispatch.moe(x, ids, wts, w13, w2, 10.0, fallback=refuse_fallback, scratch=scratch, **kw)

                outs = {name: call(xs[0], logits[0], kw) for name, kw in VARIANTS.items()}
                times = {name: [] for name in VARIANTS}
                for _ in range(args.rounds):
                    for name, kw in VARIANTS.items():
                        times[name].append(timer.per_call_ms(
                            [lambda x=x, lg=lg, kw=kw: call(x, lg, kw) for x, lg in zip(xs, logits)]) * 1e3)
                row = dict(model=s.name, fmt=fmt, T=t, experts=touched, floor_mb=floor / 1e6,
                           pairs_per_expert=t * s.k / touched)
                line = f"{s.name:8s} {fmt:5s} T={t:<4d} pairs/expert {row['pairs_per_expert']:5.2f}"
                for name in VARIANTS:
                    us = statistics.median(times[name])
                    row[name] = dict(us=us, all_us=times[name], pct_floor=100 * floor / (copy * 1e3) / us,
                                     rel_err_to_sorted=rel_err(outs[name], outs["sorted"]))
                    line += f" | {name} {us:8.1f} us {row[name]['pct_floor']:3.0f}%"
                row["blocks/sorted"] = row["blocks"]["us"] / row["sorted"]["us"]
                line += (f" | blocks/sorted {row['blocks/sorted']:.3f}"
                         f" | rel. diff {row['blocks']['rel_err_to_sorted']:.1e}"
                         f" | in moe's block range: {policy.in_block_range(t, policy.auto_block_tokens(s.E, s.k))}")
                print(line, flush=True)
                rows.append(row)
    write_record(args.out, "moe_blocks.json", dict(copy_gbps=copy, rows=rows))


if __name__ == "__main__":
    main()
