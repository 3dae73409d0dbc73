"""Question: What makes mHC's mixing launch slow at many tokens, and which launch geometry fixes it?

At many tokens `_post_mix_kernel` runs far above the time its traffic takes at copy speed (bench/results/round-36.md,
docs/tuning.md#mhc-mixing). This times `kernels.mhc`'s `hc_post_pre` (the post-update fused into the next collapse:
`_post_mix_kernel` then `_finish_kernel`) at V4-Flash's shape for each variant of the mixing launch's plan (`HcPlan`:
tokens a program, tl.dot precision, warps, columns a program), and checks every variant's outputs against the default
plan's (the same kernels: the difference is the product's rounding) and the default's against `ref.hc_post_pre` (the
oracle).

    python bench/lab/mhc.py [--tokens 1,64,256] [--variants "default;bf16x3"] [--iters 20] [--out DIR]  # GPU
    python bench/lab/mhc.py --toy                              # CPU dry run (interpreter)

Prints one line per (tokens, variant): microseconds per call (CUDA graph of rotated inputs) and the relative error
(`common.rel_err`) of u, post, comb and the streams; writes mhc.json.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository: dsv4
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # bench: common

from common import Timer, lab_parser, median_us, record_failure, rel_err, write_record  # noqa: E402

from dsv4.kernels import mhc, ref  # noqa: E402

FLASH = dict(streams=4, hidden=4096, iters=20)
TOY = dict(streams=4, hidden=256, iters=3)
VARIANTS = {                        # name -> HcPlan fields replaced in the default plan
    "default": {},
    "FMA plan": "fmas",             # the plan of fp32 streams: bf16 streams' too before round 55
    "ieee, 32 tokens": dict(precision="ieee", block_tokens=32),     # that product on the default's chunks
    "bf16x3": dict(precision="bf16x3"),
    "bf16x3, 32 tokens": dict(precision="bf16x3", block_tokens=32),
    "bf16x3, 128 tok, 8 w": dict(precision="bf16x3", block_tokens=128, warps=8),
    "bf16x3, 64 tok, 8 w": dict(precision="bf16x3", block_tokens=64, warps=8),
    "tf32x3": dict(precision="tf32x3"),
    "8 warps": dict(warps=8),
    "16 tokens": dict(block_tokens=16),
    "64 tokens, 8 warps": dict(block_tokens=64, warps=8),
    "chunk / 2": "half",
    "chunk x 2": "double",
}


def variant_plan(plan: mhc.HcPlan, change) -> mhc.HcPlan | None:
    """The default plan with `change` ("fmas": the plan of fp32 streams, its own chunks); None where the variant does
    not exist (a chunk is at least MIX_BK and at most MIX_CHUNK columns)."""
    if change == "fmas":
        return mhc.plan_hc(plan.tokens, plan.streams, plan.hidden, plan.rows)
    if change == "half":            # twice the programs, each over half the columns
        if plan.chunk // 2 < mhc.MIX_BK:
            return None
        return dataclasses.replace(plan, chunk=plan.chunk // 2, chunks=plan.chunks * 2)
    if change == "double":          # half the programs, each over twice the columns
        if plan.chunk * 2 > mhc.MIX_CHUNK:
            return None
        return dataclasses.replace(plan, chunk=plan.chunk * 2, chunks=plan.chunks // 2)
    return dataclasses.replace(plan, **change)


def case(T: int, shape: dict, dev, gen):
    """Inputs of one hc_post_pre call at T tokens: streams, a block output, post / comb of the previous collapse,
    fn / base / scale of the next one and its norm weight (V4's mixing rows: R = (2 + n) n)."""
    n, d = shape["streams"], shape["hidden"]
    R = (2 + n) * n
    x = torch.randn(T, n, d, device=dev, generator=gen).to(torch.bfloat16)
    out = torch.randn(T, d, device=dev, generator=gen).to(torch.bfloat16)
    post = torch.rand(T, n, device=dev, generator=gen) * 2
    comb = torch.rand(T, n, n, device=dev, generator=gen)
    comb = comb / comb.sum(1, keepdim=True)
    fn = torch.randn(R, n * d, device=dev, generator=gen) * (n * d) ** -0.5
    base = torch.randn(R, device=dev, generator=gen) * 0.1
    scale = torch.rand(3, device=dev, generator=gen) + 0.5
    weight = torch.rand(d, device=dev, generator=gen) + 0.5
    return x, out, post, comb, fn, base, scale, weight


def run(args_of_case, iters: int, plan):
    x, out, post, comb, fn, base, scale, weight = args_of_case
    return mhc._collapse(x, fn, base, scale, iters, 1e-6, 1e-6, False, weight, 1e-6, update=(out, post, comb),
                         plan=plan)


def reference(args_of_case, iters: int):
    """`ref.hc_post_pre` of the case (on its device; the oracle) in `_collapse`'s output order."""
    x, out, post, comb, fn, base, scale, weight = args_of_case
    new, u, p, c = ref.hc_post_pre(out, x, post, comb, fn, base, scale, iters, 1e-6, 1e-6, weight, 1e-6)
    return u, p, c, new


def main():
    ap = lab_parser("CPU dry run at a small hidden size (checks the script)")
    ap.add_argument("--tokens", default="1,64,256")
    ap.add_argument("--variants", help="names of VARIANTS to time, separated by semicolons (default: all)")
    ap.add_argument("--iters", type=int, help="Sinkhorn iterations (default V4-Flash's 20; fewer time their share)")
    args = ap.parse_args()
    chosen = args.variants.split(";") if args.variants else list(VARIANTS)
    if unknown := [name for name in chosen if name not in VARIANTS]:
        ap.error(f"unknown variants {unknown}; the lab has {list(VARIANTS)}")
    shape = FLASH
    if args.toy:
        args.device, args.tokens, args.rounds, shape = "cpu", "1,17", 1, TOY
    dev = torch.device(args.device)
    gen = torch.Generator(device=dev).manual_seed(0)
    timer, label = Timer(dev), "toy" if args.toy else dev.type
    n, d, iters = shape["streams"], shape["hidden"], args.iters or shape["iters"]
    print(f"{label:5s} {'tokens':>6s} {'variant':20s} | {'us':>8s} {'vs default':>10s} | u / post / comb / streams "
          f"rel. to default")
    rows = []
    for T in map(int, args.tokens.split(",")):
        cases = [case(T, shape, dev, gen) for _ in range(4 if dev.type == "cuda" else 1)]
        default = mhc.plan_hc(T, n, d, (2 + n) * n, bf16=True)      # the cases' streams are bf16
        base_out = run(cases[0], iters, default)
        oracle = [rel_err(a, b) for a, b in zip(base_out, reference(cases[0], iters))]
        print(f"{label:5s} {T:6d} {'default vs ref':20s} | u / post / comb / streams: "
              + " / ".join(f"{e:.1e}" for e in oracle), flush=True)
        rows.append(dict(tokens=T, variant="default against ref.hc_post_pre", rel_to_reference=oracle))
        base_us = None
        for name, change in VARIANTS.items():
            if name not in chosen:
                continue
            plan = variant_plan(default, change)
            if plan is None:
                continue
            row = dict(tokens=T, variant=name, plan=dataclasses.asdict(plan))
            try:
                got = run(cases[0], iters, plan)
                row["rel_to_default"] = [rel_err(a, b) for a, b in zip(got, base_out)]
                row["us"] = median_us(timer, [lambda c=c, p=plan: run(c, iters, p) for c in cases], args.rounds)
            except Exception as e:                    # a variant that does not compile or run: say so, go on
                record_failure(row, e, f"{label:5s} {T:6d} {name:20s}")
                rows.append(row)
                continue
            base_us = base_us or row["us"]
            errs = " / ".join(f"{e:.1e}" for e in row["rel_to_default"])
            print(f"{label:5s} {T:6d} {name:20s} | {row['us']:8.1f} {row['us'] / base_us:10.2f} | {errs}", flush=True)
            rows.append(row)
    write_record(args.out, "mhc.json", dict(device=str(dev), shape=shape, iters=iters, rows=rows))


if __name__ == "__main__":
    main()
