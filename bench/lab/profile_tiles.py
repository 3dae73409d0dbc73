"""Question: How far is each dense shape's chosen tile from the fastest one measured, and from cuBLAS?

The fused tiles (`gemm._qgemm_kernel`: the dense linears from 9 to 256 rows of x; forced, bf16 weights at any rows)
over BM / BN / split-K around `policy.tile_config`'s choice, beside Triton dequantize + cuBLAS and cuBLAS bf16 on the
same shape.

    python bench/lab/profile_tiles.py [--ms 48,64] [--cases V4-Flash:expert w1/w3:nvfp4,...] [--budget 150]
        [--bms 16,32,64] [--bns 64,128] [--splits 1,2,4] [--warps 4,8] [--asms 0,1] [--maxnregs 0,168]
        [--base-only]
    TRITON_INTERPRET=1 python bench/lab/profile_tiles.py --toy      # CPU dry run at a toy shape

Why: `policy.dense_tiles` chooses these tiles by a rule fitted to this sweep (bench/results/round-22.md); the
sweep shows how far each shape's choice is from the fastest tiles measured, and where dequantize + cuBLAS or cuBLAS
bf16 stand. Rows above 64 take tile_config's tiles for them as the base (on CUDA `dispatch.linear` runs them only
where `policy.fused_beats_cublas`, else dequantize + cuBLAS). Per case and row count it prints tile_config's tiles
and time, the default path's time (`dispatch.linear` as the model calls it: the GEMV where it is preferred), then
the fastest variants with their time over tile_config's and the relative difference of their output from
tile_config's (split-K sums in another order: ~1e-5 to 1e-4, not more). Rotated weights in one CUDA
graph per variant (`common.Timer`). A case names one of `common.Shapes.linears` in a format, or one of
`Shapes.dense_linears` (a decode step's bf16 products: the compressors' fused projection, the head) as dense.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository: dsv4
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # bench: common
sys.path.insert(0, str(Path(__file__).resolve().parent))       # bench/lab: sass, timeline

from common import FLASH, PRO, TOY, Timer, nbytes, rel_err, rotated_qweights  # noqa: E402

from dsv4.formats import QWeight  # noqa: E402
from dsv4.kernels import dispatch, gemm, policy, ref, refuse_fallback  # noqa: E402
from dsv4.kernels.gemv_launch import resident_ctas  # noqa: E402
from dsv4.kernels.host import Scratch, num_sms  # noqa: E402
from dsv4.kernels.policy import TileConfig  # noqa: E402

CASES = "V4-Flash:expert w1/w3:nvfp4,V4-Flash:shared w1/w3:fp8,V4-Flash:wq_b:nvfp4,V4-Pro:wo_b:nvfp4"


def variants(base: TileConfig, m: int, k: int, bms=(16, 32, 64), bns=(64, 128),
             splits=None, warps=None, asms=(None,), maxnregs=None) -> list[TileConfig]:
    """BM in `bms` (up to the rows), BN in `bns`, warps in `warps` (None: tile_config's), the K splits in
    `splits` (None: tile_config's split, half and twice it), `TileConfig.asm` in `asms` and `TileConfig.maxnreg` in
    `maxnregs` (None: tile_config's); tile_config's own tiles left out."""
    out = []
    chunks = triton.cdiv(k, base.BK)
    for bm in bms:
        if bm > max(16, triton.next_power_of_2(m)):
            continue
        for bn in bns:
            chosen = splits or (max(1, base.split_k // 2), base.split_k, 2 * base.split_k)
            for split in sorted({min(chunks, s) for s in chosen}):
                for nw in warps or (base.num_warps,):
                    for asm in asms:
                        for cap in maxnregs or (base.maxnreg,):
                            cfg = replace(base, BM=bm, BN=bn, split_k=split, num_warps=nw, asm=asm, maxnreg=cap)
                            if cfg != base:
                                out.append(cfg)
    return out


def flags(text: str) -> tuple[bool, ...]:
    return tuple(bool(int(v)) for v in text.split(",") if v)


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="48,64", help="rows of x")
    ap.add_argument("--cases", default="", help=f"MODEL:LINEAR:FORMAT,... (common.Shapes names; default {CASES}, "
                    "or toy:expert w1/w3:nvfp4 with --toy)")
    ap.add_argument("--bms", default="16,32,64", help="BM values swept (those above the rows are skipped)")
    ap.add_argument("--bns", default="64,128", help="BN values swept")
    ap.add_argument("--splits", default="", help="K splits swept (default: tile_config's split, half and twice it)")
    ap.add_argument("--warps", default="", help="num_warps swept (default: tile_config's)")
    ap.add_argument("--asms", default="", help="TileConfig.asm values swept, 0 / 1 (default: tile_config's, None: the "
                    "PTX decoders wherever the dot runs in bf16 on a GPU)")
    ap.add_argument("--maxnregs", default="", help="TileConfig.maxnreg values swept, registers per thread, 0 = the "
                    "compiler's own count (default: tile_config's)")
    ap.add_argument("--base-only", action="store_true", help="sweep only --asms and --maxnregs, on tile_config's "
                    "tiles")
    ap.add_argument("--top", type=int, default=4, help="fastest variants printed per case")
    ap.add_argument("--budget", type=float, default=150.0, help="seconds after which no new case starts")
    ap.add_argument("--toy", action="store_true", help="a toy shape on the CPU (with TRITON_INTERPRET=1)")
    ap.add_argument("--json", default="", help="write every measured row (all variants) to this file")
    args = ap.parse_args()
    dev = torch.device("cpu" if args.toy else "cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    dtype = torch.float32 if args.toy else torch.bfloat16   # the interpreter's dot takes fp32 operands
    timer, scratch, start = Timer(dev), Scratch(), time.time()
    models = {s.name: s for s in (FLASH, PRO, TOY)}
    cases = [c.split(":") for c in (args.cases or ("toy:expert w1/w3:nvfp4" if args.toy else CASES)).split(",")]
    ms = [24] if args.toy else [int(m) for m in args.ms.split(",")]
    records = []

    def resident(x, w, cfg):
        """CTAs of this configuration's compiled kernel that fit on one SM (0 under the interpreter)."""
        if args.toy:
            return 0
        y = torch.empty(x.shape[0], w.out_features, dtype=x.dtype, device=dev)
        return resident_ctas(gemm.launch(x, w, y, cfg, M=x.shape[0], scratch=scratch), cfg.num_warps, dev)
    for model, name, fmt in cases:
        if time.time() - start > args.budget:
            print(f"budget of {args.budget:.0f} s reached: stopped before {model} {name}", flush=True)
            break
        s = models[model]
        n, k = {**s.linears(), **s.dense_linears()}[name]
        ws = rotated_qweights(fmt, n, k, dev, gen, 2 if args.toy else None)
        if fmt == "dense":   # in the activations' dtype, as the kernels read them
            ws = [QWeight("dense", w.weight.to(dtype)) for w in ws]
        w0, rot = ws[0], len(ws)
        # cuBLAS bf16 on the same shape: a dense case's own weights, else drawn
        dense = [w.weight for w in ws] if fmt == "dense" else \
            [torch.randn(n, k, device=dev, generator=gen).to(dtype) for _ in range(rot)]
        for m in ms:
            xs = [torch.randn(m, k, device=dev, generator=gen).to(dtype) for _ in range(rot)]
            base = policy.tile_config(m, n, k, fmt, num_sms(dev))

            def fused(cfg):
                return [lambda x=x, w=w: dispatch.linear(x, w, config=cfg, fallback=refuse_fallback, scratch=scratch)
                        for x, w in zip(xs, ws)]

            base_out = fused(base)[0]().float()
            base_us = timer.per_call_ms(fused(base)) * 1e3
            deq_us = timer.rotated_us(lambda x, w: torch.nn.functional.linear(x, gemm.dequantize(w, x.dtype)), xs, ws)
            # a dense weight's default path is the reference's F.linear (`policy._plan_dense`)
            default_us = timer.rotated_us(partial(dispatch.linear, fallback=ref.linear if fmt == "dense" else
                                                  refuse_fallback, scratch=scratch), xs, ws)
            bf16_us = timer.rotated_us(torch.nn.functional.linear, xs, dense)
            rows = [(base_us, base, 0.0)]
            if args.base_only:
                axes = dict(bms=(base.BM,), bns=(base.BN,), splits=(base.split_k,), warps=(base.num_warps,))
            else:
                axes = dict(bms=ints(args.bms), bns=ints(args.bns), splits=ints(args.splits) or None,
                            warps=ints(args.warps) or None)
            for cfg in variants(base, m, k, **axes, asms=flags(args.asms) or (None,),
                                maxnregs=ints(args.maxnregs) or None):
                try:
                    diff = rel_err(fused(cfg)[0]().float(), base_out)
                    rows.append((timer.per_call_ms(fused(cfg)) * 1e3, cfg, diff))
                except Exception as e:   # a tile shape the kernel or the GPU refuses: said, not fatal
                    print(f"   BM {cfg.BM} BN {cfg.BN} split {cfg.split_k}: FAILED {e!r}"[:200], flush=True)
            rows.sort(key=lambda r: r[0])
            for us, cfg, diff in rows:
                records.append(dict(model=model, linear=name, fmt=fmt, M=m, N=n, K=k, MB=nbytes(w0) / 1e6,
                                    BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, split=cfg.split_k, warps=cfg.num_warps,
                                    asm=cfg.asm, maxnreg=cfg.maxnreg, default_us=default_us,
                                    stages=cfg.num_stages, us=us, base=cfg == base, diff=diff,
                                    resident=resident(xs[0], w0, cfg), deq_us=deq_us, bf16_us=bf16_us))
            print(f"{model} {name} {fmt} ({nbytes(w0) / 1e6:.1f} MB) M={m}: tile_config BM {base.BM} BN {base.BN} "
                  f"split {base.split_k} ({resident(xs[0], w0, base)} CTAs per SM) {base_us:.1f} us; default path "
                  f"{default_us:.1f}, dequantize + cuBLAS {deq_us:.1f}, cuBLAS bf16 {bf16_us:.1f}", flush=True)
            for us, cfg, diff in [r for r in rows if r[1] != base][:args.top]:
                print(f"   BM {cfg.BM:2d} BN {cfg.BN:3d} split {cfg.split_k:2d} warps {cfg.num_warps} asm {cfg.asm} "
                      f"maxnreg {cfg.maxnreg} ({resident(xs[0], w0, cfg)} CTAs per SM): {us:7.1f} us "
                      f"({us / base_us:.3f}), output {diff:.0e} from tile_config's", flush=True)
        del ws, dense
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
