"""Question: Does the router's logits product on the tensor cores (`kernels.moe._router_gemm`: exact bf16 pieces of
the fp32 weight, fp32 sums) beat the fp32 GEMM it replaces above ROUTER_TOKENS tokens, and how close is it?

Times `moe.router_logits` (the kernel) against `ref.router_logits` (x widened to fp32, cuBLAS's fp32 GEMM) at
V4-Flash's router (4096 -> 256 experts, an fp32 weight) for each token count, in CUDA graphs over rotated inputs,
and prints both products' relative error (`common.rel_err`) against the float64 product.

    python bench/lab/router.py [--tokens 17,64,256] [--out DIR]     # on the GPU
    python bench/lab/router.py --toy                                # CPU dry run (interpreter)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository: dsv4
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # bench: common

from common import Timer, lab_parser, median_us, rel_err, write_record  # noqa: E402

from dsv4.kernels import moe, ref  # noqa: E402


def main():
    ap = lab_parser("CPU dry run at a small shape (checks the script)")
    ap.add_argument("--tokens", default="17,64,256")
    args = ap.parse_args()
    K, E = 4096, 256
    if args.toy:
        args.device, args.tokens, args.rounds, K, E = "cpu", "20", 1, 512, 64
    dev = torch.device(args.device)
    gen = torch.Generator(device=dev).manual_seed(0)
    timer, label = Timer(dev), "toy" if args.toy else dev.type
    rows = []
    for T in map(int, args.tokens.split(",")):
        xs = [torch.randn(T, K, device=dev, generator=gen).to(torch.bfloat16) for _ in range(4)]
        ws = [torch.randn(E, K, device=dev, generator=gen) * K ** -0.5 for _ in range(4)]
        exact = torch.nn.functional.linear(xs[0].double(), ws[0].double())
        row = dict(tokens=T)
        for name, fn in (("tensor cores", moe.router_logits), ("fp32 GEMM", ref.router_logits)):
            row[name] = dict(us=median_us(timer, [lambda x=x, w=w: fn(x, w) for x, w in zip(xs, ws)], args.rounds),
                             rel_to_fp64=rel_err(fn(xs[0], ws[0]), exact))
        print(f"{label:5s} tokens {T:4d} | " + " | ".join(f"{n}: {r['us']:7.1f} us, rel {r['rel_to_fp64']:.1e}"
                                                          for n, r in row.items() if n != "tokens"), flush=True)
        rows.append(row)
    write_record(args.out, "router.json", dict(device=str(dev), K=K, E=E, rows=rows))


if __name__ == "__main__":
    main()
