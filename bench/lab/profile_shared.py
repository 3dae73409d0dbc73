"""Question: What does the MoE's shared expert cost in the decode pair, and where?

What the MoE's shared expert costs in the decode pair, and where.

    python bench/lab/profile_shared.py [--tokens 1,2,4,8] [--shared-fmt fp8]
    TRITON_INTERPRET=1 python bench/lab/profile_shared.py --toy      # CPU dry run on a toy shape

For each model (routed NVFP4 experts and an FP8 shared expert, as NVIDIA's NVFP4 builds store them, `dsv4 convert
--format nvfp4-experts`; `--shared-fmt nvfp4`: as `--format nvfp4` writes it) and
token count, `dispatch.moe` timed as:
* routed: the GEMV pair without the shared expert;
* in pair: with the shared expert in the pair's launches (this tree's layout: `policy.shared_cols`);
* per token: the same with the shared expert as one row block per token (`shared_cols` forced off; over expert
  blocks, from `policy.auto_block_tokens`' first count, the pair cannot carry it so, and it runs as "apart");
* apart: the routed pair, then the shared expert as its own two dense GEMV launches (`dispatch.mlp`), then the add;
* side: the routed pair, and at the same time the shared expert's two launches on a second CUDA stream
  (`dispatch.Side`, forced at every token count; `moe` takes it where `policy.beside_pair` says), then the add;
* alone: the shared expert's two dense launches by themselves.
Outputs of "in pair" and "per token" are compared (`=` when bit-identical).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository: dsv4
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # bench: common
sys.path.insert(0, str(Path(__file__).resolve().parent))       # bench/lab: sass, timeline

from common import FLASH, PRO, TOY, bench_start, moe_decode_inputs, nbytes, random_qweight  # noqa: E402

from dsv4.kernels import Ops, dispatch, gemv_launch, policy, refuse_fallback  # noqa: E402
from dsv4.kernels.host import Scratch  # noqa: E402

LIMIT = 10.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,2,4,8")
    ap.add_argument("--shared-fmt", default="fp8", choices=("fp8", "nvfp4", "mxfp4"),
                    help="the shared expert's format (the routed experts are NVFP4)")
    ap.add_argument("--toy", action="store_true", help="a toy shape on the CPU (with TRITON_INTERPRET=1)")
    args = ap.parse_args()
    dev, gen, timer, copy = bench_start(args.toy)
    scratch = Scratch()
    alone_op = Ops.triton(strict=True).mlp   # the shared expert's two launches, as the model's table runs them
    real_cols, real_beside = policy.shared_cols, policy.beside_pair
    side = dispatch.Side(refuse_fallback, refuse_fallback)
    for s in ((TOY,) if args.toy else (FLASH, PRO)):
        w13 = random_qweight("nvfp4", (s.E, 2), s.I, s.D, dev, gen)
        w2 = random_qweight("nvfp4", (s.E,), s.D, s.I, dev, gen)
        shared = (random_qweight(args.shared_fmt, (2,), s.I, s.D, dev, gen),
                  random_qweight(args.shared_fmt, (), s.D, s.I, dev, gen))
        shared_mb = (nbytes(shared[0]) + nbytes(shared[1])) / 1e6
        for T in (int(t) for t in args.tokens.split(",")):
            xs, ids, rws, _, _, _ = moe_decode_inputs(s, T, 2 if args.toy else 8, dev, gen)
            # where the pair does not carry the shared expert (over expert blocks, token columns off) `moe` adds
            # it with mlp_op: the Triton shared expert as the model runs it, not the reference's dequantization
            kw = dict(fallback=refuse_fallback, scratch=scratch, mlp_op=alone_op)

            def routed(i):
                return dispatch.moe(xs[i], ids[i], rws[i], w13, w2, LIMIT, **kw)

            def in_pair(i, **forced):   # forced: a scratch of its own, whose plans follow a forced policy
                return dispatch.moe(xs[i], ids[i], rws[i], w13, w2, LIMIT, shared=shared, **{**kw, **forced})

            def beside(i, **forced):
                return dispatch.moe(xs[i], ids[i], rws[i], w13, w2, LIMIT, shared=shared, side=side, **{**kw, **forced})

            def alone(i):
                return alone_op(xs[i], *shared, LIMIT)

            def apart(i):
                return routed(i) + alone(i)

            rows = {}
            for name, fn in (("routed", routed), ("in pair", in_pair), ("apart", apart), ("alone", alone)):
                rows[name] = timer.per_call_ms([lambda i=i, fn=fn: fn(i) for i in range(len(xs))]) * 1e3
            cols = in_pair(0)
            policy.shared_cols = gemv_launch.shared_cols = lambda *a: False
            try:
                own = Scratch()
                rows["per token"] = timer.per_call_ms([lambda i=i: in_pair(i, scratch=own)
                                                       for i in range(len(xs))]) * 1e3
                per_token = in_pair(0, scratch=own)
            finally:
                policy.shared_cols = gemv_launch.shared_cols = real_cols
            policy.beside_pair = lambda *a: True
            try:
                own = Scratch()
                rows["side"] = timer.per_call_ms([lambda i=i: beside(i, scratch=own) for i in range(len(xs))]) * 1e3
            finally:
                policy.beside_pair = real_beside
            same = "=" if torch.equal(cols, per_token) else \
                f"{float((cols.double() - per_token.double()).norm() / per_token.double().norm()):.1e}"
            shared_us = {k: rows[k] - rows["routed"] for k in ("in pair", "per token", "apart", "side")}
            print(f"{s.name:8s} T={T}  routed {rows['routed']:7.1f} us | + shared ({shared_mb:.0f} MB, alone "
                  f"{rows['alone']:5.1f} us): in pair {rows['in pair']:7.1f} (+{shared_us['in pair']:5.1f})  per "
                  f"token {rows['per token']:7.1f} (+{shared_us['per token']:5.1f}) {same}  apart "
                  f"{rows['apart']:7.1f} (+{shared_us['apart']:5.1f})  side {rows['side']:7.1f} "
                  f"(+{shared_us['side']:5.1f})", flush=True)


if __name__ == "__main__":
    main()
