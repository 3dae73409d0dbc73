"""Question: When does each program of a GEMV launch start and end, on which SM (where is a launch's tail)?

Per-program timeline of the decode GEMV's launches: when each program of `gemv._gemv_kernel` starts and ends, and
on which SM.

    python bench/lab/timeline.py [--models flash,pro] [--tokens 1,2] [--dense wq_b:nvfp4:1] [--out DIR]

Cases: the MoE layer (routing, then `dispatch.moe(after_route=True)` with NVFP4 experts and an FP8 shared expert,
as `model.moe` runs it but without the Ops table's side stream, `dispatch.Side`, which V4-Pro's shared expert would
take from 4 tokens) at each token count, and dense linears (`dispatch.linear`, LINEAR:FORMAT:ROWS, `common.Shapes`
names). Each case runs as a CUDA graph of rotated calls; during one replay every program of every `_gemv_kernel`
launch records %globaltimer at its entry and exit, and its %smid (`_traced_gemv`, which calls the kernel itself
between the two reads: the code and the split plan `gemv_launch` runs, plus three stores). Per launch it prints
the programs, their start spread, duration and end quantiles (us from the call's first start), the span, the
weight bytes over the span as a share of the copy bandwidth, programs per SM, and the mean duration by a
program's rank among the programs on its SM (by program id, which is the order the hardware starts them in), and
the gaps between launches. Only `_gemv_kernel` launches are traced: where `moe_pair.launch_pair` runs the MoE pair
as one launch (from 3 tokens) the layer shows no launch.

Under programmatic dependent launch (the dense GEMVs; `GemvConfig.pdl`) a launch's programs start while the launch
before is still running and wait inside the kernel, so their durations include that wait, spans overlap, and the
time per call is the figure to read; the MoE pair's launches after routing start when its kernel lets them
(`gemv_launch.launch(x_ready=True)`), and its down launch runs under PDL at 1-2 tokens (`policy.DOWN_PDL_TOKENS`:
its programs then start during gate/up's tail and their durations include that wait), without it above.
%globaltimer counts ns and moved in steps of a few tens of ns on the H200 (its last three digits took 56-67 values
over about 2000 reads: bench/results/round-21.md, run 155).
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository: dsv4
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # bench: common
sys.path.insert(0, str(Path(__file__).resolve().parent))       # bench/lab: sass, timeline

from common import FLASH, PRO, Timer, bench_start, moe_decode_inputs, nbytes, random_qweight  # noqa: E402

from dsv4.kernels import dispatch, gemv, moe, refuse_fallback  # noqa: E402
from dsv4.kernels.host import Scratch  # noqa: E402
from dsv4.kernels.gemv import _gemv_kernel  # noqa: E402

RECORD = 3   # int64 per program: start ns, end ns, SM
RECORD_C = tl.constexpr(RECORD)


@triton.jit
def _timer():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _sm_id():
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit(do_not_specialize=["units"])
def _traced_gemv(io, units, w, sw, trace_ptr, L: tl.constexpr, F: tl.constexpr, FS: tl.constexpr):
    """`_gemv_kernel`'s arguments and trace_ptr (int64 [programs, RECORD]): the kernel between two timer reads."""
    start = _timer()
    _gemv_kernel(io, units, w, sw, L, F, FS)
    end = _timer()
    rec = trace_ptr + tl.program_id(0) * RECORD_C
    tl.store(rec, start)
    tl.store(rec + 1, end)
    tl.store(rec + 2, _sm_id().to(tl.int64))


class Recorder:
    """Stands in for `gemv._gemv_kernel` (`tracing`): launch i runs `_traced_gemv` into buffer i (int64, zeroed by
    the caller; launches past the last buffer are not traced). `warmup` (the split plan's resident CTAs) is the real
    kernel's, so that the plan is the one `kernels.gemv` runs."""

    def __init__(self, real, buffers: list[torch.Tensor]):
        self.real, self.buffers, self.launches = real, buffers, 0

    def warmup(self, *args, **kwargs):
        return self.real.warmup(*args, **kwargs)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            i = self.launches
            self.launches += 1
            if i >= len(self.buffers) or grid[0] * RECORD > self.buffers[i].numel():
                self.real[grid](*args, **kwargs)
                return
            _traced_gemv[grid](*args, self.buffers[i], **kwargs)
        return launch


