"""Question: Which decode GEMV variant is fastest at V4's shapes?

A/B timings of decode GEMV variants and (optionally) one Nsight Compute profile per variant.

    python bench/lab/profile_gemv.py                      # timings (CUDA graph of rotated weights, median)
    DSV4_BENCH_LAYOUT=row-major python bench/lab/profile_gemv.py   # weights row-major instead of tiled
    ncu --clock-control none -k regex:_gemv_kernel -c 3 python bench/lab/profile_gemv.py --once
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository: dsv4
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # bench: common
sys.path.insert(0, str(Path(__file__).resolve().parent))       # bench/lab: sass, timeline

from common import FLASH, PRO, Timer, nbytes, rotated_qweights  # noqa: E402

from dsv4.kernels import dispatch  # noqa: E402
from dsv4.kernels.host import Scratch  # noqa: E402
from dsv4.kernels.policy import GemvConfig  # noqa: E402

VARIANTS = {  # split 0: chosen at launch from the compiled kernel's occupancy
    "default": GemvConfig(),
    "w2 bn64 noregcap": GemvConfig(maxnreg=0),
    "w2 bn64 st1": GemvConfig(num_stages=1),
    "w2 bn64 st3": GemvConfig(num_stages=3),
    "no prefetch": GemvConfig(prefetch=0),
    "prefetch fp4 too": GemvConfig(prefetch=3),
    "split 2": GemvConfig(split=2),
    "split 4": GemvConfig(split=4),
    "split 8": GemvConfig(split=8),
    "split 16": GemvConfig(split=16),
    "cap 96": GemvConfig(maxnreg=96),
    "st4": GemvConfig(num_stages=4),
    "st3 split 2": GemvConfig(num_stages=3, split=2),
    "st4 split 1": GemvConfig(num_stages=4, split=1),
    "st4 split 2": GemvConfig(num_stages=4, split=2),
    "no pdl": GemvConfig(pdl=False),
    "pdl l2 0": GemvConfig(pdl_l2=0),
    "pdl l2 1": GemvConfig(pdl_l2=1),
    "pdl l2 4": GemvConfig(pdl_l2=4),
    "pdl l2 8": GemvConfig(pdl_l2=8),
    "gcol": GemvConfig(group_cols=True),
    "st3 gcol": GemvConfig(num_stages=3, group_cols=True),
    "st3 gcol cap 96": GemvConfig(num_stages=3, group_cols=True, maxnreg=96),
    "gcol no pdl": GemvConfig(group_cols=True, pdl=False),
    "bn32": GemvConfig(BN=32),
    "bn32 st3": GemvConfig(BN=32, num_stages=3),
    # 128 rows on 2 warps: each x sub-tile (staged through shared memory) serves twice the weight rows
    "bn128": GemvConfig(BN=128, maxnreg=0),
    "bn128 cap 168": GemvConfig(BN=128, maxnreg=168),
    "bn128 st3": GemvConfig(BN=128, maxnreg=0, num_stages=3),
    "bn128 st4": GemvConfig(BN=128, maxnreg=0, num_stages=4),
    "bn128 st3 split 1": GemvConfig(BN=128, maxnreg=0, num_stages=3, split=1),
    "bn128 st3 split 2": GemvConfig(BN=128, maxnreg=0, num_stages=3, split=2),
    "bn128 st3 split 4": GemvConfig(BN=128, maxnreg=0, num_stages=3, split=4),
}
SHAPES = [(PRO, "wq_b", "nvfp4"), (PRO, "wo_b", "nvfp4"), (PRO, "wo_b", "fp8"), (FLASH, "expert w1/w3", "nvfp4"),
          (PRO, "wq_b", "fp8"), (FLASH, "wo_b", "nvfp4"), (FLASH, "wq_b", "nvfp4"), (FLASH, "wq_b", "fp8"),
          (FLASH, "indexer wq_b", "nvfp4"), (FLASH, "indexer wq_b", "fp8"), (PRO, "wq_b", "mxfp4"),
          (PRO, "wo_b", "mxfp4")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--once", action="store_true", help="one call per variant (for ncu), no timing")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--shapes", default=None, help="indices into SHAPES, comma-separated (default: all; "
                                                   "--once: the first)")
    ap.add_argument("--m", type=int, default=1, help="rows of x (at most policy.MAX_ROWS)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    timer, scratch = Timer(dev), Scratch()
    copy = 4270.0
    shapes = [SHAPES[int(i)] for i in args.shapes.split(",")] if args.shapes else SHAPES[:1] if args.once else SHAPES
    for sh, name, fmt in shapes:
        n, k = sh.linears()[name]
        ws = rotated_qweights(fmt, n, k, dev, gen)
        w0, rot = ws[0], len(ws)
        xs = [torch.randn(args.m, k, device=dev, generator=gen).bfloat16() for _ in range(rot)]
        ref = torch.nn.functional.linear(xs[0].float(), w0.dequantize(torch.float32))
        y_default = dispatch.linear(xs[0], w0, config=VARIANTS["default"], fallback=None, scratch=scratch)
        for vname in args.variants.split(","):
            cfg = VARIANTS[vname]
            try:
                y = dispatch.linear(xs[0], w0, config=cfg, fallback=None, scratch=scratch)
                err = float((y.float() - ref).norm() / ref.norm())
                same = "=" if torch.equal(y, y_default) else "DIFFERS from default"
                if args.once:
                    torch.cuda.synchronize()
                    print(f"{vname}: err {err:.1e}", flush=True)
                    continue
                ms = timer.per_call_ms([lambda x=x, w=w: dispatch.linear(x, w, config=cfg, scratch=scratch)
                                        for x, w in zip(xs, ws)])
                gbps = nbytes(w0) / (ms * 1e-3) / 1e9
                print(f"{sh.name:8s} {name:13s} {fmt:5s} M={args.m:<2d} {vname:18s}: {ms * 1e3:7.1f} us "
                      f"{gbps:6.0f} GB/s ({100 * gbps / copy:3.0f}%) err {err:.1e} {same}", flush=True)
            except Exception as e:  # report and go on: one variant must not cost the call
                print(f"{vname}: FAILED {e!r}"[:300], flush=True)
        del ws


if __name__ == "__main__":
    main()
