"""Question: How fast can a kernel only *read* a weight-sized buffer? The ceiling any decode GEMV works under.

    python bench/lab/profile_read.py [--mb 4.7,16.8,56.6,117.4] [--pdl off,wait,overlap] [--loader cp,tma] [--out DIR]

A grid of G programs streams the buffer in contiguous chunks of CH bytes per loop iteration (each program one
contiguous slice of whole chunks; G = programs per SM x SMs, fewer when the buffer has fewer chunks), XOR-
reducing the words so that no load can be dropped; swept over CH, warps, pipeline stages and programs per SM,
beside torch's copy of the same bytes. The bytes read are the buffer size rounded down to whole chunks per
program (reported). Buffers rotate past the L2.

Loaders: `cp` is a pointer load (Triton's pipeliner turns it into cp.async into shared memory when stages > 1);
`tma` reads the same chunk as one tensor-memory-accelerator box of CH / 128 rows of 128 bytes (a host
`TensorDescriptor`; the pipeliner issues the boxes STAGES - 1 iterations ahead on mbarriers).

PDL (programmatic dependent launch; the timer replays the reads back to back): `off` plain launches; `wait` lets
the next read launch at the start of the current one and makes it wait before it reads; `overlap` makes it wait
only before its single store, so its reads overlap the current one's tail.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository: dsv4
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # bench: common
sys.path.insert(0, str(Path(__file__).resolve().parent))       # bench/lab: sass, timeline

from common import Timer, copy_bandwidth, rotations  # noqa: E402


@triton.jit
def _pdl_start(PDL: tl.constexpr):
    """PDL "wait" and "overlap": let the next launch start now; "wait": wait for the previous kernel before reading."""
    if PDL > 0:
        gdc_launch_dependents()
    if PDL == 1:
        gdc_wait()


@triton.jit
def _pdl_before_store(PDL: tl.constexpr):
    """PDL "overlap": the reads overlapped the previous kernel; wait for it before the only store."""
    if PDL == 2:
        gdc_wait()


@triton.jit
def _stream_kernel(ptr, out_ptr, words_per_prog, CW: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    _pdl_start(PDL)
    base = ptr.to(tl.pointer_type(tl.uint32)) + pid.to(tl.int64) * words_per_prog
    acc = tl.zeros((CW,), dtype=tl.uint32)
    for i in tl.range(0, words_per_prog, CW, num_stages=STAGES):
        acc ^= tl.load(base + i + tl.arange(0, CW))
    _pdl_before_store(PDL)
    tl.store(out_ptr + pid, tl.xor_sum(acc, axis=0))


@triton.jit
def _stream_tma_kernel(desc, out_ptr, rows_per_prog, BR: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    """_stream_kernel through TMA: the buffer as int32 [rows, 32], BR rows (BR * 128 bytes) per iteration."""
    pid = tl.program_id(0)
    _pdl_start(PDL)
    r0 = pid * rows_per_prog
    acc = tl.zeros((BR, 32), dtype=tl.int32)
    for i in tl.range(0, rows_per_prog, BR, num_stages=STAGES):
        acc ^= desc.load([r0 + i, 0])
    _pdl_before_store(PDL)
    tl.store(out_ptr + pid, tl.xor_sum(tl.xor_sum(acc, axis=1), axis=0))


def stream(loader, buf, out, g, words, ch, stages, pdl, warps):
    """One launch of the loader's read kernel over g programs of `words` 32-bit words each."""
    if loader == "tma":
        desc = TensorDescriptor.from_tensor(buf.view(torch.int32).view(-1, 32), [ch // 128, 32])
        _stream_tma_kernel[(g,)](desc, out, words // 32, BR=ch // 128, STAGES=stages, PDL=PDL_MODES[pdl],
                                 num_warps=warps, launch_pdl=pdl != "off")
    else:
        _stream_kernel[(g,)](buf, out, words, CW=ch // 4, STAGES=stages, PDL=PDL_MODES[pdl], num_warps=warps,
                             launch_pdl=pdl != "off")


PDL_MODES = {"off": 0, "wait": 1, "overlap": 2}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", default="4.7,16.8,56.6,117.4")
    ap.add_argument("--chunks", default="2048,4096,8192,16384")
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--stages", default="2,3,4")
    ap.add_argument("--per-sm", default="4,8,16")
    ap.add_argument("--pdl", default="off", help="comma list of off, wait, overlap (see the module docstring)")
    ap.add_argument("--loader", default="cp", help="comma list of cp, tma (see the module docstring)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    timer = Timer(dev)
    copy = copy_bandwidth(dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"copy bandwidth {copy:.0f} GB/s, {sms} SMs", flush=True)
    rows = []
    for mb in (float(m) for m in args.mb.split(",")):
        nbytes = int(mb * 1e6)
        rot = rotations(nbytes)
        best = {}
        src = [torch.empty(nbytes, dtype=torch.uint8, device=dev) for _ in range(rot)]
        dst = [torch.empty_like(s) for s in src]
        ms = timer.per_call_ms([lambda s=s, d=d: d.copy_(s) for s, d in zip(src, dst)])
        print(f"{mb:6.1f} MB torch copy: {ms * 1e3:7.1f} us, {2 * nbytes / (ms * 1e-3) / 1e9:5.0f} GB/s "
              f"(read + write)", flush=True)
        rows.append(dict(mb=mb, kind="copy", us=ms * 1e3))
        for loader, pdl, ch, warps, stages, per_sm in itertools.product(
                args.loader.split(","), args.pdl.split(","),
                *(map(int, a.split(",")) for a in (args.chunks, args.warps, args.stages, args.per_sm))):
            g = min(sms * per_sm, nbytes // ch)
            words = (nbytes // 4 // max(g, 1)) // (ch // 4) * (ch // 4)   # per program, whole chunks
            if g == 0 or words == 0:
                continue
            bufs = [torch.empty(g * words * 4, dtype=torch.uint8, device=dev) for _ in range(rot)]
            out = torch.empty(g, dtype=torch.int32, device=dev)
            try:
                ms = timer.per_call_ms([lambda b=b: stream(loader, b, out, g, words, ch, stages, pdl, warps)
                                        for b in bufs])
            except Exception as e:
                print(f"  {loader} PDL {pdl} CH {ch} warps {warps} stages {stages} per-SM {per_sm}: FAILED {e!r}"[:300],
                      flush=True)
                continue
            gbps = g * words * 4 / (ms * 1e-3) / 1e9
            rows.append(dict(mb=mb, kind="read", loader=loader, pdl=pdl, read_mb=g * words * 4 / 1e6, chunk=ch,
                             warps=warps, stages=stages, per_sm=per_sm, programs=g, us=ms * 1e3,
                             pct=100 * gbps / copy))
            if (loader, pdl) not in best or gbps > best[loader, pdl][0]:
                best[loader, pdl] = (gbps, ch, warps, stages, per_sm, ms, g * words * 4 / 1e6)
            print(f"  {loader:3s} PDL {pdl:7s} CH {ch:5d} warps {warps} stages {stages} per-SM {per_sm:2d}: "
                  f"{ms * 1e3:7.1f} us {gbps:5.0f} GB/s ({100 * gbps / copy:3.0f}%)", flush=True)
            del bufs
        for (loader, pdl), b in best.items():
            print(f"{mb:6.1f} MB best read, {loader}, PDL {pdl} ({b[6]:.1f} MB read): {b[0]:5.0f} GB/s "
                  f"({100 * b[0] / copy:3.0f}%) at CH {b[1]} warps {b[2]} stages {b[3]} per-SM {b[4]}: "
                  f"{b[5] * 1e3:.1f} us", flush=True)
        del src, dst
    if args.out:
        Path(args.out, "read.json").write_text(json.dumps(dict(copy=copy, rows=rows), indent=1))


if __name__ == "__main__":
    main()