@contextmanager
def tracing(buffers: list[torch.Tensor]):
    """`kernels.gemv`'s launches traced while inside (a `Recorder` in place of `gemv._gemv_kernel`)."""
    recorder = Recorder(gemv._gemv_kernel, buffers)
    gemv._gemv_kernel = recorder
    try:
        yield recorder
    finally:
        gemv._gemv_kernel = recorder.real


def launch_stats(trace: torch.Tensor, origin: int) -> dict:
    """One launch's records (int64 [programs, RECORD], program id order) -> its timeline in us from `origin` (ns)."""
    start, end, sm = (trace[:, i] for i in range(RECORD))
    dur = (end - start).double() / 1e3
    rel_end = (end - origin).double() / 1e3
    q = lambda t, p: float(torch.quantile(t, p))   # noqa: E731
    rank = torch.zeros_like(sm)
    for s in sm.unique():
        on = (sm == s).nonzero().flatten()   # program ids on SM s, increasing
        rank[on] = torch.arange(on.numel())
    per_sm = torch.bincount(sm)
    per_sm = per_sm[per_sm > 0]
    return dict(programs=int(trace.shape[0]), first_start=float(start.min() - origin) / 1e3,
                start_spread=float(start.max() - start.min()) / 1e3,
                duration=[q(dur, p) for p in (0.1, 0.5, 0.9)],
                end=[q(rel_end, p) for p in (0.1, 0.5, 0.9)] + [float(rel_end.max())],
                span=float(end.max() - start.min()) / 1e3, sms=int(per_sm.numel()),
                per_sm=[int(per_sm.min()), int(per_sm.max())],
                by_rank=[float(dur[rank == r].mean()) for r in range(int(rank.max()) + 1)])


