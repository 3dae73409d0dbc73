"""Question: Where does a batch-1 attention launch's time go: its prologue, its key blocks, or its epilogue?

At batch 1 a sliding-window layer's attention launch takes 13-17 us for 128 keys (bench/lab/attention_plans.py,
bench/results/round-42.md), whatever the plan. This runs `_attention_kernel`'s ring path (decode, no key split, the
ring written first) as a copy with %clock64 stamps between its phases, each stamp taken after a value the phase
computed (the step's columns; the queries, when asked; each key block's running sum; the output), and %globaltimer
at the program's start and end, for a few (heads a program, keys a block, warps) plans at V4-Flash's shape: 64 heads
of 512, a window of 128. "launch" is one call timed in a CUDA graph (`common.Timer`), so it includes a graph launch.

    python bench/lab/attention_timeline.py     # on the GPU (inline PTX)

Prints, per plan and program, the cycles of each phase.
"""

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository: dsv4
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # bench: common

from common import Timer  # noqa: E402

from dsv4.kernels.attention import _online  # noqa: E402
from dsv4.kernels.steps import StepTokens  # noqa: E402


@triton.jit
def _clock(dep):
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,f", [dep], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _gtime(dep):
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,f", [dep], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _timeline_kernel(q_ptr, kv_ptr, ring_ptr, out_ptr, sinks_ptr, seq_ptr, pos_ptr, slot_ptr, start_ptr, stamps,
                     scale, H, W: tl.constexpr, D: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr,
                     DOT: tl.constexpr, TOUCH_Q: tl.constexpr):
    """`_attention_kernel`'s ring path for token t, heads of block hb, with stamps in stamps[program, 16]: clocks
    at 0-2 (start, the step's columns, the queries), 3.. (after each key block), 12-13 (the output, its store);
    globaltimer at 14-15 (start, end)."""
    t, hb = tl.program_id(0), tl.program_id(1)
    row = stamps + (t * tl.num_programs(1) + hb) * 16
    z = tl.zeros([], tl.float32)
    g0 = _gtime(z)
    c0 = _clock(z)
    b = tl.load(seq_ptr + t)
    p = tl.load(pos_ptr + t)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    start = tl.load(start_ptr + b)
    c1 = _clock((slot + start + p).to(tl.float32))
    h = hb * BH + tl.arange(0, BH)
    d = tl.arange(0, D)
    tl.store(ring_ptr + slot * W * D + (p % W) * D + d, tl.load(kv_ptr + t.to(tl.int64) * D + d))
    q = tl.load(q_ptr + t.to(tl.int64) * H * D + h[:, None] * D + d[None, :], mask=(h < H)[:, None], other=0.0)
    if TOUCH_Q:
        c2 = _clock(tl.sum(tl.sum(q.to(tl.float32), axis=1), axis=0))
    else:
        c2 = _clock(z)
    acc = tl.zeros([BH, D], tl.float32)
    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    lo = p - W
    i = 0
    for r0 in range(0, W, BK):
        r = r0 + tl.arange(0, BK)
        back = start - 1 - r
        held = tl.where(back >= 0, start - 1 - back % W, -1)
        valid = (held >= 0) & (held > lo)
        k = tl.load(ring_ptr + slot * W * D + r[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
        acc, m_i, l_i = _online(acc, m_i, l_i, q, k, valid, scale, DOT)
        ci = _clock(tl.sum(l_i, axis=0))
        tl.store(row + 3 + i, ci)
        i += 1
    sink = tl.load(sinks_ptr + h, mask=h < H, other=0.0)
    o = acc / (l_i + tl.exp(sink - m_i))[:, None]
    c8 = _clock(tl.sum(tl.sum(o, axis=1), axis=0))
    tl.store(out_ptr + t.to(tl.int64) * H * D + h[:, None] * D + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=(h < H)[:, None])
    c9 = _clock(z)
    g9 = _gtime(tl.sum(tl.sum(o, axis=1), axis=0))
    tl.store(row + 0, c0)
    tl.store(row + 1, c1)
    tl.store(row + 2, c2)
    tl.store(row + 12, c8)
    tl.store(row + 13, c9)
    tl.store(row + 14, g0)
    tl.store(row + 15, g9)


def main():
    if not torch.cuda.is_available():
        sys.exit("attention_timeline.py reads the GPU's clocks: it needs a GPU")
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    H, D, W = 64, 512, 128
    ctx = 8192
    steps = StepTokens.build((0,), (ctx - 1,), (1,), [tuple(range(32))], dev)
    q = torch.randn(1, H, D, device=dev, generator=g).bfloat16()
    kv = torch.randn(1, D, device=dev, generator=g).bfloat16()
    ring = torch.randn(2, W, D, device=dev, generator=g).bfloat16()
    sinks = torch.randn(H, device=dev, generator=g)
    out = torch.empty_like(q)
    timer = Timer(dev)
    for bh, bk, warps in ((32, 64, 8), (16, 64, 4), (16, 32, 4), (64, 32, 8), (8, 64, 4)):
        for touch in (False, True):
            stamps = torch.zeros(H // bh, 16, dtype=torch.int64, device=dev)

            def launch():
                _timeline_kernel[(1, H // bh)](q, kv, ring, out, sinks, steps.seq, steps.pos, steps.slot, steps.start,
                                               stamps, D ** -0.5, H, W=W, D=D, BH=bh, BK=bk, DOT=tl.bfloat16,
                                               TOUCH_Q=touch, num_warps=warps)
            launch(); torch.cuda.synchronize()
            us = 1e3 * timer.per_call_ms([launch])
            launch(); torch.cuda.synchronize()
            s = stamps.cpu()
            for pr in range(min(2, s.shape[0])):
                c = s[pr].tolist()
                blocks = [c[3 + i] for i in range(W // bk)]
                marks = [c[0], c[1], c[2], *blocks, c[12], c[13]]
                deltas = [marks[i + 1] - marks[i] for i in range(len(marks) - 1)]
                print(f"bh {bh} bk {bk} warps {warps} touch_q {int(touch)} prog {pr}: launch {us:.1f} us; in-kernel "
                      f"{(c[15] - c[14]) / 1e3:.2f} us (globaltimer), {c[13] - c[0]} cycles: meta {deltas[0]}, q "
                      f"{deltas[1]}, blocks {deltas[2:2 + len(blocks)]}, finish {deltas[-2]}, store {deltas[-1]}",
                      flush=True)


if __name__ == "__main__":
    main()
