"""Programmatic dependent launch in the decode GEMV (`GemvConfig.pdl`).

The interpreter cannot run `griddepcontrol`, and CI has no GPU, so these tests compile `_gemv_kernel` for
sm_90 (Triton's own LLVM; no GPU needed; `bench/sass.py`) in a subprocess without TRITON_INTERPRET, and read
its PTX: with PDL the kernel must trigger the next launch and must wait for the previous kernel before its
first global load (x, ids, scratch), store or atomic. Only L2 prefetches of weight bytes may come before the
wait. The H200 check that a chain of dependent GEMVs gives the same bits with and without PDL is in
bench/run_all.py.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv4.kernels import gemv

ROOT = Path(__file__).resolve().parents[1]

# compiles the kernel (NVFP4 routed weights, 2 warps, MMA N = 8; an FP8 shared expert where asked) through
# bench/sass.py's compile_gemv and prints, per case, the PTX lines that matter
_COMPILE = r"""
import json, re, sys
sys.path.insert(0, "bench")
import sass

MEMORY = re.compile(r"\b(ld\.global|cp\.async|st\.global|atom\.|red\.|ld\.volatile)")
out = {}
for name, rows, pdl, tiled, shared in json.loads(sys.argv[1]):
    k = sass.compile_gemv("nvfp4", 2, 64, 2, rows, rows == 1, 128, mp=8, shared="fp8" if shared else None,
                          tiled=tiled, pdl=pdl)
    lines = [l.strip() for l in k.asm["ptx"].splitlines()]
    first = lambda pred: next((i for i, l in enumerate(lines) if pred(l)), None)
    out[name] = dict(trigger=first(lambda l: "griddepcontrol.launch_dependents" in l),
                     wait=first(lambda l: "griddepcontrol.wait" in l),
                     memory=first(lambda l: MEMORY.search(l) is not None and not l.startswith("//")),
                     prefetch=first(lambda l: "prefetch.global.L2" in l),
                     launch_pdl=bool(k.metadata.launch_pdl))
print("RESULT " + json.dumps(out))
"""

CASES = [("dense tiled", 0, True, True, False), ("dense row-major", 0, True, False, False),
         ("moe pair + shared", 1, True, True, True), ("moe token", 2, True, True, False),
         ("dense tiled, no pdl", 0, False, True, False)]


@pytest.fixture(scope="module")
def ptx():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(CASES)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert line is not None, f"sm_90 compile failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("case", [c[0] for c in CASES if c[2]])
def test_pdl_waits_before_the_first_global_access(ptx, case):
    r = ptx[case]
    assert r["launch_pdl"], "the kernel must be launched with the PDL attribute"
    assert r["trigger"] is not None and r["wait"] is not None, r
    assert r["memory"] is not None, "no global memory access found: the PTX scan is broken"
    assert r["trigger"] < r["wait"] < r["memory"], r


def test_pdl_prefetches_only_dense_tiled_units_before_the_wait(ptx):
    assert ptx["dense tiled"]["prefetch"] is not None and ptx["dense tiled"]["prefetch"] < ptx["dense tiled"]["wait"]
    # row-major weights and the MoE modes (whose expert ids another kernel writes) prefetch nothing
    for case in ("dense row-major", "moe pair + shared", "moe token"):
        assert ptx[case]["prefetch"] is None, case


def test_no_pdl_means_no_griddepcontrol(ptx):
    r = ptx["dense tiled, no pdl"]
    assert r["trigger"] is None and r["wait"] is None and r["prefetch"] is None and not r["launch_pdl"]


@pytest.mark.parametrize("bad", [3, 6, -1])
def test_pdl_prefetch_must_be_a_power_of_two(bad):
    with pytest.raises(ValueError, match="pdl_l2"):
        gemv.GemvConfig(pdl_l2=bad)
    assert gemv.GemvConfig(pdl_l2=0).pdl_l2 == 0 and gemv.GemvConfig(pdl_l2=8).pdl_l2 == 8


def test_pdl_is_off_where_it_cannot_run():
    cfg = gemv.GemvConfig()
    assert cfg.pdl, "PDL is the default"
    assert not gemv.pdl_enabled(cfg, torch.device("cpu"))
    assert not gemv.pdl_enabled(gemv.GemvConfig(pdl=False), torch.device("cpu"))
