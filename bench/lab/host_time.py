"""Question: What does one `Ops.linear` / `Ops.moe` call cost on the host, planning and argument gathering included?

Microseconds per call of the Triton table's `linear` (one weight [4096, 4096], M = 1 .. 4096) and `moe` (V4-Flash's
256 experts, top 6, D 4096, I 2048, an FP8 shared expert, after routing) for NVFP4 / MXFP4 / FP8 weights.

    TRITON_INTERPRET=1 python bench/lab/host_time.py [--out host.json]     # CPU: every launch a no-op
    python bench/lab/host_time.py --device cuda [--out host.json]          # GPU: real launches, no synchronization

On the CPU Triton's interpreter is patched so that a launch does nothing: what is timed is the host path up to the
launch (dispatch, plan and geometry lookups, allocation, argument bundles). On a GPU the launches run; the calls are
timed back to back without synchronizing, so a call's time is its host cost including Triton's launcher, as long as
the GPU keeps up. Weights are zeros (stride-0 expanded across experts: no memory); best of 5 repeats of n calls.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository: dsv4

from dsv4.formats import QWeight  # noqa: E402
from dsv4.kernels import Ops  # noqa: E402


def weight(fmt: str, N: int, K: int, lead: tuple, expand: tuple, device) -> QWeight:
    """A zero weight [*expand, *lead, N, K] (expand: stride-0 leading dims)."""
    z = lambda *shape, dtype: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
    if fmt == "nvfp4":
        t = dict(weight=z(*lead, N, K // 2, dtype=torch.uint8), scale=z(*lead, N, K // 16, dtype=torch.float8_e4m3fn),
                 scale_2=torch.ones(lead, device=device))
    elif fmt == "mxfp4":
        t = dict(weight=z(*lead, N, K // 2, dtype=torch.uint8), scale=z(*lead, N, K // 32, dtype=torch.float8_e8m0fnu))
    else:
        t = dict(weight=z(*lead, N, K, dtype=torch.float8_e4m3fn),
                 scale=z(*lead, -(-N // 128), -(-K // 128), dtype=torch.float8_e8m0fnu))
    if expand:
        t = {k: v.unsqueeze(0).expand(*expand, *v.shape) for k, v in t.items()}
    return QWeight(fmt, **t)


def per_call_us(fn, n: int) -> float:
    for _ in range(20):
        fn()
    best = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best.append((time.perf_counter() - t0) / n * 1e6)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return min(best)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", help="write the figures here (JSON)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("on the CPU, run with TRITON_INTERPRET=1")
        from triton.runtime.interpreter import InterpretedFunction
        InterpretedFunction.__getitem__ = lambda self, grid: (lambda *a, **k: None)   # every launch a no-op
    ops, out = Ops.triton(), {}
    for fmt in ("nvfp4", "mxfp4", "fp8"):
        w = weight(fmt, 4096, 4096, (), (), dev)
        for M in (1, 4, 8, 16, 32, 64, 256, 4096):
            x = torch.zeros(M, 4096, dtype=torch.bfloat16, device=dev)
            out[f"linear {fmt} M={M}"] = us = per_call_us(lambda: ops.linear(x, w), 200 if M < 4096 else 20)
            print(f"linear {fmt:5s} M={M:<5d} {us:7.1f} us", flush=True)
    E, D, I, k = 256, 4096, 2048, 6
    shared = weight("fp8", I, D, (2,), (), dev), weight("fp8", D, I, (), (), dev)
    for fmt in ("nvfp4", "mxfp4"):
        w13, w2 = weight(fmt, I, D, (2,), (E,), dev), weight(fmt, D, I, (), (E,), dev)
        for T in (1, 2, 4, 8, 16, 64, 512):
            x = torch.zeros(T, D, dtype=torch.bfloat16, device=dev)
            ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).to(dev)
            wts = torch.rand(T, k, device=dev)
            out[f"moe {fmt} T={T}"] = us = per_call_us(
                lambda: ops.moe(x, ids, wts, w13, w2, 10.0, shared=shared, after_route=True), 100 if T < 512 else 20)
            print(f"moe    {fmt:5s} T={T:<5d} {us:7.1f} us", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
