"""Question: How many SASS instructions per weight element does the decode GEMV's K loop take, with how many registers?

Compile the decode GEMV for sm_90 without a GPU and count SASS instructions in its K loop.

    PYTHONPATH=/path/to/triton-3.6 python bench/lab/sass.py nvfp4 fp8 --warps 2 --bn 64 --stages 2
    PYTHONPATH=/path/to/triton-3.6 python bench/lab/sass.py nvfp4 --pair --tiled --gcol --shared fp8
    PYTHONPATH=/path/to/triton-3.6 python bench/lab/sass.py --sampler       # the sampler's passes, per logit
    PYTHONPATH=/path/to/triton-3.6 python bench/lab/sass.py --sampler --logits fp32      # on fp32 logits
    PYTHONPATH=/path/to/triton-3.6 python bench/lab/sass.py --mhc           # mHC's mixing launches, per K step

Needs the Triton release the device runs (3.6: a wheel unpacked into a folder on PYTHONPATH; its bundled
ptxas and cuobjdump do the rest). Prints instructions per weight element in the innermost loop that holds
the MMAs, registers and spills - the numbers bench/RESULTS.md quotes.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from dsv4.kernels import gemv, mhc, moe_pair, policy, sampling  # noqa: E402
from dsv4.kernels.gemv_launch import Io, Layout, Stored, Units  # noqa: E402
from dsv4.kernels.host import Operand  # noqa: E402
from dsv4.kernels.policy import GemvConfig  # noqa: E402
from dsv4.kernels.tiles import FMT_CODES  # noqa: E402

# the runtime arguments' types, by name or bundle field (`gemv_launch.Io`, `Units`, `host.Operand`); the rest are i32
TYPES = dict(x="*bf16", y="*bf16", ids="*i64", rw="*fp32", ws="*fp32", cnt="*i32", limit="fp32", w="*u8", s="*u8",
             s2="*fp32", trace_ptr="*i64", sync_ptr="*i32")
# i32 values compiled without divisibility by 16 (as at V4's shapes; every other specialized i32 is a multiple of 16)
NO_DIVISIBILITY = {"n_steps", "x_div", "stride_s2e", "stride_s2g", "h_rows"}
BUNDLES = dict(io=Io, units=Units, w=Operand, sw=Operand)   # (the one-launch pair's prefixed up_ / dn_)


def with_defaults(fn, consts: dict) -> dict:
    """`consts` and every other constexpr of `fn` that has a default, at its default: a constexpr left out of the
    signature would otherwise be compiled as a runtime argument."""
    return {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **consts}


def signature(fn, consts: dict, types: dict = TYPES, unaligned: set = NO_DIVISIBILITY) -> tuple[dict, dict]:
    """(signature, divisibility attributes) of `fn` for ASTSource: an argument's type by name in `types` (i32 if
    absent), a bundle as its named tuple of types; a pointer, or an i32 that is specialized and not in `unaligned`,
    divisible by 16."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
            continue
        bundle = BUNDLES.get(name.removeprefix("up_").removeprefix("dn_"))
        fields = bundle._fields if bundle else (name,)
        field_types = [types.get(f, "i32") for f in fields]
        sig[name] = bundle(*field_types) if bundle else field_types[0]
        for j, (f, t) in enumerate(zip(fields, field_types)):
            if t.startswith("*") or (t == "i32" and name not in fn.do_not_specialize and f not in unaligned):
                attrs[(i, j) if bundle else (i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def gemv_layout(rows: int, gated: bool, bn: int, mp: int, warps: int, prefetch: int, shared: bool, pdl: bool,
                pdl_l2: int, gcol: bool, x_ready: bool, cols: bool, blocks: bool) -> Layout:
    return Layout(ROWS=rows, GATED=gated, BN=bn, MMA_N=mp, DOT=tl.bfloat16, ASM=True, WARPS=warps, PREFETCH=prefetch,
                  SHARED=shared, PDL=pdl, PDL_L2=pdl_l2, GROUP_COLS=gcol, X_READY=x_ready, COLS=cols, BLOCKS=blocks)


def compile_gemv(fmt: str, warps: int, bn: int, stages: int, rows: int, gated: bool, maxnreg: int, mp: int = 16,
                 shared: str | None = None, prefetch: int = 1, tiled: bool = False, pdl: bool = False,
                 pdl_l2: int = GemvConfig().pdl_l2, gcol: bool = False, x_ready: bool = False,
                 cols: bool = False, blocks: bool = False, fn=None):
    """`gemv._gemv_kernel`, or `fn`, a kernel with its arguments (and maybe more: `TYPES`), for sm_90."""
    fn = fn or gemv._gemv_kernel
    consts = dict(L=gemv_layout(rows, gated, bn, mp, warps, prefetch, shared is not None, pdl, pdl_l2, gcol, x_ready,
                                cols, blocks),
                  F=Stored(FMT_CODES[fmt], False, tiled), FS=Stored(FMT_CODES[shared or fmt], False, tiled))
    consts = with_defaults(fn, consts)
    sig, attrs = signature(fn, consts)
    opts = {"num_warps": warps, "num_stages": stages, **({"maxnreg": maxnreg} if maxnreg else {}),
            **({"launch_pdl": True} if pdl else {})}
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options=opts)


def compile_pair(fmt: str, shared: str | None = None, tiled: bool = True, pdl: bool = False, x_ready: bool = False,
                 gcol: bool = True, stages: int = 2, cols: bool = False, blocks: bool = False):
    """`moe_pair._moe_pair_kernel` (the MoE decode pair in one launch) as `moe` runs it: 2 warps, BN 64, MMA N 8,
    the routed experts (and the shared expert, if given) in the same format for gate/up and down."""
    fn = moe_pair._moe_pair_kernel
    stored, stored_s = Stored(FMT_CODES[fmt], False, tiled), Stored(FMT_CODES[shared or fmt], False, tiled)
    up = gemv_layout(policy.ROWS_PAIR, True, 64, 8, 2, 1, shared is not None, pdl, 0, gcol, x_ready, cols, blocks)
    down = up._replace(ROWS=policy.ROWS_TOKEN, GATED=False, X_READY=False)
    consts = with_defaults(fn, dict(UP=up, UP_F=stored, UP_FS=stored_s, DN=down, DN_F=stored, DN_FS=stored_s))
    sig, attrs = signature(fn, consts)
    opts = {"num_warps": 2, "num_stages": stages, "maxnreg": 128, **({"launch_pdl": True} if pdl else {})}
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options=opts)


