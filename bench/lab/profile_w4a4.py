"""Question: What does the W4A4 emulation (Blackwell's numerics on Hopper) cost beside the default W4A16 path?

The W4A4 emulation path (`kernels.w4a4`: `stage_activation`, then the fused tiles over FP4 x and FP4 weights with
alpha in the epilogue) beside the W4A16 path the model runs by default (`dispatch.linear`: the GEMV, the fused tiles or
dequantize + cuBLAS) and cuBLAS bf16, on NVFP4 weights of V4 shapes.

    python bench/lab/profile_w4a4.py [--ms 1,16,64,256,4096] [--cases V4-Pro:wq_b,...] [--json out.json]
    TRITON_INTERPRET=1 python bench/lab/profile_w4a4.py --toy      # CPU dry run at a toy shape

W4A4 reproduces Blackwell's numerics on Hopper, which has no FP4 tensor cores: its GEMM decodes both operands in
registers, so it is not expected to be fast; this measures what the emulation costs. Rotated weights and
activations in one CUDA graph per row (`common.Timer`); `stage` is `stage_activation` alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository: dsv4
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # bench: common
sys.path.insert(0, str(Path(__file__).resolve().parent))       # bench/lab: sass, timeline

from common import FLASH, PRO, TOY, Timer, rel_err, rotated_qweights  # noqa: E402

from dsv4.kernels import dispatch, ref, refuse_fallback, w4a4  # noqa: E402
from dsv4.kernels.host import Scratch  # noqa: E402

CASES = "V4-Flash:wq_b,V4-Flash:expert w1/w3,V4-Pro:wq_b,V4-Pro:wo_b"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,16,64,256,4096", help="rows of x")
    ap.add_argument("--cases", default=CASES, help="MODEL:LINEAR,... (common.Shapes names; NVFP4 weights)")
    ap.add_argument("--toy", action="store_true", help="a toy shape on the CPU (with TRITON_INTERPRET=1)")
    ap.add_argument("--json", default="", help="write the rows to this file")
    args = ap.parse_args()
    dev = torch.device("cpu" if args.toy else "cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    dtype = torch.float32 if args.toy else torch.bfloat16   # the interpreter's dot takes fp32 operands
    timer, scratch = Timer(dev), Scratch()
    models = {s.name: s for s in (FLASH, PRO, TOY)}
    cases = [("toy", "expert w1/w3")] if args.toy else [c.split(":") for c in args.cases.split(",")]
    ms = [3] if args.toy else [int(m) for m in args.ms.split(",")]
    rows = []
    print(f"{'model':8s} {'linear':13s} {'M':>5s} {'stage us':>9s} {'W4A4 us':>9s} {'TF/s':>6s} {'W4A16 us':>9s} "
          f"{'cuBLAS us':>9s} {'W4A4 / W4A16':>12s} {'rel err':>8s}", flush=True)
    for model, name in cases:
        s = models[model]
        n, k = s.linears()[name]
        ws = rotated_qweights("nvfp4", n, k, dev, gen, 2 if args.toy else None)
        w0, rot = ws[0], len(ws)
        dense = [torch.randn(n, k, device=dev, generator=gen).to(dtype) for _ in range(rot)]
        for m in ms:
            xs = [torch.randn(m, k, device=dev, generator=gen).to(dtype) for _ in range(rot)]
            err = rel_err(w4a4.linear_w4a4(xs[0], w0, fallback=refuse_fallback, scratch=scratch).float(),
                          ref.linear_w4a4(xs[0].float(), w0).float())
            stage_us = timer.rotated_us(w4a4.stage_activation, xs, [w.input_scale for w in ws])
            w4a4_us = timer.rotated_us(partial(w4a4.linear_w4a4, fallback=refuse_fallback, scratch=scratch), xs, ws)
            w4a16_us = timer.rotated_us(partial(dispatch.linear, fallback=refuse_fallback, scratch=scratch), xs, ws)
            bf16_us = timer.rotated_us(torch.nn.functional.linear, xs, dense)
            tflops = 2 * m * n * k / (w4a4_us * 1e-6) / 1e12
            rows.append(dict(model=model, linear=name, M=m, N=n, K=k, stage_us=stage_us, w4a4_us=w4a4_us,
                             w4a16_us=w4a16_us, cublas_us=bf16_us, tflops=tflops, rel_err=err))
            print(f"{model:8s} {name:13s} {m:5d} {stage_us:9.1f} {w4a4_us:9.1f} {tflops:6.1f} {w4a16_us:9.1f} "
                  f"{bf16_us:9.1f} {w4a4_us / w4a16_us:12.2f} {err:8.1e}", flush=True)
        del ws, dense
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
