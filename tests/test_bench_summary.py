"""bench/summary.py writes RESULTS.md's current-figures table from a run's results.json: the right row for each
figure (best decode share per format at M <= 16, prefill range at the largest M, MoE shares in token order), and
`run_all.py --summary` prints it."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import summary  # noqa: E402


def linear_row(model, linear, fmt, m, us, pct_copy, speedup):
    return dict(model=model, linear=linear, fmt=fmt, M=m, us=us, pct_copy=pct_copy, speedup=speedup)


RESULTS = {
    "started": "2026-12-04 10:00:00",
    "command": "python bench/run_all.py --out /x",
    "env": {"torch": "2.11.0", "triton": "3.6.0", "device": "NVIDIA H200"},
    "correctness": [{"ok": True}, {"ok": True}, {"ok": False}],
    "linear": [
        linear_row("V4-Pro", "wq_b", "nvfp4", 1, 20.5, 65.2, 2.80),
        linear_row("V4-Pro", "wq_b", "nvfp4", 16, 21.8, 61.0, 2.68),
        linear_row("V4-Flash", "wo_b", "nvfp4", 1, 10.9, 40.0, 2.23),
        linear_row("V4-Pro", "wq_b", "fp8", 4, 30.0, 79.4, 1.93),
        linear_row("V4-Pro", "wq_b", "fp8", 64, 40.0, 90.0, 1.0),          # M > 16: not a decode row
        linear_row("V4-Pro", "wq_b", "nvfp4", 4096, 900.0, 0.0, 0.95),
        linear_row("V4-Flash", "indexer wq_b", "fp8", 4096, 100.0, 0.0, 0.87),
        linear_row("V4-Pro", "wo_b", "nvfp4", 4096, 800.0, 0.0, 1.00),
    ],
    "moe": [dict(model="V4-Flash", fmt="nvfp4", T=t, pct_floor=p) for t, p in ((8, 77.2), (1, 61.4), (2, 69.0))],
}


def test_each_figure_takes_its_row():
    rows = dict(summary.summary_rows(RESULTS))
    assert rows["Kernel correctness checks"] == "2 / 3 pass"
    assert rows["Prefill M = 4096: share of cuBLAS bf16 (3 shapes)"] == \
        "87-100 % (lowest: V4-Flash indexer wq_b fp8)"
    assert rows["Decode GEMV M <= 16, best share of copy: nvfp4"] == \
        "65 % (V4-Pro wq_b, M = 1, 20.5 us, 2.80x cuBLAS bf16)"
    assert rows["Decode GEMV M <= 16, best share of copy: fp8"].startswith("79 % (V4-Pro wq_b, M = 4,")
    assert rows["MoE decode layer, share of its byte floor: V4-Flash nvfp4"] == "61 / 69 / 77 % at 1 / 2 / 8 tokens"


def test_a_correctness_section_that_stopped_says_so():
    stopped = dict(RESULTS, errors=["correctness: Traceback ... CompilationError"])
    assert dict(summary.summary_rows(stopped))["Kernel correctness checks"] == \
        "2 / 3 pass; then a check raised and the section stopped (see the run's record)"


def test_run_all_prints_the_table_with_the_run_on_every_row(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(RESULTS))
    out = subprocess.run([sys.executable, "bench/run_all.py", "--summary", str(path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[:2] == ["| figure | measured | run |", "|---|---|---|"] and len(lines) == 2 + 5
    run = "2026-12-04, NVIDIA H200 (torch 2.11.0, triton 3.6.0), `python bench/run_all.py --out /x`"
    assert all(line.endswith(f"| {run} |") for line in lines[2:])
