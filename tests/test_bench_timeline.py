"""bench/lab/timeline.py, the per-program timeline of the decode GEMV's launches: its traced kernel must stay the kernel
`kernels.gemv` runs (same arguments, same code plus the timer reads), its stand-in must trace only what it has room
for and always put the real kernel back, and its statistics must say what the records say. The GPU run itself is in
bench/RESULTS.md (the interpreter cannot read %globaltimer)."""

import inspect
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "lab"))

import timeline  # noqa: E402

from dsv4.kernels import gemv  # noqa: E402
from kernel_util import compile_in_subprocess  # noqa: E402


def _params(fn):
    """(name, annotation, default) of a Triton function's parameters, interpreted or compiled alike."""
    return [(p.name, str(p.annotation), p.default) for p in inspect.signature(fn.fn).parameters.values()]


def _no_specialize(fn):
    """The do_not_specialize names its decorator got (`kwargs` under the interpreter)."""
    return set(getattr(fn, "do_not_specialize", None) or fn.kwargs.get("do_not_specialize", ()))


def test_traced_kernel_takes_the_kernels_arguments_and_a_trace():
    """Every argument of `_gemv_kernel` in its place (constexprs and their defaults included), then trace_ptr before
    the constexprs; the same runtime arguments left unspecialized."""
    real, traced = _params(gemv._gemv_kernel), _params(timeline._traced_gemv)
    first_const = next(i for i, p in enumerate(real) if "constexpr" in p[1])
    trace = ("trace_ptr", str(inspect.Parameter.empty), inspect.Parameter.empty)
    assert traced == real[:first_const] + [trace] + real[first_const:]
    assert _no_specialize(timeline._traced_gemv) == _no_specialize(gemv._gemv_kernel) != set()


_COMPILE = r"""
import json, sys
sys.path.insert(0, "bench/lab")
import sass, timeline
from dsv4.kernels import gemv
out = {}
for name, fn in (("real", gemv._gemv_kernel), ("traced", timeline._traced_gemv)):
    ptx = sass.compile_gemv("nvfp4", 2, 64, 2, 2, False, 128, mp=8, shared="fp8", tiled=True, pdl=True, gcol=True,
                            fn=fn).asm["ptx"]
    out[name] = {k: ptx.count(k) for k in ("%globaltimer", "%smid", "mma.sync", "griddepcontrol", "atom.", "st.global")}
print("RESULT " + json.dumps(out))
"""


def test_traced_kernel_is_the_kernel_between_two_timer_reads():
    """Compiled for sm_90 (no GPU needed) as the MoE down launch with a shared expert and PDL: the traced kernel has
    the kernel's MMAs, PDL instructions and atomics, plus two timer reads, an SM id and three more stores."""
    r = compile_in_subprocess(_COMPILE, [])
    real, traced = r["real"], r["traced"]
    assert real["%globaltimer"] == real["%smid"] == 0 and real["mma.sync"] > 0, real
    assert traced["%globaltimer"] == 2 and traced["%smid"] == 1, traced
    for k in ("mma.sync", "griddepcontrol", "atom."):
        assert traced[k] == real[k], (k, real, traced)
    assert traced["st.global"] == real["st.global"] + 3, (real, traced)


class _FakeKernel:
    def __init__(self):
        self.calls = []

    def warmup(self, *args, **kwargs):
        return ("warmup", args, kwargs)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


def test_recorder_traces_what_fits_and_leaves_the_rest_to_the_kernel(monkeypatch):
    launched = []
    monkeypatch.setattr(timeline, "_traced_gemv", type("T", (), {
        "__getitem__": lambda self, grid: lambda *a, **k: launched.append((grid, a[-1].numel(), k))})())
    real = _FakeKernel()
    rec = timeline.Recorder(real, [torch.zeros(2 * timeline.RECORD, dtype=torch.int64)])
    assert rec.warmup(1, grid=(1,), FMT=3) == ("warmup", (1,), {"grid": (1,), "FMT": 3})   # the real kernel's plan
    rec[(2,)]("x", FMT=3)       # fits buffer 0: traced, the buffer appended to the arguments
    rec[(1,)]("y", FMT=3)       # no buffer left: the real kernel
    assert launched == [((2,), 2 * timeline.RECORD, {"FMT": 3})]
    assert real.calls == [((1,), ("y",), {"FMT": 3})] and rec.launches == 2
    rec2 = timeline.Recorder(real, [torch.zeros(timeline.RECORD, dtype=torch.int64)])
    rec2[(2,)]("z")             # more programs than the buffer holds: not traced
    assert real.calls[-1] == ((2,), ("z",), {}) and len(launched) == 1


def test_tracing_puts_the_real_kernel_back():
    real = gemv._gemv_kernel
    with pytest.raises(RuntimeError):
        with timeline.tracing([]) as rec:
            assert gemv._gemv_kernel is rec and rec.real is real
            raise RuntimeError("inside")
    assert gemv._gemv_kernel is real


def test_launch_stats_read_the_records():
    """Two SMs: programs 0, 2 on SM 5 and 1, 3 on SM 7; ns from the origin 1000."""
    o = 1000
    trace = torch.tensor([[o + 0, o + 4000, 5], [o + 100, o + 5000, 7], [o + 200, o + 8200, 5],
                          [o + 300, o + 9300, 7]], dtype=torch.int64)
    s = timeline.launch_stats(trace, o)
    assert s["programs"] == 4 and s["sms"] == 2 and s["per_sm"] == [2, 2]
    assert s["first_start"] == 0.0 and s["start_spread"] == pytest.approx(0.3)
    assert s["span"] == pytest.approx(9.3) and s["end"][-1] == pytest.approx(9.3)
    assert s["by_rank"] == pytest.approx([(4.0 + 4.9) / 2, (8.0 + 9.0) / 2])   # first vs second program on each SM
    assert s["duration"][1] == pytest.approx(float(torch.tensor([4.0, 4.9, 8.0, 9.0]).double().quantile(0.5)))