# `gemm.TileIo` / `TileGrid` / `host.Operand` fields that a launch at V4's shapes does not pass as multiples of 16
QGEMM_UNALIGNED = {"M", "NUM_M", "X_DIV", "SPLIT_K", "GROUP_M", "stride_x_sf", "stride_ws", "group_r", "x_gstride",
                   "stride_we", "stride_wg", "stride_se", "stride_sg", "stride_s2e", "stride_s2g"}


def compile_qgemm(fmt: str, rows: int, epi: int, bm: int = 16, bn: int = 128, bk: int = 128, split: bool = False,
                  warps: int = 4, stages: int = 3, aligned: bool = False):
    """`gemm._qgemm_kernel` (the fused tiles and the grouped MoE GEMM) with bf16 x and an fp32 y, e.g. the sorted
    path's routed down projection (rows=ROWS_SORTED, epi=EPI_ROUTED): tiled weights, or a row-major bf16 weight for
    "dense". aligned: pointers and the sizes and strides not in QGEMM_UNALIGNED divisible by 16, as the JIT sees them
    at V4's shapes (their loads then vectorize); else no divisibility hints."""
    from dsv4.kernels import gemm
    fn = gemm._qgemm_kernel
    dense = fmt == "dense"
    consts = dict(T=gemm.Tiles(FMT=FMT_CODES[fmt], SCALE_F32=False, A_FP4=False, ROWS=rows, GATED=False, EPI=epi,
                               DOT=tl.bfloat16, PREC="tf32", ASM=True, BM=bm, BN=bn, BK=bk, EVEN_K=True, PROMOTE=True,
                               SPLIT=split, TILED=not dense))
    weight = "*bf16" if dense else "*u8"
    types = dict(x="*bf16", x_sf="*u8", y="*fp32", rw="*fp32", rows="*i32", ids="*i32", nblk="*i32", ws="*fp32",
                 cnt="*i32", input_scale="*fp32", limit="fp32", w=weight, s=weight, s2=weight if dense else "*fp32")
    bundles = dict(io=gemm.TileIo, grid=gemm.TileGrid, w=Operand)
    sig = {n: "constexpr" if n in consts else bundles[n](*(types.get(f, "i32") for f in bundles[n]._fields))
           for n in fn.arg_names}
    attrs = {(i, j): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if aligned and n in bundles
             for j, f in enumerate(bundles[n]._fields)
             if types.get(f, "i32").startswith("*") or (types.get(f, "i32") == "i32" and f not in QGEMM_UNALIGNED)}
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages})


