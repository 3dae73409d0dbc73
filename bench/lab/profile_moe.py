"""Question: What does each of the MoE decode layer's two GEMV launches take, per K split, stages and tile width?

The MoE decode layer's two GEMV launches timed one by one, with the K split chosen at launch or forced.

    python bench/lab/profile_moe.py [--tokens 1,8] [--splits 0,2,3,4,6,8] [--stages 2,3] [--bns 64,128] [--maxnregs -1,0]
                                [--pdl] [--pdl-down] [--bn 128]
                                [--no-gcol] [--route] [--route-warps 1,4] [--fused]
    TRITON_INTERPRET=1 python bench/lab/profile_moe.py --toy      # CPU dry run on a toy shape
    ncu --clock-control none -k regex:_gemv_kernel -c 4 --section SourceCounters python bench/lab/profile_moe.py --once

For each model (routed NVFP4 experts, FP8 shared expert, as NVIDIA's NVFP4 builds store them: `dsv4 convert
--format nvfp4-experts`) and
token count: gate/up (ROWS_PAIR, SwiGLU epilogue, the shared expert's pair included) and down (ROWS_TOKEN,
routing weights and the top-k sum fused) against the bytes each reads, and both launches back to back with the
plain `GemvConfig` (`dispatch.moe` departs from it where `policy.pair_configs` says: 3-stage gate/up, 128-row
down). Split 0 is the launch's own choice (`policy.choose_split`); other splits are forced (per slot for down).
--pdl: the pair once more with programmatic dependent launch (`GemvConfig.pdl`); --pdl-down: on the down launch only;
--bn 128: once more with 128-row units (`GemvConfig.BN`, no register cap); --no-gcol: once more without
`GemvConfig.group_cols` (a multiply per FP4 weight pair instead). Each variant's output is compared with the plain
pair's: `=` when bit-identical (PDL must be), else its relative difference (group columns sum in another order).
--route: the routing kernel alone, then routing + pair, plain and as `moe(after_route=True)` runs it (the
gate/up launch streams the shared expert while the routing kernel runs: `gemv_launch.launch(x_ready=True)`); with
--route-warps, the routing kernel alone and overlapped once per warp count.
--once: gate/up and down once each, untimed, for a profiler (`bench/lab/ncu_regions.py` reads ncu's source page).
--fused: the pair once more in one launch (`moe_pair.launch_pair(fused=True)`, also where `moe` takes two); with
--route also after the routing kernel.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository: dsv4
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # bench: common
sys.path.insert(0, str(Path(__file__).resolve().parent))       # bench/lab: sass, timeline

from common import (FLASH, PRO, TOY, bench_start, moe_decode_inputs, nbytes,  # noqa: E402
                    random_qweight)

from dsv4.kernels import gemv_launch, moe, moe_pair, policy  # noqa: E402
from dsv4.kernels.host import Scratch  # noqa: E402
from dsv4.kernels.policy import GemvConfig  # noqa: E402


def config(split: int, pdl: bool, gcol: bool, stages: int, bn: int, reg: int | None) -> GemvConfig:
    """A launch's GemvConfig; `reg` None: the register cap `kernels.moe` uses with units of `bn` rows (128 per
    thread for 64 rows, none for 128)."""
    return GemvConfig(split=split, pdl=pdl, group_cols=gcol, num_stages=stages, BN=bn,
                      maxnreg=(-1 if bn == 64 else 0) if reg is None else reg)


def ints(text: str) -> list[int]:
    """A comma-separated option as integers ("" -> [])."""
    return [int(v) for v in text.split(",") if v]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--splits", default="0,2,3,4,6,8")
    ap.add_argument("--pdl", action="store_true", help="also time the pair with GemvConfig(pdl=True)")
    ap.add_argument("--no-gcol", action="store_true", help="also time the pair with GemvConfig(group_cols=False)")
    ap.add_argument("--pdl-down", action="store_true", help="also time the pair with PDL on the down launch only")
    ap.add_argument("--bn", default="", help="also time the pair with these GemvConfig.BN (no register cap), e.g. 128")
    ap.add_argument("--route", action="store_true", help="also time the routing kernel and routing + pair")
    ap.add_argument("--route-warps", default=str(policy.ROUTE_WARPS),
                    help="with --route: the routing kernel's warps (moe.route(warps=)) to time, e.g. 1,4,8")
    ap.add_argument("--fused", action="store_true", help="also time the pair in one launch (moe_pair.launch_pair)")
    ap.add_argument("--stages", default="2", help="pipeline stages of the per-launch timings (GemvConfig.num_stages)")
    ap.add_argument("--bns", default="64", help="GemvConfig.BN of the per-launch timings (128: no register cap)")
    ap.add_argument("--maxnregs", default="", help="GemvConfig.maxnreg of the per-launch timings instead of BN's "
                    "default (-1: 128 per thread; 0: no cap; n: n), e.g. -1,0,168")
    ap.add_argument("--once", action="store_true", help="gate/up and down once each (for ncu), no timing")
    ap.add_argument("--toy", action="store_true", help="a toy shape on the CPU (with TRITON_INTERPRET=1)")
    args = ap.parse_args()
    # the per-launch timings' grid (BN, register cap, stages, split) and the variants' options, parsed once
    grid = list(itertools.product(ints(args.bns), ints(args.maxnregs) or [None], ints(args.stages),
                                  ints(args.splits)))
    route_warps = ints(args.route_warps)
    dev, gen, timer, copy = bench_start(args.toy)
    scratch = Scratch()
    for s in ((TOY,) if args.toy else (FLASH, PRO)):
        w13 = random_qweight("nvfp4", (s.E, 2), s.I, s.D, dev, gen)
        w2 = random_qweight("nvfp4", (s.E,), s.D, s.I, dev, gen)
        sw13 = random_qweight("fp8", (2,), s.I, s.D, dev, gen)
        sw2 = random_qweight("fp8", (), s.D, s.I, dev, gen)
        for T in ints(args.tokens):
            rot, P = (2 if args.toy else 8), T * s.k
            xs, ids, rws, hs, outs, touched = moe_decode_inputs(s, T, rot, dev, gen)
            up_bytes = touched * nbytes(w13) / s.E + nbytes(sw13)
            down_bytes = touched * nbytes(w2) / s.E + nbytes(sw2)

            # picked / weights: a routing of rotation i other than moe_decode_inputs' (--route)
            def up(i, split, pdl=False, gcol=True, stages=2, x_ready=False, picked=None, bn=64, reg=None):
                gemv_launch.launch(xs[i], w13, hs[i], config(split, pdl, gcol, stages, bn, reg), M=P + T,
                                   rows=policy.ROWS_PAIR, R=P + T, gated=True, x_div=s.k,
                                   ids=ids[i] if picked is None else picked, limit=10.0, shared=sw13, pairs=P,
                                   scratch=scratch, x_ready=x_ready)

            def down(i, split, pdl=False, gcol=True, stages=2, picked=None, weights=None, bn=64, reg=None):
                gemv_launch.launch(hs[i], w2, outs[i], config(split, pdl, gcol, stages, bn, reg), M=T,
                                   rows=policy.ROWS_TOKEN, R=T, topk=s.k, ids=ids[i] if picked is None else picked,
                                   rw=rws[i] if weights is None else weights, shared=sw2, pairs=P, scratch=scratch)

            def fused(i, pdl=False, x_ready=False, picked=None, weights=None):
                cfg = GemvConfig(pdl=pdl)
                moe_pair.launch_pair(xs[i], w13, hs[i], w2, outs[i], cfg, cfg, tokens=T, topk=s.k,
                                     ids=ids[i] if picked is None else picked,
                                     rw=rws[i] if weights is None else weights, limit=10.0, shared=(sw13, sw2),
                                     scratch=scratch, x_ready=x_ready, fused=True)

            if args.once:
                up(0, 0), down(0, 0)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                continue
            for name, fn, nb in (("gate/up", up, up_bytes), ("down", down, down_bytes)):
                for bn, reg, stages, split in grid:
                    ms = timer.per_call_ms([lambda i=i: fn(i, split, stages=stages, bn=bn, reg=reg)
                                            for i in range(rot)])
                    pct = 100 * nb / (ms * 1e-3) / 1e9 / copy
                    cap = "" if reg is None else f" reg {reg:3d}"
                    print(f"{s.name:8s} T={T:<3d} {name:8s} BN {bn:3d}{cap} {stages} st. split {split or 'auto':>4}: "
                          f"{ms * 1e3:7.1f} us {nb / 1e6:6.1f} MB {pct:4.0f}% of copy", flush=True)
            variants = [("both launches", {})] + [("both, PDL", dict(pdl=True))] * args.pdl \
                + [("both, no gcol", dict(gcol=False))] * args.no_gcol \
                + [("down with PDL", dict(pdl_down=True))] * args.pdl_down \
                + [(f"both, BN {bn}", dict(bn=bn)) for bn in ints(args.bn)]
            variants += [("one launch", dict(one_launch=True))] * args.fused
            for label, kw in variants:
                versus = ""   # a variant's output against the plain pair's
                def two(i, pdl_down=False, **kw):   # gate/up, then down (--pdl-down: PDL on down only)
                    up(i, 0, **kw)
                    down(i, 0, **{**kw, "pdl": kw.get("pdl", False) or pdl_down})

                run = (lambda i, one_launch, **kw: fused(i, **kw)) if "one_launch" in kw else two
                if kw:
                    up(0, 0), down(0, 0)
                    plain = outs[0].clone()
                    run(0, **kw)
                    diff = float((outs[0].float() - plain.float()).norm() / plain.float().norm())
                    versus = " =" if torch.equal(outs[0], plain) else f" DIFFERS (rel. diff {diff:.1e})"
                ms = timer.per_call_ms([lambda i=i: run(i, **kw) for i in range(rot)])
                pct = 100 * (up_bytes + down_bytes) / (ms * 1e-3) / 1e9 / copy
                print(f"{s.name:8s} T={T:<3d} {label:18s}: {ms * 1e3:7.1f} us {pct:4.0f}% of copy{versus}", flush=True)
            if args.route:
                logits = [torch.randn(T, s.E, device=dev, generator=gen) for _ in range(rot)]
                bias = torch.zeros(s.E, device=dev)

                def routed(i, ready, one_launch=False, warps=policy.ROUTE_WARPS):   # the routing kernel's ids, not
                    rw, picked = moe.route(logits[i], bias, s.k, 1.5, warps=warps)    # moe_decode_inputs' (same count)
                    if one_launch:
                        fused(i, pdl=ready, x_ready=ready, picked=picked, weights=rw.reshape(-1))
                        return
                    up(i, 0, pdl=ready, x_ready=ready, picked=picked)
                    down(i, 0, picked=picked, weights=rw.reshape(-1))

                for wp in route_warps:
                    ms = timer.per_call_ms([lambda i=i: moe.route(logits[i], bias, s.k, 1.5, warps=wp)
                                            for i in range(rot)])
                    print(f"{s.name:8s} T={T:<3d} {f'routing alone, {wp} warps':18s}: {ms * 1e3:7.1f} us", flush=True)
                routed(0, False)
                plain = outs[0].clone()
                routed(0, True)
                same = " =" if torch.equal(outs[0], plain) else " DIFFERS"
                cases = [("routing + pair", False, False), ("overlapped", True, False)] \
                    + [("overlapped, 1 launch", True, True)] * args.fused
                for label, ready, one in cases:
                    if one:
                        routed(0, True, True)
                        same = " =" if torch.equal(outs[0], plain) else " DIFFERS"
                    ms = timer.per_call_ms([lambda i=i: routed(i, ready, one) for i in range(rot)])
                    print(f"{s.name:8s} T={T:<3d} {label:18s}: {ms * 1e3:7.1f} us{same if ready else ''}",
                          flush=True)
                for wp in (w for w in route_warps if w != policy.ROUTE_WARPS):
                    ms = timer.per_call_ms([lambda i=i: routed(i, True, warps=wp) for i in range(rot)])
                    print(f"{s.name:8s} T={T:<3d} {f'overlapped, routing on {wp} warps':18s}: {ms * 1e3:7.1f} us",
                          flush=True)
        del w13, w2, sw13, sw2


if __name__ == "__main__":
    main()
