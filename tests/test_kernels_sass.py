"""The decode GEMV's K loop as the installed Triton compiles it for sm_90 (no GPU needed: Triton's own LLVM,
ptxas and cuobjdump, through `bench/lab/sass.py` in a subprocess without TRITON_INTERPRET).

The register-renaming layout trick (`gemv._k_order`, `gemv.MMA_K_WIDTH`) only pays if the decoded weights
reach the MMA without shuffles between threads. Triton 3.8 changed the bf16 mma.sync operand layout and the
loop grew from ~770 to ~1330 instructions per NVFP4 iteration (128 SHFL) until the K order followed it; a
Triton upgrade that breaks it again fails here instead of only on the GPU.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"^(\w+): (\d+) instructions per loop iteration = ([\d.]+) per weight element and thread; "
                  r"registers (\d+); spill instructions (\d+); shuffles (\d+);")


def sass_loops(*args: str) -> dict:
    """`bench/lab/sass.py` for sm_90 on the installed Triton (a subprocess without TRITON_INTERPRET, tiled weights,
    MMA N = 8): its line per format, parsed by LINE."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "lab" / "sass.py"), *args, "--mp", "8", "--tiled"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    found = {m.group(1): m for m in map(LINE.match, proc.stdout.splitlines()) if m}
    formats = {a for a in args if not a.startswith("-")}
    assert set(found) == formats, \
        f"bench/lab/sass.py {' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return found


@pytest.fixture(scope="module")
def loops():
    return sass_loops("nvfp4", "mxfp4", "fp8")


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp8"])
def test_decode_loop_has_no_shuffles_and_no_spills(loops, fmt):
    m = loops[fmt]
    assert int(m.group(6)) == 0, f"{fmt}: {m.group(6)} SHFL in the K loop (the K order no longer matches)"
    assert int(m.group(5)) == 0, f"{fmt}: {m.group(5)} spill instructions"
    # about 3 instructions per weight element (Triton 3.6-3.9: 2.78-3.02); the broken layout cost 4.5-5.2
    assert float(m.group(3)) < 3.3, m.group(0)


def test_group_column_loop_has_no_shuffles_no_spills_and_fewer_instructions(loops):
    """The group-column K loop (`GemvConfig.group_cols`, FP4, one x row) drops the multiply per weight pair:
    no shuffles or spills, and fewer instructions per element than the default loop (Triton 3.6: 702 against
    773 per NVFP4 iteration; 3.9: 694 against 767)."""
    for fmt, m in sass_loops("nvfp4", "mxfp4", "--gcol").items():
        assert int(m.group(6)) == 0 and int(m.group(5)) == 0, m.group(0)
        assert int(m.group(2)) < 0.95 * int(loops[fmt].group(2)), (m.group(0), loops[fmt].group(0))


def test_dense_tiles_compile_with_a_pipelined_loop_and_no_spills():
    """The fused tiles' bf16 path (`policy._plan_dense`, reached where a TileConfig is forced) at the plan V4-Flash's
    x_dense gets at batch 1 (BM 16, BN 64, BK 128, split-K, 8 warps, 3 stages): it compiles for sm_90, its weight
    tiles stream through cp.async (LDGSTS) into the MMAs, and nothing spills."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "lab" / "sass.py"), "dense", "--qgemm", "--bn", "64",
                           "--warps", "8", "--stages", "3"], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=900)
    m = re.search(r"^dense tiles: (\d+) instructions per loop iteration; registers (\d+); spill instructions (\d+);"
                  r".*$", proc.stdout, re.M)
    assert m, f"bench/lab/sass.py dense --qgemm failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert int(m.group(3)) == 0 and "'HMMA'" in m.group(0) and "'LDGSTS'" in m.group(0), m.group(0)
