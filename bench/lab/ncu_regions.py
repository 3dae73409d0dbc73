"""Question: Where do a GEMV launch's warps wait: in the MMA K loops, or in the prologue, epilogue and split-K sum?

Where a GEMV launch's warps wait: Nsight Compute's per-instruction stall samples split into the K loops (the
backward branches whose body holds an MMA) and everything else (a unit's prologue, its epilogue and the split-K
sum), each with its main stall reasons.

    ncu --clock-control none -k regex:_gemv_kernel -c 8 --section SourceCounters -o moe -f \\
        python bench/lab/profile_moe.py --once --tokens 1,8
    ncu -i moe.ncu-rep --page source --print-source sass --csv > source.csv
    python bench/lab/ncu_regions.py source.csv [--names "Flash up 1,Flash down 1,..."]

`profile_moe.py --once` launches, per model (V4-Flash, then V4-Pro) and per token count, gate/up then down: the
kernels in the report come in that order.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import re
from collections import Counter


def kernels(path: str):
    """Each profiled kernel's rows (dicts by column name) from an `ncu --page source --csv` dump."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows, header = [], None
        for rec in csv.reader(f):
            if rec and rec[0] == "Kernel Name":
                if rows:
                    yield rows
                rows, header = [], None
            elif rec and rec[0] == "Address":
                header = rec
            elif header and rec:
                rows.append(dict(zip(header, rec)))
        if rows:
            yield rows


def loops(rows: list[dict]) -> list[tuple[int, int]]:
    """(first, last) row indices of every loop whose body holds an MMA, innermost ones only."""
    addr = [int(r["Address"], 16) for r in rows]
    index = {a: i for i, a in enumerate(addr)}
    found = []
    for i, r in enumerate(rows):
        m = re.search(r"BRA\s+(0x[0-9a-f]+)", r["Source"])
        if not m:
            continue
        target = int(m.group(1), 16)
        # targets are printed relative to the function start: match by offset from the first instruction
        j = index.get(target) if target in index else index.get(addr[0] + target)
        if j is not None and j < i and any("MMA" in rows[k]["Source"] for k in range(j, i + 1)):
            found.append((j, i))
    return [(a, b) for a, b in found if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in found)]


def summary(rows: list[dict]) -> dict:
    stall_cols = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
    in_loop = [False] * len(rows)
    for a, b in loops(rows):
        for k in range(a, b + 1):
            in_loop[k] = True
    out = {}
    for name, pick in (("K loops", True), ("outside", False)):
        sel = [r for r, flag in zip(rows, in_loop) if flag == pick]
        samples = sum(int(r["Warp Stall Sampling (All Samples)"] or 0) for r in sel)
        reasons = Counter()
        for r in sel:
            for c in stall_cols:
                reasons[c.removeprefix("stall_")] += int(r[c] or 0)
        out[name] = (samples, reasons)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("source_csv")
    ap.add_argument("--names", default="", help="comma-separated labels of the kernels, in report order")
    args = ap.parse_args()
    names = args.names.split(",") if args.names else []
    for n, rows in enumerate(kernels(args.source_csv)):
        s = summary(rows)
        total = sum(v[0] for v in s.values()) or 1
        label = names[n] if n < len(names) else f"kernel {n}"
        parts = []
        for region, (samples, reasons) in s.items():
            top = ", ".join(f"{k} {100 * v / max(samples, 1):.0f}%" for k, v in reasons.most_common(4))
            parts.append(f"{region} {100 * samples / total:4.1f}% ({top})")
        print(f"{label:16s} samples {total:6d}: " + "; ".join(parts))


if __name__ == "__main__":
    main()
