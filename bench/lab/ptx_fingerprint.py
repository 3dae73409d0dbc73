"""Question: Did a refactor leave the compiled kernels' PTX unchanged?

Fingerprints of the decode GEMV's and the MoE pair's PTX, to show that a refactor left the kernels' code alone.

    PYTHONPATH=/path/to/triton-3.6 python bench/lab/ptx_fingerprint.py --out before.json
    ... change the code ...
    PYTHONPATH=/path/to/triton-3.6 python bench/lab/ptx_fingerprint.py --compare before.json

Compiles 27 variants for sm_90 without a GPU (`bench/lab/sass.py`: every format, the dense / pair / token row modes,
MMA N 8 and 16, 2 and 3 stages, gated, tiled, PDL, group columns, an FP8 shared expert, the shared expert as token
columns, the pair in one launch), drops debug lines (`.loc`, `.file`, comments, debug sections and their `$L__tmp`
labels) and hashes the rest. The same hash means the same PTX, so the GPU runs the same code. Where a change moves
the kernels' parameters (their operand bundles), the PTX moves with them; `--sass` then records what to compare
instead: each variant's K-loop SASS instructions, spills in that loop and in the kernel, and registers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sass  # noqa: E402  (sets up the import path and drops TRITON_INTERPRET)


def clean(ptx: str) -> str:
    """PTX without debug lines: `.loc` / `.file`, comments, the debug sections and the `$L__tmpN:` labels that only
    they refer to (an inlined helper adds some)."""
    lines = [s for s in (line.strip() for line in ptx.splitlines())
             if s and not s.startswith((".loc", ".file", "//")) and not re.fullmatch(r"\$L__tmp\d+:", s)]
    return re.sub(r"\.section\s+\.debug\w*\s*\{.*?\n\}", "", "\n".join(lines), flags=re.S)


def variants():
    """(name, compile thunk) for every variant."""
    for fmt in ("nvfp4", "mxfp4", "fp8"):
        fp4 = fmt != "fp8"
        yield f"dense {fmt} N8 tiled pdl", lambda f=fmt: sass.compile_gemv(f, 2, 64, 2, 0, False, 128, 8, tiled=True,
                                                                            pdl=True)
        yield f"dense {fmt} N16 3 stages", lambda f=fmt: sass.compile_gemv(f, 2, 64, 3, 0, False, 128, 16)
        yield f"dense {fmt} gated N16", lambda f=fmt: sass.compile_gemv(f, 2, 64, 2, 0, True, 0, 16, tiled=True)
        yield f"pair {fmt} fp8 shared, group columns, x ready", lambda f=fmt, g=fp4: sass.compile_gemv(
            f, 2, 64, 2, 1, True, 128, 8, shared="fp8", tiled=True, pdl=True, gcol=g, x_ready=True)
        yield f"token {fmt} fp8 shared, group columns", lambda f=fmt, g=fp4: sass.compile_gemv(
            f, 2, 64, 2, 2, False, 128, 8, shared="fp8", tiled=True, gcol=g)
        yield f"pair {fmt} {fmt} shared as token columns, x ready", lambda f=fmt, g=fp4: sass.compile_gemv(
            f, 2, 64, 2, 1, True, 128, 8, shared=f, tiled=True, pdl=True, gcol=g, x_ready=True, cols=True)
        yield f"token {fmt} {fmt} shared as token columns", lambda f=fmt, g=fp4: sass.compile_gemv(
            f, 2, 64, 2, 2, False, 128, 8, shared=f, tiled=True, gcol=g, cols=True)
    for fmt in ("nvfp4", "mxfp4"):
        yield f"one-launch pair {fmt} fp8 shared, pdl, x ready", lambda f=fmt: sass.compile_pair(
            f, "fp8", True, pdl=True, x_ready=True)
        yield f"one-launch pair {fmt} no shared", lambda f=fmt: sass.compile_pair(f, None, True)
        yield f"one-launch pair {fmt} fp8 shared as token columns, pdl, x ready", lambda f=fmt: sass.compile_pair(
            f, "fp8", True, pdl=True, x_ready=True, cols=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="write the fingerprints here (JSON)")
    ap.add_argument("--compare", help="fingerprints written before (JSON): exit 1 on any difference")
    ap.add_argument("--sass", help="also write each variant's K-loop SASS instructions, spill instructions in that "
                    "loop and in the kernel, and registers here (JSON): what to compare where the PTX moved")
    args = ap.parse_args()
    prints, counts = {}, {}
    for name, build in variants():
        kernel = build()
        prints[name] = hashlib.sha256(clean(kernel.asm["ptx"]).encode()).hexdigest()[:16]
        line = f"{prints[name]}  {name}"
        if args.sass:
            ops, spills, regs = sass.loop_counts(kernel.asm["cubin"])
            counts[name] = dict(loop=sum(ops.values()), loop_spills=ops["LDL"] + ops["STL"], spills=spills, regs=regs)
            line += f"  (loop {counts[name]['loop']}, spills in it {counts[name]['loop_spills']}, spills {spills}, " \
                    f"registers {regs})"
        print(line)
    if args.sass:
        Path(args.sass).write_text(json.dumps(counts, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(prints, indent=1))
    if args.compare:
        before = json.loads(Path(args.compare).read_text())
        changed = sorted(n for n in before.keys() | prints.keys() if before.get(n) != prints.get(n))
        print(f"{len(prints) - len(changed)} of {len(prints)} identical; changed: {changed or 'none'}")
        sys.exit(1 if changed else 0)


if __name__ == "__main__":
    main()