def dump(cubin: bytes) -> tuple[list[tuple[int, str]], str]:
    """A cubin's SASS as (address, instruction) pairs, and cuobjdump's resource usage text."""
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([str(tools / "cuobjdump"), "--dump-sass", f.name], capture_output=True, text=True).stdout
        usage = subprocess.run([str(tools / "cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                               text=True).stdout
    return [(int(m.group(1), 16), m.group(2).strip()) for m in
            (re.match(r"\s+/\*([0-9a-f]+)\*/\s+(.*?);", line) for line in sass.splitlines()) if m], usage


def loops(ins) -> list[tuple[int, int]]:
    """The (start, end) addresses of each loop of a `dump`: every backward branch and its target."""
    return [(int(m.group(1), 16), addr) for addr, t in ins
            if (m := re.search(r"BRA (0x[0-9a-f]+)", t)) and int(m.group(1), 16) < addr]


def op_counts(ins, lo: int, hi: int) -> Counter:
    """The instructions from address lo to hi, counted by opcode (predicate and modifiers dropped)."""
    return Counter(t.split()[1 if t.startswith("@") else 0].split(".")[0] for a, t in ins if lo <= a <= hi)


def spills_and_registers(ins, usage: str) -> tuple[int, str]:
    """A `dump`'s spill instructions (local loads and stores) and its registers a thread."""
    regs = re.findall(r"REG:(\d+)", usage)
    return sum(1 for _, t in ins if t.split()[0].startswith(("LDL", "STL"))), regs[0] if regs else "?"


def loop_counts(cubin: bytes):
    ins, usage = dump(cubin)
    best = None
    for lo, addr in loops(ins):  # the innermost loop whose body holds an MMA
        if any(lo <= a <= addr and "MMA" in t for a, t in ins) and (best is None or addr - lo < best[1] - best[0]):
            best = (lo, addr)
    return (op_counts(ins, *best) if best else Counter()), *spills_and_registers(ins, usage)


SAMPLER_TYPES = dict(stat_x="*fp32", stat_i="*i32", hist="*i32", state="*i64", sums="*i64",
                     cand="*i32", over="*i64", cnt="*i32", out="*i64",
                     P=sampling.Rows("*fp32", "*i1", "*fp32", "*i64", "*fp64", "*i64", "*i64"))
_DRAWS = dict(D=sampling.CANDIDATES, NS_PAD=256, CHUNKS_PAD=16, SUB=sampling.SUB)
SAMPLER_CASES = [   # (what, kernel, filters (min-p, top-k, top-p), its constexprs besides F and BLOCK, the logits
                    # an iteration of each of its loops takes, in order)
    ("max pass", "_max_kernel", (False, False, False), {}, ("BLOCK",)),
    ("max pass, every filter", "_max_kernel", (True, True, True), {}, ("BLOCK",)),
    ("mass pass, top-p", "_mass_kernel", (False, False, True), _DRAWS, ("BLOCK",)),
    ("mass pass, every filter", "_mass_kernel", (True, True, True), _DRAWS, ("BLOCK",)),
    ("check, top-p (the pass; the bracket; its draw)", "_check_kernel", (False, False, True),
     dict(_DRAWS, CHECK_BLOCK=sampling.CHECK_BLOCK, MAX_PASSES=sampling.MAX_PASSES), ("CHECK_BLOCK", "SUB", "SUB")),
    ("check, every filter", "_check_kernel", (True, True, True),
     dict(_DRAWS, CHECK_BLOCK=sampling.CHECK_BLOCK, MAX_PASSES=sampling.MAX_PASSES), ("CHECK_BLOCK", "SUB", "SUB")),
    ("radix pass 2 (counted; votes)", "_radix_kernel", None, dict(PASS=2, COUNTED_KEYS=sampling.COUNTED_KEYS,
                                                                  CHUNKS_PAD=16), ("BLOCK", "BLOCK")),
]


def sampler_counts(logits: str = "bf16") -> None:
    """The SASS instructions a logit of each loop of the sampler's passes (`kernels/sampling.py`, 8 warps; each loop
    takes the logits its case names an iteration) for logits of that dtype ("bf16": the engine's; "fp32"), as the docs
    quote them."""
    for what, name, filters, consts, widths in SAMPLER_CASES:
        fn = getattr(sampling, name)
        consts = {n: v for n, v in dict(consts, BLOCK=sampling.BLOCK).items() if n in fn.arg_names}
        if filters is not None:
            consts["F"] = sampling.Filters(*filters)
        types = dict(SAMPLER_TYPES, logits=f"*{logits}")
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
        k = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
        ins, usage = dump(k.asm["cubin"])
        sizes = [sum(1 for a, _ in ins if lo <= a <= hi) for lo, hi in loops(ins)]
        per_logit = [n * 8 * 32 / getattr(sampling, w) for n, w in zip(sizes, widths)]
        spills, regs = spills_and_registers(ins, usage)
        print(f"{what}: instructions a logit in its loops {[round(n, 1) for n in per_logit]}; registers {regs}; "
              f"spill instructions {spills}")


MHC_TYPES = dict(out_ptr="*bf16", x_ptr="*bf16", post_ptr="*fp32", comb_ptr="*fp32", y_ptr="*bf16", fn_ptr="*fp32",
                 part_ptr="*fp32")
MHC_UNALIGNED = {"R", "stride_pc", "stride_pt"}   # i32 arguments V4's shapes do not pass as multiples of 16


def mhc_counts() -> None:
    """mHC's mixing launches (`kernels/mhc.py`) for bf16 streams at V4-Flash's plans for 16 and 64 tokens, compiled
    with MIX_CHUNK columns a program (V4-Flash's plans take fewer, a single step, which the compiler unrolls): the
    instructions of one BK step (the K loop), its FFMAs, registers and spills; the update's launch also with OPAQUE
    off (the update then made a second time in the product's operand layout where the product is "bf16x3")."""
    for tokens in (16, 64):
        plan = mhc.plan_hc(tokens, 4, 4096, 24, bf16=True)
        for fn, opaque in ((mhc._post_mix_kernel, True), (mhc._post_mix_kernel, False), (mhc._mix_kernel, None)):
            consts = dict(RP=plan.rows_p2, BT=plan.block_tokens, CHUNK=mhc.MIX_CHUNK, BK=mhc.MIX_BK,
                          PRECISION=plan.precision, DOT=tl.bfloat16)
            if opaque is not None:
                consts.update(N=plan.streams, OPAQUE=opaque)
            sig, attrs = signature(fn, consts, MHC_TYPES, MHC_UNALIGNED)
            k = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": plan.warps})
            ins, usage = dump(k.asm["cubin"])
            body = op_counts(ins, *max(loops(ins), key=lambda b: b[1] - b[0]))   # the K loop: the largest
            spills, regs = spills_and_registers(ins, usage)
            what = fn.__name__ + ("" if opaque is None else f", OPAQUE {opaque}")
            print(f"{tokens} tokens ({plan.precision}, {plan.block_tokens} a program) {what}: {sum(body.values())} "
                  f"instructions a K step, FFMA {body['FFMA']}; registers {regs}; spill instructions {spills}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("formats", nargs="*", default=["nvfp4", "mxfp4", "fp8"])
    ap.add_argument("--warps", type=int, default=2)
    ap.add_argument("--bn", type=int, default=64)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--maxnreg", type=int, default=128)
    ap.add_argument("--rows", type=int, default=policy.ROWS_DENSE)
    ap.add_argument("--gated", action="store_true")
    ap.add_argument("--mp", type=int, default=16, help="x rows per unit (the MMA N)")
    ap.add_argument("--prefetch", type=int, default=1, help="GemvConfig.prefetch (bit mask: 1 FP8, 2 FP4)")
    ap.add_argument("--tiled", action="store_true", help="weights stored tile by tile (formats.tiling)")
    ap.add_argument("--pdl", action="store_true", help="GemvConfig.pdl (programmatic dependent launch)")
    ap.add_argument("--gcol", action="store_true", help="GemvConfig.group_cols (FP4, one x row; needs --mp 8)")
    ap.add_argument("--shared", default=None, help="the shared expert's format in the same launch (MoE)")
    ap.add_argument("--pair", action="store_true", help="the MoE pair in one launch (moe_pair._moe_pair_kernel; "
                    "counts its tightest MMA loop)")
    ap.add_argument("--qgemm", action="store_true", help="the fused tiles (`compile_qgemm`, aligned as at V4's "
                    "shapes; formats may include dense) at BM 16, --bn, BK 128, split-K, --warps, --stages")
    ap.add_argument("--sampler", action="store_true", help="the sampler's passes instead (`sampler_counts`)")
    ap.add_argument("--logits", choices=("bf16", "fp32"), default="bf16", help="the sampler's logits (--sampler)")
    ap.add_argument("--mhc", action="store_true", help="mHC's mixing launches instead (`mhc_counts`)")
    args = ap.parse_args()
    if args.sampler:
        sampler_counts(args.logits)
        return
    if args.mhc:
        mhc_counts()
        return
    for fmt in args.formats:
        if args.qgemm:
            k = compile_qgemm(fmt, policy.ROWS_DENSE, 0, 16, args.bn, 128, True, args.warps, args.stages, True)
            ops, spills, regs = loop_counts(k.asm["cubin"])
            print(f"{fmt} tiles: {sum(ops.values())} instructions per loop iteration; registers {regs}; spill "
                  f"instructions {spills}; shared memory {k.metadata.shared} bytes; {dict(ops.most_common(12))}")
            continue
        if args.pair:
            k = compile_pair(fmt, args.shared, args.tiled, args.pdl, gcol=args.gcol, stages=args.stages)
        else:
            k = compile_gemv(fmt, args.warps, args.bn, args.stages, args.rows, args.gated, args.maxnreg, args.mp,
                             args.shared, args.prefetch, args.tiled, args.pdl, gcol=args.gcol)
        ops, spills, regs = loop_counts(k.asm["cubin"])
        per_iter = args.bn * (256 if fmt != "fp8" else 128) / (32 * args.warps) * (2 if args.gated else 1)
        n = sum(ops.values())
        print(f"{fmt}: {n} instructions per loop iteration = {n / per_iter:.2f} per weight element and thread; "
              f"registers {regs}; spill instructions {spills}; shuffles {ops['SHFL']}; "
              f"{dict(ops.most_common(12))}")


if __name__ == "__main__":
    main()
