"""The MoE benchmark scripts, the fused-tile sweep, the W4A4 table, the sampler's, mHC's, top-k's and the router's
timings, the engine's host time, a CSA layer's attention part and the persistent chain of products run end to end at
toy shapes on the CPU (`--toy`, Triton's interpreter).

They run on the GPU only a few times a session, so an API change in `dsv4.kernels` could otherwise break one unseen
until a device run fails and costs device time. Toy token counts cover both the GEMV pair over (token, slot) pairs
and over expert blocks (toy: 8 experts, top-2, blocks from 9 tokens). Timings at these shapes mean nothing; each
script must finish and print its per-case line. (What only a GPU shows is out of reach here: bench/RESULTS.md run
145 stopped on a host sync inside a CUDA graph capture, which the CPU never captures.)
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPTS = {
    "moe_blocks": ["bench/lab/moe_blocks.py", "--tokens", "12", "--rounds", "1"],
    "profile_shared": ["bench/lab/profile_shared.py", "--tokens", "1,12"],
    "profile_moe": ["bench/lab/profile_moe.py", "--tokens", "1", "--splits", "0"],
    "profile_tiles": ["bench/lab/profile_tiles.py", "--cases", "toy:expert w1/w3:nvfp4,toy:x_dense HCA:dense"],
    "profile_w4a4": ["bench/lab/profile_w4a4.py"],
    "profile_duplicates": ["bench/lab/profile_duplicates.py"],
    "run_all_moe": ["bench/run_all.py", "--sections", "env,moe"],
    "sampler": ["bench/lab/sampler.py"],
    "engine_host_time": ["bench/lab/engine_host_time.py"],
    "mhc": ["bench/lab/mhc.py"],
    "topk": ["bench/lab/topk.py"],
    "csa_part": ["bench/lab/csa_part.py"],
    "persistent_chain": ["bench/lab/persistent_chain.py", "--layers", "1"],
    "router": ["bench/lab/router.py"],
}

# `python SCRIPT ARGS` with the interpreter speed-up the suite has (tests/interpreter_speedup.py)
RUN_SCRIPT = """
import os, runpy, sys
sys.path[0] = "tests"   # `python -c` puts the working directory (the repository root) first
import interpreter_speedup
interpreter_speedup.install()
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))   # as `python SCRIPT` has it
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_bench_script_runs_at_toy_shapes(name, tmp_path):
    args = SCRIPTS[name] + ["--toy"]
    if name in ("moe_blocks", "run_all_moe", "sampler", "engine_host_time", "mhc", "topk", "persistent_chain",
                "router"):
        args += ["--out", str(tmp_path)]
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", RUN_SCRIPT, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(args)}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert any(line.startswith("toy") for line in proc.stdout.splitlines()), proc.stdout[-2000:]


def test_run_all_correctness_section_passes_at_toy_shapes(tmp_path):
    """bench/run_all.py's kernel checks (the ones a GPU run starts with) at toy shapes under the interpreter: every
    check runs and passes, so an API change shows here rather than in a device call."""
    import json

    args = ["bench/run_all.py", "--toy", "--sections", "env,correctness", "--out", str(tmp_path)]
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", RUN_SCRIPT, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    checks = json.loads((tmp_path / "results.json").read_text())["correctness"]
    assert len(checks) > 100 and [c["check"] for c in checks if not c["ok"]] == []
    assert any(c["check"].startswith("sampler") for c in checks) and any("fp8 keys" in c["check"] for c in checks)
    assert sum("packed fp8" in c["check"] or "fp8 rounding" in c["check"] for c in checks) == 5


def test_mhc_lab_refuses_an_unknown_variant_by_name():
    """`bench/lab/mhc.py --variants` takes VARIANTS' names (semicolons between them): a name it does not have stops
    the run before any timing, naming it, rather than timing fewer variants than asked."""
    args = ["bench/lab/mhc.py", "--toy", "--variants", "default;FMA plan;bf16x4"]
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", RUN_SCRIPT, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 2 and "unknown variants ['bf16x4']" in proc.stderr, proc.stderr[-2000:]
    assert not any(line.startswith("toy") for line in proc.stdout.splitlines())
