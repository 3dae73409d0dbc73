"""Question: What do experts shared between tokens cost the MoE decode pair?

What experts shared between tokens cost the MoE decode pair: the same pairs with three routings.

    python bench/lab/profile_duplicates.py [--tokens 2,4,8] [--rot 8] [--rounds 3]
    TRITON_INTERPRET=1 python bench/lab/profile_duplicates.py --toy      # CPU dry run on a toy shape

`dispatch.moe` (the GEMV pair, routed NVFP4 experts and the FP8 shared expert in its launches) reads each
(token, slot) pair's expert on its own: two tokens routed to one expert read its weights twice. For T tokens of
k slots each, three routings of the same T * k pairs:
* random: k distinct experts per token, drawn independently per token (as `common.moe_decode_inputs` and the
  layer benchmarks route), so some experts serve two tokens;
* sorted: the same experts with the flattened pairs sorted by expert, so that a shared expert's pairs are
  adjacent and their units run side by side (does L2 serve the second read?);
* unique: T * k distinct experts (no expert shared).
Each cell is the median of `--rounds` timings.
Per routing: the time, % of its byte floor (the distinct experts it touches + the shared expert, at the
copy bandwidth, as `run_all.py` counts it), and % of the bytes of all pairs (every pair's expert read once).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository: dsv4
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # bench: common
sys.path.insert(0, str(Path(__file__).resolve().parent))       # bench/lab: sass, timeline

from common import FLASH, PRO, TOY, bench_start, nbytes, random_qweight, random_routing  # noqa: E402

from dsv4.kernels import dispatch, refuse_fallback  # noqa: E402
from dsv4.kernels.host import Scratch  # noqa: E402


def routings(E: int, T: int, k: int, rot: int, device, gen) -> dict[str, list[torch.Tensor]]:
    """`rot` expert-id tensors [T, k] per routing (module docstring)."""
    rand = [random_routing(E, T, k, device, gen) for _ in range(rot)]
    return {"random": rand,
            "sorted": [ids.flatten().sort().values.reshape(T, k) for ids in rand],
            "unique": [torch.randperm(E, device=device, generator=gen)[:T * k].reshape(T, k) for _ in range(rot)]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="2,4,8")
    ap.add_argument("--rot", type=int, default=8, help="rotated input sets per timing (distinct experts each)")
    ap.add_argument("--rounds", type=int, default=1, help="timings per routing (their median)")
    ap.add_argument("--toy", action="store_true", help="a toy shape on the CPU (with TRITON_INTERPRET=1)")
    args = ap.parse_args()
    dev, gen, timer, copy = bench_start(args.toy)
    scratch = Scratch()
    for s in (TOY,) if args.toy else (FLASH, PRO):
        w13 = random_qweight("nvfp4", (s.E, 2), s.I, s.D, dev, gen)
        w2 = random_qweight("nvfp4", (s.E,), s.D, s.I, dev, gen)
        shared = random_qweight("fp8", (2,), s.I, s.D, dev, gen), random_qweight("fp8", (), s.D, s.I, dev, gen)
        per_expert = (nbytes(w13) + nbytes(w2)) / s.E
        shared_bytes = sum(nbytes(w) for w in shared)
        for T in (int(t) for t in args.tokens.split(",")):
            if T * s.k > s.E:
                continue
            rot, P = (2 if args.toy else args.rot), T * s.k
            dt = torch.float32 if args.toy else torch.bfloat16
            xs = [torch.randn(T, s.D, device=dev, generator=gen).to(dt) for _ in range(rot)]
            rws = [torch.rand(T, s.k, device=dev, generator=gen) for _ in range(rot)]
            for name, ids in routings(s.E, T, s.k, rot, dev, gen).items():
                touched = sum(i.unique().numel() for i in ids) / rot
                ms = statistics.median(timer.per_call_ms([
                    lambda i=i: dispatch.moe(xs[i], ids[i], rws[i], w13, w2, 10.0, shared=shared,
                                             fallback=refuse_fallback, scratch=scratch)
                    for i in range(rot)]) for _ in range(args.rounds))
                floor = touched * per_expert + shared_bytes
                every = P * per_expert + shared_bytes
                print(f"{s.name:8s} T={T:<2d} {name:7s} experts {touched:5.1f} of {P:3d} pairs  {ms * 1e3:8.1f} us  "
                      f"{100 * floor / (copy * 1e9) / (ms * 1e-3):5.1f}% of its floor  "
                      f"{100 * every / (copy * 1e9) / (ms * 1e-3):5.1f}% of all pairs' bytes", flush=True)
        del w13, w2, shared


if __name__ == "__main__":
    main()
