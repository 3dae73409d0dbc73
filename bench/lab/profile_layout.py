"""Question: Does the order of the weight bytes in memory decide the decode GEMV's speed?

The GEMV reads every sub-step as 64 bytes of each of a tile's BN rows: with row-major weights that is BN
runs of 64 bytes, one row length apart; stored tile by tile (`TILED`) it is one contiguous BN * 64-byte run.

    python bench/lab/profile_layout.py [--shapes 0,1] [--out DIR]

1. A read-only kernel streams the weight bytes in both orders with the GEMV's access pattern (no decode).
2. The GEMV itself on the same weights, row-major and tiled: outputs must agree bit for bit, then timings.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository: dsv4
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # bench: common
sys.path.insert(0, str(Path(__file__).resolve().parent))       # bench/lab: sass, timeline

from common import FLASH, PRO, Timer, copy_bandwidth, nbytes, random_qweight, rotations  # noqa: E402

from dsv4.kernels import gemv_launch  # noqa: E402
from dsv4.kernels.host import Scratch  # noqa: E402
from dsv4.kernels.policy import GemvConfig  # noqa: E402
from dsv4.kernels.tiles import byte_offsets  # noqa: E402

SHAPES = [(PRO, "wq_b", "nvfp4"), (PRO, "wo_b", "nvfp4"), (FLASH, "expert w1/w3", "nvfp4"), (PRO, "wo_b", "fp8"),
          (PRO, "wq_b", "fp8"), (FLASH, "wo_b", "nvfp4")]


@triton.jit
def _read_kernel(w_ptr, out_ptr, N, stride_n, CHUNK, n_steps, BN: tl.constexpr, TILED: tl.constexpr,
                 STAGES: tl.constexpr):
    """XOR of every word a GEMV unit would read (so the loads cannot be dropped); one unit per program."""
    splits = tl.cdiv(n_steps, CHUNK)
    u = tl.program_id(0)
    tile, ks = u // splits, u % splits
    rows = tile * BN + tl.arange(0, BN)
    zero = tl.full((), 0, tl.int32)   # a 0-d tensor, not 0: the interpreter has no int % constexpr
    off = byte_offsets(rows, zero, stride_n, 64, TILED)   # the kernels' own addressing
    sb = byte_offsets(zero, zero + 64, stride_n, 64, TILED)
    acc = tl.zeros((BN, 16), dtype=tl.uint32)
    for step in tl.range(ks * CHUNK, tl.minimum(ks * CHUNK + CHUNK, n_steps), num_stages=STAGES):
        acc ^= tl.load((w_ptr + off[:, None] + step * sb).to(tl.pointer_type(tl.uint32)) + tl.arange(0, 16)[None, :])
    tl.store(out_ptr + u * BN + tl.arange(0, BN), tl.xor_sum(acc, axis=1))


def read_bench(timer, bufs, stride_n, n, tiled, stages, chunk):
    n_steps = stride_n // 64
    units = (n // 64) * triton.cdiv(n_steps, chunk)
    out = torch.empty(units * 64, dtype=torch.int32, device=bufs[0].device)
    calls = [lambda b=b: _read_kernel[(units,)](b, out, n, stride_n, chunk, n_steps, BN=64, TILED=tiled,
                                                 STAGES=stages, num_warps=2) for b in bufs]
    return timer.per_call_ms(calls)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--variants", default="default,st3,no prefetch")
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    timer, scratch = Timer(dev), Scratch()
    copy = copy_bandwidth(dev)
    print(f"copy bandwidth {copy:.0f} GB/s", flush=True)
    rows = []
    variants = {"default": GemvConfig(), "st3": GemvConfig(num_stages=3),
                "no prefetch": GemvConfig(prefetch=0), "prefetch fp4": GemvConfig(prefetch=3),
                "st1": GemvConfig(num_stages=1), "st1 prefetch fp4": GemvConfig(num_stages=1, prefetch=3)}
    shapes = [SHAPES[int(i)] for i in args.shapes.split(",")] if args.shapes else SHAPES
    for sh, name, fmt in shapes:
        n, k = sh.linears()[name]
        w0 = random_qweight(fmt, (), n, k, dev, gen).untiled()   # row-major, whatever the bench default
        rot = rotations(nbytes(w0))
        ws = [w0] + [random_qweight(fmt, (), n, k, dev, gen).untiled() for _ in range(rot - 1)]
        wts = [w.tile() for w in ws]
        xs = [torch.randn(1, k, device=dev, generator=gen).bfloat16() for _ in range(rot)]
        mb = nbytes(w0) / 1e6
        # 1. read-only, weight bytes only, the GEMV's pattern; chunk so that there are >= 8 units per SM
        wb = ws[0].weight.view(torch.uint8)
        stride_n = wb.stride(0)
        chunk = max(2, (stride_n // 64) // max(1, (132 * 8) // max(1, n // 64)))
        for stages in (2, 3, 4):
            for tiled in (False, True):
                bufs = [(w.weight if not tiled else wt.weight).view(torch.uint8) for w, wt in zip(ws, wts)]
                ms = read_bench(timer, bufs, stride_n, n, tiled, stages, chunk)
                gbps = wb.numel() / (ms * 1e-3) / 1e9
                line = dict(kind="read", shape=f"{sh.name} {name} {fmt}", stages=stages, tiled=tiled,
                            us=ms * 1e3, pct=100 * gbps / copy, chunk=chunk)
                rows.append(line)
                print(f"read  {sh.name:8s} {name:13s} {fmt:5s} ({wb.numel() / 1e6:5.1f} MB) stages {stages} "
                      f"{'tiled    ' if tiled else 'row-major'}: {ms * 1e3:7.1f} us {gbps:6.0f} GB/s "
                      f"({100 * gbps / copy:3.0f}%)", flush=True)
        # 2. the GEMV
        for vname in args.variants.split(","):
            cfg = variants[vname]
            for tiled in (False, True):
                try:
                    y0 = torch.empty(1, n, dtype=torch.bfloat16, device=dev)
                    y1 = torch.empty_like(y0)
                    gemv_launch.launch(xs[0], ws[0], y0, cfg, M=1, scratch=scratch)
                    gemv_launch.launch(xs[0], wts[0], y1, cfg, M=1, scratch=scratch)
                    same = bool(torch.equal(y0, y1)) if tiled else True
                    pairs = list(zip(xs, wts if tiled else ws))
                    y = torch.empty(1, n, dtype=torch.bfloat16, device=dev)
                    ms = timer.per_call_ms([lambda x=x, w=w: gemv_launch.launch(x, w, y, cfg, M=1, scratch=scratch)
                                            for x, w in pairs])
                    gbps = nbytes(w0) / (ms * 1e-3) / 1e9
                    rows.append(dict(kind="gemv", shape=f"{sh.name} {name} {fmt}", variant=vname, tiled=tiled,
                                     us=ms * 1e3, pct=100 * gbps / copy, bit_equal=same))
                    print(f"gemv  {sh.name:8s} {name:13s} {fmt:5s} ({mb:5.1f} MB) {vname:16s} "
                          f"{'tiled    ' if tiled else 'row-major'}: {ms * 1e3:7.1f} us {gbps:6.0f} GB/s "
                          f"({100 * gbps / copy:3.0f}%) bit-equal {same}", flush=True)
                except Exception as e:
                    print(f"gemv {name} {fmt} {vname} tiled={tiled}: FAILED {e!r}"[:400], flush=True)
        del ws, wts
    if args.out:
        Path(args.out, "layout.json").write_text(json.dumps(dict(copy=copy, rows=rows), indent=1))


if __name__ == "__main__":
    main()
