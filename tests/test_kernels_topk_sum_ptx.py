"""The fused top-k sum (`gemm._topk_sum`) as the installed Triton compiles it for sm_90 (no GPU needed; a
subprocess without TRITON_INTERPRET, through `bench/lab/sass.py`).

The CPU tests run programs one after another, so they cannot see whether the program that sums a token's rows
sees the rows other programs wrote. That rests on the order of the PTX, checked here: the routed rows are
stored, then a CTA barrier, then the semaphore's add (acquire-release, GPU scope); its result reaches every
thread that holds a replica of the row through shared memory and a barrier; the rows are then read past L1
(`ld.global.cg`); the semaphore is re-armed only after the sum rows are stored.
"""

import pytest

from kernel_util import compile_in_subprocess

_COMPILE = r"""
import json, sys
sys.path.insert(0, "bench/lab")
import sass
from dsv4.kernels import gemm
out = {}
for name, bm, split in json.loads(sys.argv[1]):
    k = sass.compile_qgemm("nvfp4", gemm.ROWS_SORTED, gemm.EPI_ROUTED_SUM, bm=bm, split=split)
    out[name] = [l.split("//")[0].strip() for l in k.asm["ptx"].splitlines() if l.split("//")[0].strip()]
print("RESULT " + json.dumps(out))
"""

CASES = [("sorted, 16 rows", 16, False), ("sorted, 64 rows, split-K", 64, True)]


@pytest.fixture(scope="module")
def ptx():
    return compile_in_subprocess(_COMPILE, CASES)


def first(lines, pred, start=0):
    return next(i for i in range(start, len(lines)) if pred(lines[i]))


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_the_last_arrival_sees_every_row(ptx, case):
    lines = ptx[case]
    sem = [i for i, l in enumerate(lines) if "atom.global.gpu.acq_rel.add" in l]
    assert len(sem) == 1 + case.endswith("split-K"), sem   # (split-K's own semaphore comes first)
    add = sem[-1]
    # the routed fp32 rows are stored before the add, with a CTA barrier between the last store and the add
    last_row_store = max(i for i in range(add) if lines[i].lstrip("@%p0123456789 ").startswith("st.global"))
    assert any(lines[i].startswith("bar.sync") for i in range(last_row_store, add)), lines[last_row_store:add + 1]
    # the add's result goes to the row's replicas through shared memory and a barrier before any row is read
    first_read = first(lines, lambda l: "ld.global" in l, add)
    between = lines[add:first_read]
    assert any("st.shared" in l for l in between) and any(l.startswith("bar.sync") for l in between), between
    # every global read after the add bypasses L1 (the rows other CTAs wrote)
    reads = [l for l in lines[add:] if "ld.global" in l]
    assert reads and all(".cg" in l or ".acquire" in l for l in reads), [l for l in reads if ".cg" not in l][:4]
    # re-armed after the sum rows are stored
    rearm = first(lines, lambda l: "atom.global.gpu.relaxed.exch" in l, add)
    assert any("st.global" in l for l in lines[first_read:rearm]), "the sum rows must be stored before the re-arm"
