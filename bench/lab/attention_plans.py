"""Question: Which launch geometry makes a decode step's attention fastest at V4-Flash's shapes, batch 1 to 256?

Round 33's H100 profile put batch-256 decode attention at 334 us a layer for bytes that take about 55 us, with
the geometry of then (32 heads a program on 8 warps, 16 keys a block, no key split once the launch fills the GPU):
one program per SM, about 40 dependent key blocks each. This times `kernels.attention.sparse_attention` over
a decode step (one token per sequence, the ring written in the launch) with other plans: round 33's, heads per
program (up to all 64 of a token), warps, a key split at large batch, 32 or 64 keys a block, and compares each
output with the default plan's.

    python bench/lab/attention_plans.py [--batches 1,64,256] [--context 8192] [--out DIR]   # on the GPU
    python bench/lab/attention_plans.py --rope [--batches 1,8]      # the default plan with the queries' norm / rope
    python bench/lab/attention_plans.py --toy                                              # CPU dry run

--rope times the default plan only, as the model calls it (`rope` and `q_eps`: the queries normalised and rotated
and the output rotated back inside the launch) against the same launch without them, with one of the two, and
with a norm / rope launch on each side of a plain launch (three launches).

For each batch and layer kind (CSA: the window + 512 picks; HCA: the window + every entry, context / 128; SW: the
window alone): random bf16 queries, rows, rings and entries over scrambled pages, the picks random visible entries;
at batch 8 and below also key splits into shares of 128, 64 and 32 keys (16 heads on 4 warps). Each plan's launch
timed with `common.Timer` (a CUDA graph of calls on rotated inputs, median), its output's largest difference from
the default plan's relative to the output's largest value (expect bf16 rounding: < 1e-2). A plan the kernel cannot
compile or run is reported, not fatal. Prints a table; writes attention_plans.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository: dsv4
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # bench: common

from common import Timer, write_record  # noqa: E402

from dsv4.kernels.attention import AttentionPlan, attention_split, plan_attention, sparse_attention  # noqa: E402
from dsv4.kernels.host import num_sms  # noqa: E402
from dsv4.kernels.norm_rope import norm_rope  # noqa: E402
from dsv4.kernels.steps import StepTokens  # noqa: E402

PAGE_TOKENS = 256


def step_inputs(batch: int, context: int, ratio: int, H: int, D: int, W: int, topk: int, dev, gen) -> dict:
    """One decode token per sequence at position context - 1, its caches filled with random values."""
    E = PAGE_TOKENS // max(ratio, 1)
    per_seq = -(-context // PAGE_TOKENS)
    perm = torch.randperm(batch * per_seq, generator=torch.Generator().manual_seed(batch)).tolist()
    pages = [tuple(perm[i * per_seq:(i + 1) * per_seq]) for i in range(batch)]
    steps = StepTokens.build(tuple(range(batch)), (context - 1,) * batch, (1,) * batch, pages, dev)
    picks = None
    if ratio == 4:
        visible = context // 4
        picks = torch.stack([torch.randperm(visible, device=dev, generator=gen)[:topk] for _ in range(batch)])
    return dict(q=torch.randn(batch, H, D, device=dev, generator=gen).bfloat16(),
                kv=torch.randn(batch, D, device=dev, generator=gen).bfloat16(),
                ring=torch.randn(batch + 1, W, D, device=dev, generator=gen).bfloat16(),
                entries=torch.randn(batch * per_seq, E, D, device=dev, generator=gen).bfloat16() if ratio else None,
                picks=picks, steps=steps, sinks=torch.randn(H, device=dev, generator=gen),
                rope=rope_tables(torch.rand(batch, 32, device=dev, generator=gen) * 6))


def rope_tables(angle: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of each token's rope angles [tokens, 32] (V4's 64 rope channels)."""
    return angle.cos(), angle.sin()


def rope_variants(plan: AttentionPlan) -> dict:
    """--rope: (plan, the launch's rope / q_eps arguments, apart) by name; apart: norm / rope launches around it."""
    return {"plain": (plan, False, None, False), "q norm": (plan, False, 1e-6, False),
            "rope": (plan, True, None, False), "q norm + rope": (plan, True, 1e-6, False),
            "q norm + rope, apart": (plan, True, 1e-6, True)}


