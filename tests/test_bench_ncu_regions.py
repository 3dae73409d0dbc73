"""bench/lab/ncu_regions.py: stall samples split into the MMA K loops and the rest, on a hand-made `ncu --page source`
dump (two kernels; the first with an MMA loop, a loop without an MMA and an epilogue)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "lab"))

import ncu_regions  # noqa: E402

HEADER = '"Address","Source","Warp Stall Sampling (All Samples)","stall_long_sb","stall_barrier","stall_wait"\n'


def dump(tmp_path, kernels):
    text = ""
    for rows in kernels:
        text += '"Kernel Name","_gemv_kernel",\n' + HEADER
        text += "".join(f'"{a}","{src}","{s}","{lsb}","{bar}","{w}"\n' for a, src, s, lsb, bar, w in rows)
    path = tmp_path / "source.csv"
    path.write_text(text)
    return str(path)


def test_regions(tmp_path):
    k0 = [("0x1000", "LDC R1, c[0x0][0x28]", 10, 0, 0, 10),        # prologue
          ("0x1010", "LDS R4, [R2]", 30, 30, 0, 0),                  # MMA loop: 0x1010 .. 0x1030
          ("0x1020", "HMMA.16816.F32.BF16 R8, R4, R6, R8", 20, 0, 0, 20),
          ("0x1030", "@P0 BRA 0x1010", 10, 0, 0, 10),
          ("0x1040", "IADD3 R1, R1, 1", 5, 0, 0, 5),                 # a loop without an MMA: outside
          ("0x1050", "@P1 BRA 0x1040", 5, 0, 0, 5),
          ("0x1060", "BAR.SYNC.DEFER_BLOCKING 0x0", 20, 0, 20, 0)]   # epilogue
    k1 = [("0x2000", "HMMA.16816.F32.BF16 R8, R4, R6, R8", 7, 7, 0, 0), ("0x2010", "EXIT", 3, 0, 0, 3)]
    got = list(ncu_regions.kernels(dump(tmp_path, [k0, k1])))
    assert [len(k) for k in got] == [7, 2]
    assert ncu_regions.loops(got[0]) == [(1, 3)] and ncu_regions.loops(got[1]) == []
    s = ncu_regions.summary(got[0])
    assert s["K loops"][0] == 60 and s["outside"][0] == 40
    assert s["K loops"][1]["long_sb"] == 30 and s["outside"][1]["barrier"] == 20 and s["outside"][1]["wait"] == 20