def trace_case(label: str, calls, weight_bytes: list[float], timer: Timer, copy: float, programs: int = 4096):
    """Time `calls` (one CUDA graph), then trace one replay: per call its _gemv_kernel launches, `weight_bytes[j]`
    the bytes launch j reads. Prints a middle call's launches; returns every call's records."""
    plain = timer.per_call_ms(calls) * 1e3
    buffers = [torch.zeros(programs * RECORD, dtype=torch.int64, device="cuda") for _ in range(4 * len(calls))]
    with tracing(buffers) as rec:
        calls[0]()
        torch.cuda.synchronize()
        rec.launches = 0
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for c in calls:
                c()
        per_call = rec.launches // len(calls)
    if per_call * len(calls) > len(buffers):
        raise ValueError(f"{label}: {per_call} launches per call, trace_case holds 4")
    traced = triton.testing.do_bench(graph.replay, warmup=10, rep=60, return_mode="median") * 1e3 / len(calls)
    for b in buffers:
        b.zero_()
    graph.replay()
    torch.cuda.synchronize()
    traces = [b.view(-1, RECORD) for b in buffers[:per_call * len(calls)]]
    traces = [t[t[:, 1] > 0].cpu() for t in traces]
    print(f"{label}: {plain:.1f} us per call, {traced:.1f} traced; {per_call} traced launches per call", flush=True)
    if per_call == 0:
        print("   (no _gemv_kernel launch: the MoE pair ran as one launch)", flush=True)
        return []
    i = len(calls) // 2   # a middle call: the graph's first and last have no neighbour on one side
    mine = traces[i * per_call:(i + 1) * per_call]
    origin = int(mine[0][:, 0].min())
    previous_end = int(traces[i * per_call - 1][:, 1].max()) if i else origin
    print(f"   from the previous call's last program to this call's first: {(origin - previous_end) / 1e3:.2f} us",
          flush=True)
    last_end = None
    for j, t in enumerate(mine):
        if not t.numel():
            print(f"   launch {j}: not traced (more than {programs} programs)", flush=True)
            continue
        s = launch_stats(t, origin)
        gap = "" if last_end is None else f", {s['first_start'] - last_end:.2f} us after the launch before"
        share = weight_bytes[j] / (s["span"] * 1e-6) / 1e9 / copy if j < len(weight_bytes) else float("nan")
        print(f"   launch {j}: {s['programs']} programs on {s['sms']} SMs ({s['per_sm'][0]}-{s['per_sm'][1]} each), "
              f"start {s['first_start']:.2f} (+{s['start_spread']:.2f}){gap}; duration p10/50/90 "
              + "/".join(f"{v:.2f}" for v in s["duration"]) + "; end p10/50/90/max "
              + "/".join(f"{v:.2f}" for v in s["end"]) + f"; span {s['span']:.2f} us, "
              f"{100 * share:.0f} % of copy over it", flush=True)
        print("      mean duration by rank on its SM: " + " ".join(f"{v:.2f}" for v in s["by_rank"]), flush=True)
        last_end = s["end"][-1]
    return [t.tolist() for t in traces]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="flash,pro")
    ap.add_argument("--tokens", default="1,2", help="MoE layer token counts (\"\" for none)")
    ap.add_argument("--dense", default="wq_b:nvfp4:1", help="LINEAR:FORMAT:ROWS,... (\"\" for none)")
    ap.add_argument("--out", default="", help="a folder for the raw records (timeline.json)")
    args = ap.parse_args()
    dev, gen, timer, copy = bench_start(toy=False)
    scratch, rot, raw = Scratch(), 8, {}
    for s in [{"flash": FLASH, "pro": PRO}[m] for m in args.models.split(",")]:
        w13 = random_qweight("nvfp4", (s.E, 2), s.I, s.D, dev, gen)
        w2 = random_qweight("nvfp4", (s.E,), s.D, s.I, dev, gen)
        sw13 = random_qweight("fp8", (2,), s.I, s.D, dev, gen)
        sw2 = random_qweight("fp8", (), s.D, s.I, dev, gen)
        for T in [int(t) for t in args.tokens.split(",") if t]:
            xs, _, _, _, _, touched = moe_decode_inputs(s, T, rot, dev, gen)
            logits = [torch.randn(T, s.E, device=dev, generator=gen) for _ in range(rot)]
            bias = torch.zeros(s.E, device=dev)

            def layer(i):
                weights, ids = moe.route(logits[i], bias, s.k, 1.5)
                return dispatch.moe(xs[i], ids, weights, w13, w2, 10.0, shared=(sw13, sw2), after_route=True,
                                    scratch=scratch)

            up = touched * nbytes(w13) / s.E + nbytes(sw13)
            down = touched * nbytes(w2) / s.E + nbytes(sw2)
            label = f"{s.name} MoE layer T={T} (floor {(up + down) / copy / 1e3:.1f} us)"
            raw[label] = trace_case(label, [lambda i=i: layer(i) for i in range(rot)], [up, down], timer, copy)
        del w13, w2, sw13, sw2
        for spec in [d for d in args.dense.split(",") if d]:
            name, fmt, m = spec.split(":")
            n, k = s.linears()[name]
            ws = [random_qweight(fmt, (), n, k, dev, gen) for _ in range(rot)]
            x = torch.randn(int(m), k, device=dev, generator=gen).bfloat16()
            label = f"{s.name} {name} {fmt} M={m}"
            calls = [lambda w=w: dispatch.linear(x, w, fallback=refuse_fallback, scratch=scratch) for w in ws]
            raw[label] = trace_case(label, calls, [nbytes(ws[0])], timer, copy)
            del ws
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "timeline.json").write_text(json.dumps(raw))


if __name__ == "__main__":
    main()