def candidates(batch: int, H: int, D: int, W: int, keys: int, sms: int) -> dict[str, AttentionPlan]:
    default = plan_attention(batch, H, D, W, keys, False, sms)
    bk = default.keys
    old = AttentionPlan(16, 16, 8, default.split) if default.split else AttentionPlan(32, 16, 8, 0)
    split37 = attention_split(batch * -(-H // 32), W + keys, sms)
    round37 = AttentionPlan(16, 32, 4, split37) if split37 else AttentionPlan(32, 64, 8, 0)   # before 64 heads
    plans = {"default": default,
             "round 37 (at most 32 heads)": round37,
             "round 33 (16 keys a block)": old,
             "16 heads, 8 warps": AttentionPlan(16, bk, 8, default.split),
             "16 heads, 4 warps": AttentionPlan(16, bk, 4, default.split)}     # 228 registers: two programs an SM
    for split in (1, 3):
        if default.split == 0:
            plans[f"16 heads, split {split}"] = AttentionPlan(16, bk, 8, split)
    if batch <= 8:    # shares of the window and the entries of 128, 64 and 32 keys
        for split in sorted({-(-(W + keys) // share) - 1 for share in (128, 64, 32)} - {0, default.split}):
            plans[f"16 heads, 4 warps, split {split}"] = AttentionPlan(16, 32, 4, split)
    plans["32 keys a block"] = default._replace(keys=32)
    plans["64 keys a block"] = default._replace(keys=64)
    # every head of a token in one program: each key row read once a token, and products of 64 rows (wgmma on sm_90;
    # 64 keys a block need more shared memory than an SM has)
    plans["64 heads, 8 warps"] = AttentionPlan(64, 32, 8, default.split)
    plans["64 heads, 16 warps"] = AttentionPlan(64, 32, 16, default.split)
    for split in (0, 1, 2, 3, 4, 16):
        plans[f"64 heads, split {split}"] = AttentionPlan(64, 32, 8, split)
    return plans


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    ap.add_argument("--toy", action="store_true", help="CPU dry run at small shapes (checks the script)")
    ap.add_argument("--rope", action="store_true", help="the default plan with and without the queries' norm / rope")
    args = ap.parse_args()
    H, D, W, topk = 64, 512, 128, 512
    if args.toy:
        args.device, args.batches, args.context = "cpu", "1,4", 512
        H, D, W, topk = 4, 64, 16, 8
    dev = torch.device(args.device)
    gen = torch.Generator(device=dev).manual_seed(0)
    timer, sms = Timer(dev), num_sms(dev)
    rot = 3 if dev.type == "cuda" else 1
    print(f"{'layer':5s} {'B':>4s} {'plan':22s} {'heads':>5s} {'warps':>5s} {'split':>5s} | {'us':>9s} "
          f"{'vs default':>10s} | max diff")
    rows = []
    for batch in map(int, args.batches.split(",")):
        for kind, ratio in (("CSA", 4), ("HCA", 128), ("SW", 0)):
            inputs = [step_inputs(batch, args.context, ratio, H, D, W, topk, dev, gen) for _ in range(rot)]
            keys = topk if ratio == 4 else args.context // 128 if ratio else 0
            want, base_us, outputs = None, None, {}
            plans = candidates(batch, H, D, W, keys, sms)
            variants = rope_variants(plans["default"]) if args.rope else {n: (p, False, None, False)
                                                                           for n, p in plans.items()}
            for name, (plan, rotate, q_eps, apart) in variants.items():
                row = dict(layer=kind, B=batch, plan=name, **plan._asdict())
                try:
                    def launch(x, plan=plan, rotate=rotate, q_eps=q_eps, apart=apart):
                        rope = x["rope"] if rotate else None
                        q = norm_rope(x["q"], *rope, eps=q_eps) if apart else x["q"]
                        o = sparse_attention(q, x["kv"], x["ring"], x["entries"], x["picks"], x["steps"], ratio,
                                             x["sinks"], D ** -0.5, keys, update_ring=True, plan=plan,
                                             rope=None if apart else rope, q_eps=None if apart else q_eps)
                        return norm_rope(o, *rope, inverse=True) if apart else o
                    got = launch(inputs[0]).float()
                    if args.rope:     # apart against the launch that does the same inside; the rest: themselves
                        outputs[name] = got
                        want = outputs["q norm + rope"] if name.endswith("apart") else got
                    else:
                        want = got if want is None else want
                    row["max_diff"] = float((got - want).abs().max() / want.abs().max())
                    row["us"] = 1e3 * timer.per_call_ms([lambda x=x: launch(x) for x in inputs])
                    base_us = row["us"] if base_us is None else base_us
                except Exception:
                    row["error"] = traceback.format_exc()[-800:]
                rows.append(row)
                us = f"{row['us']:9.1f} {base_us / row['us']:9.2f}x" if "us" in row else f"{'failed':>9s} {'':>10s}"
                diff = f"{row['max_diff']:.1e}" if "max_diff" in row else row.get("error", "")[-80:]
                print(f"{kind:5s} {batch:4d} {name:22s} {plan.heads:5d} {plan.warps:5d} {plan.split:5d} | {us} | "
                      f"{diff}", flush=True)
    write_record(args.out, "attention_plans.json", dict(device=str(dev), context=args.context, rows=rows))


if __name__ == "__main__":
    main()
