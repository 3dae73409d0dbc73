"""The current-figures table of bench/RESULTS.md, written from a run's results.json (never copied by hand).

    python bench/run_all.py --summary bench/out/results.json     # prints the markdown table

One row per figure the README and RESULTS.md quote: correctness, prefill as a share of cuBLAS bf16 at the largest
row count, the decode GEMV's best share of copy bandwidth per format (M <= 16), and the MoE decode layer's share of
its byte floor per model, format and token count. Each row names the run's date, device and command.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

DECODE_ROWS = 16            # the decode GEMV's rows: M <= 16


def _run_label(res: dict) -> str:
    env = res.get("env", {})
    device = env.get("device", "cpu (toy)")
    versions = ", ".join(f"{k} {env[k]}" for k in ("torch", "triton") if k in env)
    command = res.get("command", "python bench/run_all.py")
    return f"{res.get('started', '?')[:10]}, {device} ({versions}), `{command}`"


def _prefill(rows: list[dict]) -> list[tuple[str, str]]:
    if not rows:
        return []
    m = max(r["M"] for r in rows)
    if m <= DECODE_ROWS:
        return []
    at = [r for r in rows if r["M"] == m]
    low = min(at, key=lambda r: r["speedup"])
    high = max(r["speedup"] for r in at)
    return [(f"Prefill M = {m}: share of cuBLAS bf16 ({len(at)} shapes)",
             f"{100 * low['speedup']:.0f}-{100 * high:.0f} % (lowest: {low['model']} {low['linear']} {low['fmt']})")]


def _decode(rows: list[dict]) -> list[tuple[str, str]]:
    best: dict[str, dict] = {}
    for r in rows:
        if r["M"] <= DECODE_ROWS and r["pct_copy"] > best.get(r["fmt"], {}).get("pct_copy", -1):
            best[r["fmt"]] = r
    return [(f"Decode GEMV M <= {DECODE_ROWS}, best share of copy: {fmt}",
             f"{r['pct_copy']:.0f} % ({r['model']} {r['linear']}, M = {r['M']}, {r['us']:.1f} us, "
             f"{r['speedup']:.2f}x cuBLAS bf16)") for fmt, r in sorted(best.items())]


def _moe(rows: list[dict]) -> list[tuple[str, str]]:
    by_case: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in rows:
        by_case[(r["model"], r["fmt"])].append(r)
    out = []
    for (model, fmt), rs in by_case.items():
        rs.sort(key=lambda r: r["T"])
        tokens = " / ".join(str(r["T"]) for r in rs)
        shares = " / ".join(f"{r['pct_floor']:.0f}" for r in rs)
        out.append((f"MoE decode layer, share of its byte floor: {model} {fmt}", f"{shares} % at {tokens} tokens"))
    return out


def summary_rows(res: dict) -> list[tuple[str, str]]:
    """(figure, value) rows of one run's results, in the table's order."""
    rows = []
    checks = res.get("correctness", [])
    stopped = [e.split(":", 1)[0] for e in res.get("errors", [])]
    if checks or "correctness" in stopped:
        value = f"{sum(c['ok'] for c in checks)} / {len(checks)} pass"
        if "correctness" in stopped:           # a check raised: the ones after it never ran
            value += "; then a check raised and the section stopped (see the run's record)"
        rows.append(("Kernel correctness checks", value))
    linear = res.get("linear", [])
    return rows + _prefill(linear) + _decode(linear) + _moe(res.get("moe", []))


def markdown(res: dict) -> str:
    run = _run_label(res)
    lines = ["| figure | measured | run |", "|---|---|---|"]
    lines += [f"| {what} | {value} | {run} |" for what, value in summary_rows(res)]
    return "\n".join(lines)


def main(path: str | Path) -> None:
    print(markdown(json.loads(Path(path).read_text())))
