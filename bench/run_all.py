"""GPU correctness and benchmarks of dsv4's Triton kernels, in one call (the device machine is rented by the minute).

    python bench/run_all.py --out $OUT                 # H200: everything, ~6-8 minutes
    python bench/run_all.py --summary $OUT/results.json   # the current-figures table for bench/RESULTS.md
    TRITON_INTERPRET=1 python bench/run_all.py --toy   # CPU dry run at toy shapes (checks the script itself)

Sections: environment; copy bandwidth; parallel precompile; correctness against `kernels.ref` on fresh random
inputs at V4-Flash and V4-Pro shapes (poisoned outputs, bit-exact dequantization, MoE, routing, W4A4, then the
engine's kernels); `engine`, the engine's kernels' checks alone (not in the default sections); a
decode config sweep; the linear table (M = 1 .. 4096 vs cuBLAS bf16); the MoE layer table (1 .. 512 tokens
vs the bytes of the experts they touch); the tiny-model logits check. Writes results.json and table.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import asdict, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (FLASH, LAYOUT_ENV, LINEAR_FORMATS, PRO, TOY, Timer, bench_layout, copy_bandwidth,  # noqa: E402
                    nbytes, random_qweight, random_routing, rel_err, rotated_qweights, rotations)

from dsv4.kernels import Ops, dispatch, moe, policy, ref, refuse_fallback as _refuse  # noqa: E402
from dsv4.kernels.attention import AttentionPlan  # noqa: E402
from dsv4.kernels.host import Scratch, num_sms  # noqa: E402
from dsv4.kernels.policy import GemvConfig  # noqa: E402

M_LIST = "1,4,16,64,256,4096"   # the issue's sizes (--ms narrows them)
MOE_TOKENS = "1,4,8,64,512"     # the MoE layer table (--moe-tokens)


def strict_ops() -> Ops:
    """The Triton ops without their reference fallbacks: a benchmark or check must never time the reference."""
    return Ops.triton(strict=True)


class Run:
    def __init__(self, args):
        self.args = args
        self.toy = args.toy
        self.device = torch.device("cpu" if args.toy else "cuda")
        self.ops = strict_ops()
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.res: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "errors": [],
                          "command": " ".join(["python", "bench/run_all.py", *sys.argv[1:]])}
        self.t0 = time.time()
        self.gen = torch.Generator(device=self.device).manual_seed(1234)
        self.timer = Timer(self.device)
        self.models = (TOY,) if self.toy else (FLASH, PRO)
        self.scratch = Scratch()

    def elapsed(self) -> float:
        return time.time() - self.t0

    def save(self):
        (self.out / "results.json").write_text(json.dumps(self.res, indent=1, default=str))

    def section(self, name, fn):
        if self.elapsed() > self.args.budget:
            self.res["errors"].append(f"{name}: skipped (time budget {self.args.budget}s spent)")
            print(f"== {name}: skipped, out of time", flush=True)
            return
        print(f"== {name} (t={self.elapsed():.0f}s)", flush=True)
        try:
            fn()
        except Exception:  # record and continue: one broken section must not cost the whole device call
            tb = traceback.format_exc()
            print(tb, flush=True)
            self.res["errors"].append(f"{name}: {tb[-2000:]}")
        self.save()

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def x(self, m, k, dtype=torch.bfloat16):
        return torch.randn(m, k, device=self.device, generator=self.gen).to(dtype)

    def ms_list(self):
        return (1, 4, 16, 64, 70) if self.toy else tuple(int(m) for m in self.args.ms.split(","))

    def moe_tokens(self):
        return (1, 3, 11) if self.toy else tuple(int(t) for t in self.args.moe_tokens.split(","))

    def moe_block_tokens(self) -> tuple[int, int] | None | str:
        """`--moe-block-tokens` as `moe(block_tokens=)` takes it."""
        text = self.args.moe_block_tokens
        if text in ("off", "auto"):
            return None if text == "off" else text
        first, last = (int(t) for t in text.split(","))
        return first, last


# ------------------------------------------------------------------------------------------------ sections

def env(run: Run):
    import triton

    info = {"torch": torch.__version__, "triton": triton.__version__, "python": sys.version.split()[0],
            "weights": bench_layout()}
    if run.device.type == "cuda":
        p = torch.cuda.get_device_properties(0)
        info.update(device=p.name, sms=p.multi_processor_count, mem_gib=round(p.total_memory / 2**30, 1))
    run.res["env"] = info
    print(info, flush=True)


def copy_bw(run: Run):
    run.res["copy_gbps"] = copy_bandwidth(run.device, 0.01 if run.toy else 2.0)
    print(f"copy bandwidth {run.res['copy_gbps']:.0f} GB/s (read + write)", flush=True)


def linear_cases(run: Run):
    for sh in run.models:
        for name, (n, k) in sh.linears().items():
            for fmt in LINEAR_FORMATS[name]:
                if not run.toy or name in ("expert w2", "wq_b", "wo_a"):
                    yield sh, name, fmt, n, k


def compile_linear(jobs):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    done = 0
    for fmt, n, k, m, cfg in jobs:
        try:
            w = random_qweight(fmt, (), n, k, dev, gen)
            x = torch.randn(min(m, 64), k, device=dev, dtype=torch.bfloat16)
            dispatch.linear(x, w, config=cfg, fallback=_refuse, scratch=Scratch())
            torch.cuda.synchronize()
            done += 1
        except Exception as e:  # the main process will hit and report the same error
            print("precompile", fmt, n, k, m, repr(e)[:200], flush=True)
    return done


def precompile(run: Run):
    """Triton compiles are seconds each and sequential in-process: compile the linear table in worker processes
    (one shared on-disk cache) while the main process does the correctness section."""
    if run.toy:
        return
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    jobs = [(fmt, n, k, m, None) for _, _, fmt, n, k in linear_cases(run) for m in (1, 64)]
    workers = min(12, max(1, (os.cpu_count() or 2) - 2))
    chunks = [jobs[i::workers] for i in range(workers)]
    ex = ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"))
    run.res["precompile_jobs"] = len(jobs)
    run._precompile = (ex, [ex.submit(compile_linear, c) for c in chunks])


def precompile_join(run: Run):
    if getattr(run, "_precompile", None) is None:
        return
    ex, futs = run._precompile
    run.res["precompiled"] = sum(f.result() for f in futs)
    ex.shutdown()
    run._precompile = None


def attention_and_mhc(run: Run, record) -> None:
    """The cached attention kernel and the mHC kernels at V4's shapes (64 heads of 512, window 128, pages of 256
    positions; 4 streams of 4096) against their references on fp32 copies of the same inputs: ragged steps of decode
    tokens and a prefill chunk, CSA picks with -1 padding, HCA entries, pages in scrambled order."""
    from dsv4.runtime.cache import PAGE_TOKENS as page_tokens
    dev, gen = run.device, run.gen
    H, D, W, topk, d = (4, 32, 16, 5, 64) if run.toy else (64, 512, 128, 512, 4096)
    for ratio in (0, 4, 128):
        E = page_tokens // ratio if ratio else 1
        starts, lengths, num_pages, steps = ragged_pages(run)
        B, N = len(starts), sum(lengths)
        q = torch.randn(N, H, D, device=dev, generator=gen).bfloat16()
        kv = torch.randn(N, D, device=dev, generator=gen).bfloat16()
        ring = torch.randn(B + 1, W, D, device=dev, generator=gen).bfloat16()
        entries = torch.randn(num_pages, E, D, device=dev, generator=gen).bfloat16() if ratio else None
        picks = None
        if ratio == 4:
            visible = ((steps.pos + 1) // 4).long()
            picks = torch.rand(N, max(int(visible.max()), 1), device=dev, generator=gen).topk(
                min(topk, max(int(visible.max()), 1)), dim=1).indices
            picks = torch.where(picks < visible[:, None], picks, -1)          # beyond what is visible: none
        sinks = torch.randn(H, device=dev, generator=gen)
        got = run.ops.sparse_attention(q, kv, ring, entries, picks, steps, ratio, sinks, D ** -0.5)
        f32 = lambda t: None if t is None else t.float()  # noqa: E731
        want = ref.sparse_attention(q.float(), kv.float(), ring.float(), f32(entries), picks, steps, ratio, sinks,
                                    D ** -0.5)
        kind = dict([(0, 'SWA'), (4, 'CSA'), (128, 'HCA')])[ratio]
        record(f"attention {kind} H={H} D={D} steps {lengths} at {starts}", rel_err(got, want), 1e-2,
               written=bool(torch.isfinite(got).all()))
        # the queries normalised and rotated and the output rotated back in the launch (a split plan: the combine
        # rotates; a plan that fills the GPU; the ragged step's own plan, wide: a norm / rope launch each side)
        angle = torch.rand(N, D // 16, device=dev, generator=gen) * 6
        rope = (angle.cos(), angle.sin())
        want = ref.sparse_attention(q.float(), kv.float(), ring.float(), f32(entries), picks, steps, ratio, sinks,
                                    D ** -0.5, rope=rope, q_eps=1e-6)
        for plan in (AttentionPlan(16, 32, 4, 4), AttentionPlan(min(H, 32), 64, 8, 0), None):
            got = run.ops.sparse_attention(q, kv, ring, entries, picks, steps, ratio, sinks, D ** -0.5, rope=rope,
                                           q_eps=1e-6, plan=plan)
            record(f"attention {kind} + q norm / rope, plan {tuple(plan) if plan else 'planned'} steps {lengths}",
                   rel_err(got, want), 1e-2, written=bool(torch.isfinite(got).all()))
    n, T = 4, (3 if run.toy else 8)
    fn = torch.randn((2 + n) * n, n * d, device=dev, generator=gen) * 0.5 / (n * d) ** 0.5
    base = torch.randn((2 + n) * n, device=dev, generator=gen) * 0.5
    scale = torch.rand(3, device=dev, generator=gen) + 0.5
    for many in (40, T):   # bf16 streams on the tensor cores (`kernels.pieces`): 40 tokens 64 a program, T 16
        x = torch.randn(1, many, n, d, device=dev, generator=gen).bfloat16()
        got = run.ops.hc_pre(x, fn, base, scale, 20, 1e-6, 1e-6)
        want = ref.hc_pre(x.float(), fn, base, scale, 20, 1e-6, 1e-6)
        for name, a, b, tol in zip(("collapse", "post", "comb"), got, want, (1e-2, 1e-5, 1e-5)):
            record(f"mhc hc_pre {name} T={many} d={d}", rel_err(a, b), tol, written=bool(torch.isfinite(a).all()))
    xr = torch.randn(40, d, device=dev, generator=gen).bfloat16()     # the router past ROUTER_TOKENS: the pieces
    wr = torch.randn(64, d, device=dev, generator=gen) * d ** -0.5
    lg = run.ops.router_logits(xr, wr)
    record(f"router logits T=40 d={d}", rel_err(lg, torch.nn.functional.linear(xr.double(), wr.double())), 1e-5,
           written=bool(torch.isfinite(lg).all()))
    out = torch.randn(1, T, d, device=dev, generator=gen).bfloat16()
    y = run.ops.hc_post(out, x, got[1], got[2])
    record(f"mhc hc_post T={T} d={d}", rel_err(y, ref.hc_post(out.float(), x.float(), got[1], got[2])), 1e-2,
           written=bool(torch.isfinite(y).all()))
    y = run.ops.hc_head(x, fn[:n], base[:n], scale[:1], 1e-6, 1e-6)
    record(f"mhc hc_head T={T} d={d}", rel_err(y, ref.hc_head(x.float(), fn[:n], base[:n], scale[:1], 1e-6, 1e-6)),
           1e-2, written=bool(torch.isfinite(y).all()))
    w = torch.rand(d, device=dev, generator=gen) + 0.5               # the collapse with the block's norm fused
    u = run.ops.hc_pre(x, fn, base, scale, 20, 1e-6, 1e-6, w, 1e-6)[0]
    want = ref.hc_pre(x.float(), fn, base, scale, 20, 1e-6, 1e-6, w, 1e-6)[0]
    record(f"mhc hc_pre + norm T={T} d={d}", rel_err(u, want), 1e-2, written=bool(torch.isfinite(u).all()))
    y = run.ops.hc_head(x, fn[:n], base[:n], scale[:1], 1e-6, 1e-6, w, 1e-6)
    record(f"mhc hc_head + norm T={T} d={d}", rel_err(y, ref.hc_head(x.float(), fn[:n], base[:n], scale[:1], 1e-6,
                                                                     1e-6, w, 1e-6)), 1e-2,
           written=bool(torch.isfinite(y).all()))


def ragged_step(run: Run) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(starts, lengths) of the checks' step: decode tokens deep into a sequence and a 256-token prefill chunk."""
    return ((7, 60, 0, 33), (1, 1, 20, 1)) if run.toy else ((8191, 1000, 70000, 129), (1, 1, 256, 1))


def ragged_pages(run: Run):
    """The checks' ragged step (`ragged_step`) with scrambled page tables, slots 1..B: -> (starts, lengths, the pool's
    page count, StepTokens)."""
    from dsv4.kernels.steps import StepTokens
    from dsv4.runtime.cache import PAGE_TOKENS
    starts, lengths = ragged_step(run)
    per_seq = [-(-(s + n) // PAGE_TOKENS) for s, n in zip(starts, lengths)]
    perm = torch.randperm(sum(per_seq) + 3).tolist()
    pages, o = [], 0
    for n in per_seq:
        pages.append(tuple(perm[o:o + n]))
        o += n
    return starts, lengths, len(perm), StepTokens.build(tuple(range(1, len(starts) + 1)), starts, lengths, pages,
                                                        run.device)


def compressor_indexer_norms(run: Run, record) -> None:
    """The compressor, indexer, ring and norm / rope kernels at V4's shapes (CSA 2 x 512 wide, HCA 512, the indexer's
    compressor 2 x 128; 64 index heads of 128, top-512; rows of 512 and 4096) against their references on fp32
    copies: the entries and open / Ca state one ragged step leaves, the picks (as sets: a bf16 dot may swap
    near-tied keys), the rings (exact)."""
    from dsv4.model.state import CompressorState
    from dsv4.runtime.cache import PAGE_TOKENS as page_tokens
    dev, gen = run.device, run.gen
    starts, lengths, num_pages, steps = ragged_pages(run)
    B, N = len(starts), sum(lengths)
    angle = torch.rand(N, 4 if run.toy else 32, device=dev, generator=gen) * 6         # the rope's 64 channels
    closing = {ratio: sum((s + n) // ratio - s // ratio for s, n in zip(starts, lengths)) for ratio in (4, 128)}

    def case(ratio, hd):
        """A compressor's state (and its fp32 copy for the reference), step rows, norm weight and ape."""
        width = hd * (2 if ratio == 4 else 1)
        state = CompressorState(
            torch.randn(B + 1, ratio, width, device=dev, generator=gen).bfloat16(),
            torch.randn(B + 1, ratio, width, device=dev, generator=gen),
            torch.randn(B + 1, ratio, hd, device=dev, generator=gen).bfloat16() if ratio == 4 else None,
            torch.randn(B + 1, ratio, hd, device=dev, generator=gen) if ratio == 4 else None,
            torch.zeros(num_pages, page_tokens // ratio, hd, device=dev, dtype=torch.bfloat16))
        theirs = CompressorState(*(None if getattr(state, f) is None else getattr(state, f).float().clone()
                                   for f in ("open_kv", "open_score", "prev_kv", "prev_score", "entries")))
        kv = torch.randn(N, width, device=dev, generator=gen).bfloat16()
        score = (torch.randn(N, width, device=dev, generator=gen) * 2).bfloat16()    # the gate's bf16 logits
        return (state, theirs, kv, score, torch.rand(hd, device=dev, generator=gen) + 0.5,
                torch.randn(ratio, width, device=dev, generator=gen))

    def check(what, ratio, hd, state, theirs):
        written = int((state.entries.abs().sum(-1) > 0).sum())
        record(f"{what}ratio {ratio} hd {hd}: {written} entries of steps {lengths} at {starts}",
               rel_err(state.entries, theirs.entries) if closing[ratio] else 0.0, 1e-2,
               exact=torch.equal(state.open_score, theirs.open_score), written=written == closing[ratio])
        if ratio == 4:
            record(f"{what}ratio 4 hd {hd}: the Ca half kept", rel_err(state.prev_kv, theirs.prev_kv), 1e-2,
                   exact=torch.equal(state.prev_score, theirs.prev_score))

    shapes = ((4, 32), (128, 32), (4, 16)) if run.toy else ((4, 512), (128, 512), (4, 128))
    for ratio, hd in shapes:
        state, theirs, kv, score, weight, ape = case(ratio, hd)
        run.ops.compress(kv, score, ape, steps, state, ratio, angle.cos(), angle.sin(), weight, 1e-6,
                         -(-max(lengths) // ratio))
        ref.compress(kv.float(), score, ape, steps, theirs, ratio, angle.cos(), angle.sin(), weight, 1e-6)
        check("compress ", ratio, hd, state, theirs)
    # a CSA layer's two compressors (the attention's, the indexer's) stepped in the same launches
    dims = [hd for ratio, hd in shapes if ratio == 4]                # CSA's and its indexer's head dims
    first, second = case(4, dims[0]), case(4, dims[1])
    state, _, kv, score, weight, ape = first
    state2, _, kv2, score2, weight2, ape2 = second
    run.ops.compress(kv, score, ape, steps, state, 4, angle.cos(), angle.sin(), weight, 1e-6, -(-max(lengths) // 4),
                     second=ref.SecondCompressor(kv2, score2, ape2, state2, weight2, 1e-6))
    for hd, (state, theirs, kv, score, weight, ape) in zip(dims, (first, second)):
        ref.compress(kv.float(), score, ape, steps, theirs, 4, angle.cos(), angle.sin(), weight, 1e-6)
        check(f"compress pair (hd {dims[0]} + {dims[1]}) ", 4, hd, state, theirs)
    Hi, hdi, topk = (4, 16, 5) if run.toy else (64, 128, 512)
    q = torch.randn(N, Hi, hdi, device=dev, generator=gen).bfloat16()
    w = torch.randn(N, Hi, device=dev, generator=gen)
    keys = torch.randn(num_pages, page_tokens // 4, hdi, device=dev, generator=gen).bfloat16()
    bound = max((s + n) // 4 for s, n in zip(starts, lengths))
    got = run.ops.index_picks(q, w, keys, steps, topk, 4, hdi ** -0.5, bound)
    want = ref.index_picks(q.float(), w, keys.float(), steps, topk, 4, hdi ** -0.5)
    same = sum(len(set(a.tolist()) & set(b.tolist()) - {-1}) for a, b in zip(got, want))
    valid = int((want >= 0).sum())
    record(f"index picks H={Hi} hd={hdi} top-{topk}: share of the reference's {valid} picks missed",
           1 - same / max(valid, 1), 2e-2, exact=torch.equal((got >= 0).sum(1), (want >= 0).sum(1)))
    D, W = (32, 16) if run.toy else (512, 128)
    ring = torch.randn(B + 1, W, D, device=dev, generator=gen).bfloat16()
    theirs_ring = ring.clone()
    rows = torch.randn(N, D, device=dev, generator=gen).bfloat16()
    run.ops.write_ring(ring, rows, steps)
    ref.write_ring(theirs_ring, rows, steps)
    record(f"write_ring W={W} D={D}", 0.0, 0.0, exact=torch.equal(ring, theirs_ring))
    H = 4 if run.toy else 64
    angle = torch.rand(N, 32 if not run.toy else 8, device=dev, generator=gen) * 6
    x = torch.randn(N, H, D, device=dev, generator=gen).bfloat16()
    got = run.ops.norm_rope(x, angle.cos(), angle.sin(), None, 1e-6)
    record(f"norm_rope q rows H={H} D={D}", rel_err(got, ref.norm_rope(x.float(), angle.cos(), angle.sin(), None,
                                                                         1e-6)), 1e-2)
    angle = torch.rand(256, angle.shape[1], device=dev, generator=gen) * 6      # a batch-256 decode step's rows:
    x = torch.randn(256, H, D, device=dev, generator=gen).bfloat16()            # several rows a program
    for inverse in (False, True):
        got = run.ops.norm_rope(x, angle.cos(), angle.sin(), None, None if inverse else 1e-6, inverse)
        want = ref.norm_rope(x.float(), angle.cos(), angle.sin(), None, None if inverse else 1e-6, inverse)
        record(f"norm_rope {'inverse rope' if inverse else 'q'} rows of 256 tokens H={H} D={D}", rel_err(got, want),
               1e-2)
    d = 64 if run.toy else 4096
    x = torch.randn(N, d, device=dev, generator=gen).bfloat16()
    weight = torch.rand(d, device=dev, generator=gen) + 0.5
    got = run.ops.norm_rope(x, None, None, weight, 1e-6)
    record(f"norm_rope RMSNorm d={d}", rel_err(got, ref.norm_rope(x.float(), None, None, weight, 1e-6)), 1e-2)


def sampling_and_fp8_keys(run: Run, record) -> None:
    """The sampler (one Triton launch on CUDA) against its PyTorch reference at V4's vocabulary: the share of rows that
    draw another token (exp and log may differ in the last bit: only near-ties move); and the indexer's keys in fp8
    (kv_cache_dtype "fp8-indexer" or "fp8"): the compressor's codes and scales and the picks from them against the
    references."""
    from dsv4.model.state import CompressorState
    from dsv4.runtime.cache import PAGE_TOKENS as page_tokens
    from dsv4.runtime.params import SamplingParams
    from dsv4.runtime.sampler import SamplingBatch, sample, sample_reference
    dev, gen = run.device, run.gen
    vocab, rows = (1000, 8) if run.toy else (129280, 64)
    logits = torch.randn(rows, vocab, device=dev, generator=gen) * 3
    mixed = [SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=1), SamplingParams(temperature=0.0),
             SamplingParams(top_p=0.9, min_p=0.05), SamplingParams(temperature=0.6, top_k=20), SamplingParams()]
    batch = SamplingBatch.build([mixed[i % len(mixed)] for i in range(rows)], range(rows), vocab, dev,
                                all_filters=True)
    differ = int((sample(logits, batch).token_ids != sample_reference(logits, batch).token_ids).sum())
    record(f"sampler B={rows} V={vocab}, all filters: share of rows drawing another token", differ / rows, 0.02)
    starts, lengths, num_pages, steps = ragged_pages(run)
    B, N, hd = len(starts), sum(lengths), 16 if run.toy else 128

    def state():
        return CompressorState(torch.zeros(B + 1, 4, 2 * hd, device=dev).bfloat16(), torch.zeros(B + 1, 4, 2 * hd,
                               device=dev), torch.zeros(B + 1, 4, hd, device=dev).bfloat16(),
                               torch.full((B + 1, 4, hd), float("-inf"), device=dev),
                               torch.zeros(num_pages, page_tokens // 4, hd, device=dev, dtype=torch.float8_e4m3fn),
                               torch.zeros(num_pages, page_tokens // 4, device=dev))
    mine, theirs = state(), state()
    kv = torch.randn(N, 2 * hd, device=dev, generator=gen).bfloat16()
    score = (torch.randn(N, 2 * hd, device=dev, generator=gen) * 2).bfloat16()
    angle = torch.rand(N, 4 if run.toy else 32, device=dev, generator=gen) * 6
    weight, ape = torch.rand(hd, device=dev, generator=gen) + 0.5, torch.randn(4, 2 * hd, device=dev, generator=gen)
    run.ops.compress(kv, score, ape, steps, mine, 4, angle.cos(), angle.sin(), weight, 1e-6, -(-max(lengths) // 4))
    ref.compress(kv, score, ape, steps, theirs, 4, angle.cos(), angle.sin(), weight, 1e-6)
    a, b = (s.entries.float() * s.entry_scales[..., None] for s in (mine, theirs))
    closing = sum((s + n) // 4 - s // 4 for s, n in zip(starts, lengths))
    record(f"compress fp8 indexer keys hd {hd}: {closing} entries", rel_err(a, b) if closing else 0.0, 7e-2,
           written=int((mine.entry_scales > 0).sum()) == closing)
    H, topk = (4, 5) if run.toy else (64, 512)
    q, w = torch.randn(N, H, hd, device=dev, generator=gen).bfloat16(), torch.randn(N, H, device=dev, generator=gen)
    codes = torch.randn(num_pages, page_tokens // 4, hd, device=dev, generator=gen).to(torch.float8_e4m3fn)
    scales = torch.randint(-3, 3, (num_pages, page_tokens // 4), device=dev, generator=gen).float().exp2()
    bound = max((s + n) // 4 for s, n in zip(starts, lengths))
    got = run.ops.index_picks(q, w, codes, steps, topk, 4, hd ** -0.5, bound, entry_scales=scales)
    want = ref.index_picks(q.float(), w, codes, steps, topk, 4, hd ** -0.5, entry_scales=scales)
    same = sum(len(set(x.tolist()) & set(y.tolist()) - {-1}) for x, y in zip(got, want))
    valid = int((want >= 0).sum())
    record(f"index picks from fp8 keys H={H} hd={hd} top-{topk}: share of the reference's {valid} picks missed",
           1 - same / max(valid, 1), 2e-2, exact=torch.equal((got >= 0).sum(1), (want >= 0).sum(1)))


def fp8_cache(run: Run, record) -> None:
    """The attention's fp8 cache (kv_cache_dtype "fp8") at V4's shapes (512 channels, 448 of them fp8): the kv
    norm_rope launch's rounding (exact against `ref.fp8_kv_round` of the unrounded launch), the compressor's packed
    entries (HCA and CSA, decoded, against `ref.compress` on the same rows) and attention over packed entries
    (against the same kernel over their decoded values, and the reference)."""
    from dsv4.model.state import CompressorState
    from dsv4.runtime.cache import PAGE_TOKENS as page_tokens
    dev, gen = run.device, run.gen
    D, nope, H = (64, 48, 4) if run.toy else (512, 448, 64)
    row = ref.kv_row_bytes(D, nope)
    starts, lengths, num_pages, steps = ragged_pages(run)
    B, N = len(starts), sum(lengths)
    angle = torch.rand(N, (D - nope) // 2, device=dev, generator=gen) * 6
    x = torch.randn(N, D, device=dev, generator=gen).bfloat16()
    weight = torch.rand(D, device=dev, generator=gen) + 0.5
    plain = run.ops.norm_rope(x, angle.cos(), angle.sin(), weight, 1e-6)
    got = run.ops.norm_rope(x, angle.cos(), angle.sin(), weight, 1e-6, fp8_nope=nope)
    record(f"norm_rope kv rows D={D}, fp8 rounding of {nope} channels", 0.0, 0.0,
           exact=torch.equal(got, ref.fp8_kv_round(plain, nope)))
    for ratio in (128, 4):
        width = D * (2 if ratio == 4 else 1)

        def state():
            prev = (torch.zeros(B + 1, 4, D, device=dev).bfloat16(),
                    torch.full((B + 1, 4, D), float("-inf"), device=dev)) if ratio == 4 else (None, None)
            return CompressorState(torch.zeros(B + 1, ratio, width, device=dev).bfloat16(),
                                   torch.zeros(B + 1, ratio, width, device=dev), *prev,
                                   torch.zeros(num_pages, page_tokens // ratio, row, device=dev, dtype=torch.uint8),
                                   None, nope)
        mine, theirs = state(), state()
        kv = torch.randn(N, width, device=dev, generator=gen).bfloat16()
        score = (torch.randn(N, width, device=dev, generator=gen) * 2).bfloat16()
        cos, sin = angle.cos(), angle.sin()
        ape = torch.randn(ratio, width, device=dev, generator=gen)
        run.ops.compress(kv, score, ape, steps, mine, ratio, cos, sin, weight, 1e-6, -(-max(lengths) // ratio))
        ref.compress(kv, score, ape, steps, theirs, ratio, cos, sin, weight, 1e-6)
        a, b = (ref.fp8_kv_unpack(s.entries, D, nope, torch.float32) for s in (mine, theirs))
        closing = sum((s + n) // ratio - s // ratio for s, n in zip(starts, lengths))
        record(f"compress ratio {ratio} packed fp8 entries D={D}: {closing} entries", rel_err(a, b) if closing else 0.0,
               7e-2, written=int(mine.entries.any(-1).sum()) == closing)
    W = 16 if run.toy else 128
    q = torch.randn(N, H, D, device=dev, generator=gen).bfloat16()
    kv = torch.randn(N, D, device=dev, generator=gen).bfloat16()
    ring = torch.randn(B + 2, W, D, device=dev, generator=gen).bfloat16()
    sinks = torch.randn(H, device=dev, generator=gen)
    packed = ref.fp8_kv_pack(torch.randn(num_pages, page_tokens // 128, D, device=dev, generator=gen), nope)
    values = ref.fp8_kv_unpack(packed, D, nope, torch.bfloat16)
    bound = max((s + n) // 128 for s, n in zip(starts, lengths))
    got = run.ops.sparse_attention(q, kv, ring, packed, None, steps, 128, sinks, D ** -0.5, bound, entry_nope=nope)
    run.sync()                      # a fault shows at the launch that made it
    over_values = run.ops.sparse_attention(q, kv, ring, values, None, steps, 128, sinks, D ** -0.5, bound)
    run.sync()
    want = ref.sparse_attention(q.float(), kv.float(), ring.float(), packed, None, steps, 128, sinks, D ** -0.5,
                                entry_nope=nope)
    record(f"attention HCA over packed fp8 entries H={H} D={D} (against the decoded entries)",
           rel_err(got, over_values), 1e-2)
    record(f"attention HCA over packed fp8 entries H={H} D={D} (against the reference)", rel_err(got, want), 2e-2)


def recorder(rows: list):
    """record(what, err, bound, exact=None, written=None): one check's row into `rows`, printed."""
    def record(what, err, bound, exact=None, written=None):
        ok = err <= bound and (exact is None or exact) and (written is None or written)
        rows.append(dict(check=what, rel_err=err, bound=bound, exact=exact, all_written=written, ok=ok))
        print(f"  {'ok ' if ok else 'BAD'} {what}: rel_err {err:.2e} (bound {bound:g})"
              + ("" if exact is None else f" exact={exact}") + ("" if written is None else f" written={written}"),
              flush=True)
    return record


def engine_checks(run: Run, record) -> None:
    """The engine's kernels after the linears (attention, mHC, compressors, indexer, norm / rope, sampling, the fp8
    cache) against their references."""
    attention_and_mhc(run, record)         # a fault in them (the CUDA context is lost) leaves the checks before
    compressor_indexer_norms(run, record)  # recorded
    sampling_and_fp8_keys(run, record)
    fp8_cache(run, record)


def report_failures(run: Run, rows: list, key: str) -> None:
    bad = [r["check"] for r in rows if not r["ok"]]
    run.res[f"{key}_failures"] = bad
    print(f"{key}: {len(rows) - len(bad)}/{len(rows)} ok", flush=True)


def engine(run: Run):
    """The `engine` section: `engine_checks` alone (the correctness section runs them after the linears and MoE),
    for a call whose time is short."""
    rows = []
    run.res["engine"] = rows
    engine_checks(run, recorder(rows))
    report_failures(run, rows, "engine")


def correctness(run: Run):
    from dsv4.kernels import w4a4
    from dsv4.formats import QWeight, stage_activation
    rows = []
    run.res["correctness"] = rows
    dev, gen = run.device, run.gen
    record = recorder(rows)

    sh = run.models[0] if run.toy else FLASH
    big = run.models[-1]
    # dense linears: formats x shapes x M, bf16 activations, NaN-poisoned outputs
    cases = [(sh, "expert w1/w3", "nvfp4"), (sh, "expert w2", "mxfp4"), (sh, "wo_b", "fp8"),
             (big, "wq_b", "nvfp4"), (big, "expert w1/w3", "mxfp4"), (big, "shared w1/w3", "fp8")]
    for s, name, fmt in cases:
        n, k = s.linears()[name]
        w = random_qweight(fmt, (), n, k, dev, gen)
        for m in ((1, 16, 70) if run.toy else (1, 16, 64, 4096)):
            x = run.x(m, k)
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=dev)
            dispatch.linear(x, w, out=out, fallback=_refuse, scratch=run.scratch)
            r = ref.linear(x, w)
            record(f"linear {s.name} {name} {fmt} M={m}", rel_err(out, r), 1e-2,
                   written=bool(torch.isfinite(out).all()))
    # bit-exact dequantization through the bf16 asm path: x = identity rows, weights exactly representable
    for fmt in ("nvfp4", "mxfp4", "fp8"):
        n, k = sh.linears()["expert w1/w3"]
        w = random_qweight(fmt, (), n, k, dev, gen, scale_2=2.0 ** -7)
        if fmt == "nvfp4":  # every E4M3 scale byte but the two NaNs (subnormals, zero, negatives), cycled
            codes = torch.arange(n * (k // 16), device=dev).view(n, k // 16) % 254
            codes = (codes + (codes >= 0x7F).long()).to(torch.uint8).view(torch.float8_e4m3fn)
            w = QWeight("nvfp4", w.weight, codes, w.scale_2)
        if fmt == "fp8":  # every finite E4M3 weight byte (subnormals, zeros, negatives), cycled, stored tile-major
            codes = torch.arange(n * k, device=dev).view(n, k) % 254
            codes = (codes + (codes >= 0x7F).long()).to(torch.uint8).view(torch.float8_e4m3fn)
            w = QWeight("fp8", codes, w.scale).tile()
        wt = w.dequantize(torch.float32).T
        for m, fused in ((16, False), (k, False), (k, True)):  # decode tiles; dequant + cuBLAS; fused prefill
            x = torch.eye(m, k, device=dev, dtype=torch.bfloat16)
            cfg = policy.tile_config(m, n, k, fmt, num_sms(dev)) if fused else None
            y = dispatch.linear(x, w, config=cfg, fallback=_refuse, scratch=run.scratch)
            record(f"exact dequant {fmt} M={m}{' fused' if fused else ''}", 0.0, 0.0,
                   exact=bool(torch.equal(y.float(), wt[:m])))
        # the fused tiles' portable (non-asm) decoders give the same bits, at decode rows and at 128 rows
        for m in (16, 128):
            cfg = replace(policy.tile_config(m, n, k, fmt, num_sms(dev)), asm=False)
            y = dispatch.linear(torch.eye(m, k, device=dev, dtype=torch.bfloat16), w, config=cfg, fallback=_refuse,
                                scratch=run.scratch)
            record(f"exact dequant {fmt} tiles M={m} portable decode", 0.0, 0.0,
                   exact=bool(torch.equal(y.float(), wt[:m])))
        # the decode GEMV without its asm decoders (plain Triton), and a split-K GEMV: the same bits
        for cfg in (GemvConfig(asm=False), GemvConfig(BN=64, split=4)):
            y = dispatch.linear(torch.eye(16, k, device=dev, dtype=torch.bfloat16), w, config=cfg, fallback=_refuse,
                            scratch=run.scratch)
            record(f"exact dequant {fmt} gemv asm={cfg.asm} split={cfg.split}", 0.0, 0.0,
                   exact=bool(torch.equal(y.float(), wt[:16])))
        # the GEMV's asm decoders on every column (so every scale group and word), MMA N = 16 and 8
        eye = torch.eye(k, device=dev, dtype=torch.bfloat16)
        for nrows in (16, 8):
            for cfg in (GemvConfig(), GemvConfig(split=4), policy.LARGE_FP4_16_ROWS):
                same = all(torch.equal(dispatch.linear(eye[o:o + nrows], w, config=cfg, fallback=_refuse,
                                                       scratch=run.scratch).float(), wt[o:o + nrows])
                           for o in range(0, k, nrows))
                record(f"exact dequant {fmt} gemv all columns rows={nrows} split={cfg.split} BN={cfg.BN}", 0.0, 0.0,
                       exact=same)
    # FP8 with fp32 block scales (-Base checkpoints): the GEMV applies them to fp32 partials
    n, k = big.linears()["wo_b"]
    w8 = random_qweight("fp8", (), n, k, dev, gen)
    w8 = QWeight("fp8", w8.weight, w8.scale.float() * (1 + 0.3 * torch.rand(w8.scale.shape, device=dev, generator=gen)))
    for m in (1, 16):
        x = run.x(m, k)
        record(f"linear {big.name} wo_b fp8-f32-scales M={m}", rel_err(dispatch.linear(x, w8, fallback=_refuse,
               scratch=run.scratch), ref.linear(x, w8)), 1e-2)
    # grouped wo_a (block-diagonal): decode GEMV over all groups; prefill dequantize + bmm
    n, k = big.linears()["wo_a"]
    for fmt in ("nvfp4", "fp8"):
        w = random_qweight(fmt, (), n, k, dev, gen)
        for m in ((1, 3) if run.toy else (1, 16, 64, 512)):
            x = run.x(m, big.o_groups * k).view(m, big.o_groups, k)
            out = run.ops.grouped_linear(x, w, big.o_groups)
            record(f"grouped wo_a {big.name} {fmt} T={m}", rel_err(out, ref.grouped_linear(x, w, big.o_groups)), 1e-2,
                   written=bool(torch.isfinite(out).all()))
    # routing
    for s in run.models:
        logits = torch.randn(512, s.E, device=dev, generator=gen) * 2
        bias = torch.randn(s.E, device=dev, generator=gen) * 0.3
        w_, ids = run.ops.route(logits, bias, s.k, 2.5)
        rw, rids = ref.route(logits, bias, s.k, 2.5)
        same = torch.equal(ids.sort(1).values, rids.sort(1).values)
        record(f"route {s.name} biased top-{s.k}", rel_err(w_.gather(1, ids.argsort(1)), rw.gather(1, rids.argsort(1))),
               1e-5, exact=same)
        if run.ops.name != "ref":   # the kernel's warp count changes its schedule, never its bits
            w1, ids1 = moe.route(logits, bias, s.k, 2.5, warps=1)
            record(f"route {s.name} on 1 warp against {policy.ROUTE_WARPS} (same bits)", rel_err(w1, w_), 0.0,
                   exact=torch.equal(ids1, ids) and torch.equal(w1, w_))
        # exactly tied scores (few distinct logits and biases): the same experts in the same order as the CPU
        # reference, the lower id first on a tie
        tied = torch.randint(-2, 2, (512, s.E), device=dev, generator=gen).float()
        tbias = (torch.arange(s.E, device=dev) % 2) * 0.25
        w_, ids = run.ops.route(tied, tbias, s.k, 2.5)
        rw, rids = ref.route(tied.cpu(), tbias.cpu(), s.k, 2.5)
        record(f"route {s.name} tied scores (ids in order)", rel_err(w_.cpu(), rw), 1e-6,
               exact=torch.equal(ids.cpu(), rids))
        tid2eid = random_routing(s.E, 97, s.k, dev, gen)   # the hash layer's table: 97 token ids
        tok = torch.randint(0, 97, (512,), device=dev, generator=gen)
        w_, ids = run.ops.route(logits, None, s.k, 1.5, tid2eid, tok)
        rw, rids = ref.route(logits, None, s.k, 1.5, tid2eid, tok)
        record(f"route {s.name} hash", rel_err(w_, rw), 1e-5, exact=torch.equal(ids, rids))
    # MoE, both paths, and the shared expert
    for s, fmt in ((sh, "nvfp4"), (sh, "mxfp4"), (big, "nvfp4")):
        w13 = random_qweight(fmt, (s.E, 2), s.I, s.D, dev, gen)
        w2 = random_qweight(fmt, (s.E,), s.D, s.I, dev, gen)
        for t in ((1, 3, 11) if run.toy else (1, 4, 8, 64)):
            x = run.x(t, s.D)
            wts, ids = ref.route(torch.randn(t, s.E, device=dev, generator=gen), torch.zeros(s.E, device=dev), s.k, 1.5)
            y = run.ops.moe(x, ids, wts, w13, w2, 10.0)
            # (the interpreter truncates fp32->bf16 instead of rounding: the toy run gets a looser bound)
            bound = 2e-2 if run.toy else 1e-2
            want = ref.moe(x, ids, wts, w13, w2, 10.0)
            record(f"moe {s.name} {fmt} T={t}", rel_err(y, want), bound, written=bool(torch.isfinite(y).all()))
            first = 3 if run.toy else 4
            if run.ops.name != "ref" and first <= t <= policy.DECODE_TOKENS:
                # the pair over expert blocks at <= 8 tokens too (by default from 9: `policy.auto_block_tokens`)
                y_blk = dispatch.moe(x, ids, wts, w13, w2, 10.0, fallback=_refuse, scratch=run.scratch,
                                     block_tokens=(first, policy.DECODE_TOKENS))
                record(f"moe {s.name} {fmt} T={t} expert blocks ({ids.numel() - ids.unique().numel()} shared)",
                       rel_err(y_blk, want), bound, written=bool(torch.isfinite(y_blk).all()))
            # the decode tiles (t <= 8), the sorted path above
            y_tiles = run.ops.moe(x, ids, wts, w13, w2, 10.0, decode="tiles")
            record(f"moe {s.name} {fmt} T={t} decode tiles / sorted", rel_err(y_tiles, want), bound,
                   written=bool(torch.isfinite(y_tiles).all()))
        del w13, w2
    # MoE with the shared expert in the same two GEMV launches (mixed formats, as the official checkpoints): one row
    # block per token (1), the token columns in one row block (4, 8) and in two (12, 16; over expert blocks); on the
    # side stream beside the routed experts (`dispatch.Side`: V4-Pro's 66 MB FP8 shared expert from 4 tokens, every
    # shared expert at 32, where the pair does not carry it)
    for s, fmt, sfmt in ((sh, "mxfp4", "fp8"), (big, "nvfp4", "fp8"), (sh, "nvfp4", "nvfp4")):
        w13 = random_qweight(fmt, (s.E, 2), s.I, s.D, dev, gen)
        w2 = random_qweight(fmt, (s.E,), s.D, s.I, dev, gen)
        shared = random_qweight(sfmt, (2,), s.I, s.D, dev, gen), random_qweight(sfmt, (), s.D, s.I, dev, gen)
        for t in ((1, 3) if run.toy else (1, 4, 8, 12, 16, 32)):
            x = run.x(t, s.D)
            logits, zero = torch.randn(t, s.E, device=dev, generator=gen), torch.zeros(s.E, device=dev)
            wts, ids = ref.route(logits, zero, s.k, 1.5)
            y = run.ops.moe(x, ids, wts, w13, w2, 10.0, shared=shared)
            # as the model runs it: the routing kernel, then the shared expert streamed while it runs (PDL);
            # the same bits as the plain launch on that routing
            wk, ik = run.ops.route(logits, zero, s.k, 1.5)
            y_after = run.ops.moe(x, ik, wk, w13, w2, 10.0, shared=shared, after_route=True)
            same = torch.equal(y_after, run.ops.moe(x, ik, wk, w13, w2, 10.0, shared=shared))
            record(f"moe+shared {s.name} {fmt}+{sfmt} T={t} (after route: same bits)",
                   rel_err(y, ref.moe(x, ids, wts, w13, w2, 10.0, shared=shared)), 2e-2 if run.toy else 1e-2,
                   exact=same, written=bool(torch.isfinite(y).all()))
        del w13, w2, shared
    for s, fmt in ((sh, "fp8"), (big, "nvfp4")):
        w13 = random_qweight(fmt, (2,), s.I, s.D, dev, gen)
        w2 = random_qweight(fmt, (), s.D, s.I, dev, gen)
        for t in (1, 16, 64, 70):
            x = run.x(t, s.D)
            err = rel_err(run.ops.mlp(x, w13, w2, 10.0), ref.mlp(x, w13, w2, 10.0))
            record(f"shared mlp {s.name} {fmt} T={t}", err, 1e-2)
    # programmatic dependent launch: chains of dependent GEMVs (each reads the output of the one before; one
    # torch op between two of them), eager and in one CUDA graph, give the bits of the same chain without PDL
    if dev.type == "cuda":
        for fmt in ("nvfp4", "fp8"):
            chain_w = [random_qweight(fmt, (), 4096, 4096, dev, gen) for _ in range(4)]

            def chain(x, cfg):
                h = x
                for i, w in enumerate(chain_w):
                    h = dispatch.linear(h, w, config=cfg, fallback=_refuse, scratch=run.scratch)
                    if i == 1:
                        h = h / h.float().abs().amax().clamp_min(1.0).to(h.dtype)
                return h

            for m in (1, 8):
                x = run.x(m, 4096)
                plain = chain(x, GemvConfig(pdl=False))
                eager = chain(x, GemvConfig(pdl=True))
                xs = x.clone()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    graphed = chain(xs, GemvConfig(pdl=True))
                g.replay()
                torch.cuda.synchronize()
                record(f"pdl chain of 4 dependent gemvs {fmt} M={m} (eager, graph)", 0.0, 0.0,
                       exact=bool(torch.equal(eager, plain) and torch.equal(graphed, plain)),
                       written=bool(torch.isfinite(plain).all()))
                del g
            del chain_w
    # W4A4: staging is bit-identical, the GEMM matches its reference
    n, k = sh.linears()["wo_b"]
    w = random_qweight("nvfp4", (), n, k, dev, gen)
    for m in (1, 64) if run.toy else (1, 64, 4096):
        x = run.x(m, k) * 3
        q, sf, g = w4a4.stage_activation(x, w.input_scale)
        rq, rsf, rg = stage_activation(x, w.input_scale)
        record(f"stage_activation M={m}", 0.0, 0.0,
               exact=bool(torch.equal(q, rq) and torch.equal(sf.view(torch.uint8), rsf.view(torch.uint8))))
        record(f"linear_w4a4 M={m}", rel_err(run.ops.linear_w4a4(x, w), ref.linear_w4a4(x, w)), 1e-2)
    engine_checks(run, record)             # last: a fault in them leaves the linear and MoE checks recorded
    report_failures(run, rows, "correctness")


def time_linear(run: Run, fmt, n, k, m, cfg=None, rotate=True, groups=0):
    """(ms per call, cfg, bytes of one weight) of dispatch.linear on rotated weights (one CUDA graph for m <= 256).
    cfg: a TileConfig (the fused tiles), a GemvConfig (the decode GEMV), or None
    / "default" (exactly what Ops.linear does). groups > 0 times Ops.grouped_linear (x [m, groups, k / groups...
    the weight's K])."""
    dev, gen = run.device, run.gen
    ws = rotated_qweights(fmt, n, k, dev, gen, (2 if run.toy else None) if (rotate and m <= 256) else 1)
    w0, rot = ws[0], len(ws)
    cfg = cfg or "default"
    conf = None if cfg == "default" else cfg
    if groups:
        xs = [run.x(m, groups * k).view(m, groups, k) for _ in range(rot)]
        calls = [(lambda x=x, w=w: run.ops.grouped_linear(x, w, groups)) for x, w in zip(xs, ws)]
    else:
        xs = [run.x(m, k) for _ in range(rot)]
        calls = [(lambda x=x, w=w: dispatch.linear(x, w, config=conf, fallback=_refuse, scratch=run.scratch))
                 for x, w in zip(xs, ws)]
    ms = run.timer.per_call_ms(calls, graph=m <= 256)
    del ws
    return ms, cfg, nbytes(w0)


def time_cublas(run: Run, n, k, m):
    dev, gen = run.device, run.gen
    rot = (2 if run.toy else rotations(n * k * 2)) if m <= 256 else 1
    ws = [torch.randn(n, k, device=dev, generator=gen, dtype=torch.bfloat16) for _ in range(rot)]
    xs = [run.x(m, k) for _ in range(rot)]
    calls = [(lambda x=x, w=w: torch.nn.functional.linear(x, w)) for x, w in zip(xs, ws)]
    return run.timer.per_call_ms(calls, graph=m <= 256)


def grid_plan(run: Run):
    """Decode GEMV variants (M = 1) on three large shapes where launch cost does not hide streaming efficiency:
    V4-Pro wq_b nvfp4 (N = 65536, no split), V4-Pro wo_b nvfp4 (K = 16384, split-K), V4-Flash wo_b fp8.
    Yields (variant, shape, fmt, N, K, GemvConfig)."""
    shapes = [(run.models[-1], "wq_b", "nvfp4"), (run.models[-1], "wo_b", "nvfp4"), (run.models[0], "wo_b", "fp8"),
              (run.models[-1], "wq_b", "fp8"), (run.models[0], "expert w1/w3", "nvfp4")]
    variants = {"default": GemvConfig(), "no register cap": GemvConfig(maxnreg=0),
                "no prefetch": GemvConfig(prefetch=0), "prefetch fp4 too": GemvConfig(prefetch=3),
                "prefetch fp4 too, 1 stage": GemvConfig(prefetch=3, num_stages=1),
                **{f"cap {r}": GemvConfig(maxnreg=r) for r in (96, 80)},
                "stages 3": GemvConfig(num_stages=3), "bn 32": GemvConfig(BN=32)}
    if run.toy:
        variants = {k: variants[k] for k in ("default", "cap 80")}
    for vname, cfg in variants.items():
        for sh, name, fmt in shapes:
            n, k = sh.linears()[name]
            yield vname, f"{sh.name} {name}", fmt, n, k, cfg


def launch_overhead(run: Run):
    """Per-launch cost of a no-op Triton kernel and of a tiny torch op inside one CUDA graph (64 launches)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _noop(p):
        tl.store(p, 1.0)

    buf = torch.zeros(16, device=run.device)
    small = torch.randn(1024, device=run.device)
    run.res["launch_us"] = {
        "triton_noop": 1e3 * run.timer.per_call_ms([lambda: _noop[(1,)](buf) for _ in range(64)]),
        "torch_add": 1e3 * run.timer.per_call_ms([lambda: small.add(1.0) for _ in range(64)]),
    }
    print("launch overhead in a graph (us/launch):", run.res["launch_us"], flush=True)


def sweep(run: Run):
    """Time the decode GEMV variants of `grid_plan` (M = 1, rotated weights, CUDA graph)."""
    out = []
    run.res["sweep"] = out
    for variant, shape, fmt, n, k, cfg in grid_plan(run):
        try:
            ms_, _, wbytes = time_linear(run, fmt, n, k, 1, cfg=cfg)
        except Exception as e:
            print("  sweep config failed", variant, shape, repr(e)[:300], flush=True)
            continue
        row = dict(variant=variant, shape=shape, fmt=fmt, M=1, config=asdict(cfg), us=ms_ * 1e3,
                   gbps=wbytes / (ms_ * 1e-3) / 1e9)
        out.append(row)
        print(f"  {variant:24s} {shape:16s} {fmt}: {row['us']:.1f} us {row['gbps']:.0f} GB/s "
              f"({100 * row['gbps'] / run.res.get('copy_gbps', 1):.0f}% copy)", flush=True)


def prefill_compare(run: Run):
    """M = 4096: the fused Triton tiles vs the default prefill path (Triton dequantize + cuBLAS)."""
    rows = []
    run.res["prefill_compare"] = rows
    sh = run.models[0]
    for name, fmt in (("expert w1/w3", "nvfp4"), ("expert w2", "mxfp4"), ("wo_b", "fp8"), ("wq_b", "nvfp4")):
        n, k = sh.linears()[name]
        m = 70 if run.toy else 4096
        fused, cfg, _ = time_linear(run, fmt, n, k, m, cfg=policy.tile_config(m, n, k, fmt, num_sms(run.device)))
        default, _, _ = time_linear(run, fmt, n, k, m, cfg="default")
        cb = time_cublas(run, n, k, m)
        fl = 2 * m * n * k
        rows.append(dict(shape=f"{sh.name} {name}", fmt=fmt, M=m, fused_tflops=fl / fused / 1e9,
                         default_tflops=fl / default / 1e9, cublas_tflops=fl / cb / 1e9, fused_config=asdict(cfg)))
        print(f"  {sh.name} {name} {fmt} M={m}: fused {fl / fused / 1e9:.0f} TF, dequant+cuBLAS "
              f"{fl / default / 1e9:.0f} TF, cuBLAS bf16 {fl / cb / 1e9:.0f} TF", flush=True)


def crossover(run: Run):
    """Fused decode kernel vs Triton dequantize + cuBLAS around the switch-over (policy.prefers_cublas)."""
    from dsv4.kernels import gemm
    rows = []
    run.res["crossover"] = rows
    for sh, name, fmt in ((run.models[0], "expert w1/w3", "nvfp4"), (run.models[0], "wq_b", "fp8"),
                          (run.models[-1], "wo_b", "nvfp4"), (run.models[-1], "expert w2", "mxfp4")):
        n, k = sh.linears()[name]
        for m in ((16, 33) if run.toy else (16, 24, 32, 48, 64)):
            fused, _, _ = time_linear(run, fmt, n, k, m, cfg=policy.tile_config(m, n, k, fmt, num_sms(run.device)))
            ws = [random_qweight(fmt, (), n, k, run.device, run.gen) for _ in range(4)]
            xs = [run.x(m, k) for _ in range(4)]
            deq = run.timer.per_call_ms([(lambda x=x, w=w: torch.nn.functional.linear(x, gemm.dequantize(w, x.dtype)))
                                         for x, w in zip(xs, ws)])
            rows.append(dict(shape=f"{sh.name} {name}", fmt=fmt, M=m, fused_us=fused * 1e3,
                             dequant_cublas_us=deq * 1e3))
            print(f"  {sh.name} {name} {fmt} M={m}: fused {fused * 1e3:.1f} us, dequant+cuBLAS {deq * 1e3:.1f} us",
                  flush=True)


def linear_table(run: Run):
    rows = []
    run.res["linear"] = rows
    copy = run.res.get("copy_gbps", 1.0)
    cublas = {}
    # decode sizes (M <= 256: CUDA graphs) of every shape first, then the prefill sizes: measured after a
    # minute of M = 4096 GEMMs, the next shape's M = 1 GEMV ran up to 17 % slower (run 44; the GPU's clocks)
    cases = list(linear_cases(run))
    plan = [(i, m) for prefill in (False, True) for i in range(len(cases)) for m in run.ms_list()
            if (m > 256) == prefill]
    for i, m in plan:
        sh, name, fmt, n, k = cases[i]
        if run.elapsed() > run.args.budget:
            break
        if run.toy and name == "wo_a" and m > policy.MAX_ROWS:
            continue   # above the GEMV's rows wo_a is Triton dequantize + cuBLAS bmm: CUDA only
        try:  # wo_a runs as the model runs it: Ops.grouped_linear, x [M, groups, K]
            ms, cfg, wbytes = time_linear(run, fmt, n, k, m, groups=sh.o_groups if name == "wo_a" else 0)
            if (n, k, m) not in cublas:
                cublas[(n, k, m)] = time_cublas(run, n, k, m)
        except Exception as e:
            print(f"  {sh.name} {name} {fmt} M={m}: FAILED {e!r}"[:400], flush=True)
            run.res["errors"].append(f"linear {sh.name} {name} {fmt} M={m}: {e!r}"[:400])
            continue
        gemv_us = None   # below the dispatch threshold: the GEMV forced, for the record
        if m <= 16 and name != "wo_a" and isinstance(cfg, str) and wbytes < policy.PREFERRED_BYTES[fmt]:
            gemv_us = 1e3 * time_linear(run, fmt, n, k, m, cfg=GemvConfig())[0]
        cb = cublas[(n, k, m)]
        flops = 2 * m * n * k
        row = dict(model=sh.name, linear=name, fmt=fmt, N=n, K=k, M=m, us=ms * 1e3, weight_mb=wbytes / 1e6,
                   gbps=wbytes / (ms * 1e-3) / 1e9, pct_copy=100 * wbytes / (ms * 1e-3) / 1e9 / copy,
                   tflops=flops / (ms * 1e-3) / 1e12, cublas_us=cb * 1e3,
                   cublas_gbps=2 * n * k / (cb * 1e-3) / 1e9, cublas_tflops=flops / (cb * 1e-3) / 1e12,
                   speedup=cb / ms, config=cfg if isinstance(cfg, str) else asdict(cfg), gemv_us=gemv_us)
        rows.append(dict(row, case=i))
        print(f"  {sh.name:8s} {name:13s} {fmt:5s} M={m:<5d} {row['us']:9.1f} us {row['gbps']:6.0f} GB/s "
              f"({row['pct_copy']:3.0f}% copy) {row['tflops']:6.1f} TF | cuBLAS {row['cublas_us']:9.1f} us "
              f"{row['cublas_tflops']:6.1f} TF | x{row['speedup']:.2f}"
              + ("" if gemv_us is None else f" | GEMV forced {gemv_us:.1f} us"), flush=True)
    rows.sort(key=lambda x: (x["case"], x["M"]))   # the table in shape order


def moe_table(run: Run):
    """The whole MoE layer (routing kernel, routed experts, shared expert) vs the bytes of the experts it touches;
    also the routed experts through the other kernels where there are some (`other us`): the decode tiles at up to 8
    tokens, the sorted grouped tiles where the GEMV pair runs over expert blocks (`--moe-block-tokens`)."""
    rows = []
    run.res["moe"] = rows
    blocks = run.moe_block_tokens()
    run.res["moe_block_tokens"] = blocks
    copy = run.res.get("copy_gbps", 1.0)
    dev, gen = run.device, run.gen
    combos = [(s, "nvfp4", "fp8") for s in run.models] + [(run.models[0], "mxfp4", "fp8")]
    for s, fmt, shared_fmt in combos:
        w13 = random_qweight(fmt, (s.E, 2), s.I, s.D, dev, gen)
        w2 = random_qweight(fmt, (s.E,), s.D, s.I, dev, gen)
        sw13 = random_qweight(shared_fmt, (2,), s.I, s.D, dev, gen)
        sw2 = random_qweight(shared_fmt, (), s.D, s.I, dev, gen)
        per_expert = nbytes(w13) // s.E + nbytes(w2) // s.E
        shared_bytes = nbytes(sw13) + nbytes(sw2)
        bias = torch.zeros(s.E, device=dev)
        for t in run.moe_tokens():
            if run.elapsed() > run.args.budget:
                return
            rot = 2 if run.toy else 8
            xs = [run.x(t, s.D) for _ in range(rot)]
            logits = [torch.randn(t, s.E, device=dev, generator=gen) for _ in range(rot)]
            touched = [torch.unique(ref.route(lg, bias, s.k, 1.5)[1]).numel() for lg in logits]

            def layer(x, lg):   # as dsv4.model.moe runs it: the shared expert inside ops.moe, after the routing
                wts, ids = run.ops.route(lg, bias, s.k, 1.5)
                return run.ops.moe(x, ids, wts, w13, w2, 10.0, shared=(sw13, sw2), after_route=True,
                                   block_tokens=blocks)

            def routed(x, lg, **kw):
                wts, ids = run.ops.route(lg, bias, s.k, 1.5)
                return run.ops.moe(x, ids, wts, w13, w2, 10.0, **{"block_tokens": blocks, **kw})

            ms = run.timer.per_call_ms([lambda x=x, lg=lg: layer(x, lg) for x, lg in zip(xs, logits)])
            ms_r = run.timer.per_call_ms([lambda x=x, lg=lg: routed(x, lg) for x, lg in zip(xs, logits)])
            ms_alt = None
            in_blocks = policy.in_block_range(t, policy.resolve_block_tokens(blocks, s.E, s.k))
            if t <= 8 or in_blocks:
                # the other kernels on the same inputs, for the record: the decode tiles at <= 8 tokens, the sorted
                # grouped tiles where the pair over expert blocks runs

                def routed_alt(x, lg):
                    wts, ids = run.ops.route(lg, bias, s.k, 1.5)
                    return dispatch.moe(x, ids, wts, w13, w2, 10.0, fallback=_refuse, block_tokens=None,
                                        decode="tiles" if t <= policy.MOE_TOKENS else "auto", scratch=run.scratch)

                ms_alt = run.timer.per_call_ms([lambda x=x, lg=lg: routed_alt(x, lg) for x, lg in zip(xs, logits)])
            floor_routed = per_expert * sum(touched) / len(touched)
            floor = floor_routed + shared_bytes
            row = dict(model=s.name, fmt=fmt, shared_fmt=shared_fmt, T=t, experts_touched=sum(touched) / len(touched),
                       us=ms * 1e3, floor_mb=floor / 1e6, gbps=floor / (ms * 1e-3) / 1e9,
                       pct_floor=100 * (floor / (copy * 1e9)) / (ms * 1e-3),
                       routed_us=ms_r * 1e3, routed_floor_mb=floor_routed / 1e6,
                       routed_pct_floor=100 * (floor_routed / (copy * 1e9)) / (ms_r * 1e-3),
                       routed_other_us=None if ms_alt is None else ms_alt * 1e3)
            rows.append(row)
            print(f"  {s.name:8s} {fmt:5s} T={t:<4d} experts {row['experts_touched']:6.1f}  layer {row['us']:8.1f} us "
                  f"= {row['pct_floor']:3.0f}% of floor ({row['floor_mb']:.0f} MB)  | routed only "
                  f"{row['routed_us']:8.1f} us = {row['routed_pct_floor']:3.0f}%"
                  + ("" if ms_alt is None else f" (other kernels: {ms_alt * 1e3:.1f} us)"),
                  flush=True)
        del w13, w2, sw13, sw2


def model_check(run: Run):
    import subprocess
    cmd = [sys.executable, str(Path(__file__).with_name("model_check.py")), "--out", str(run.out)]
    if run.toy:
        cmd.append("--cpu-only")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    print(p.stdout[-3000:], p.stderr[-3000:], flush=True)
    f = run.out / "model_check.json"
    run.res["model_check"] = json.loads(f.read_text()) if f.exists() else {"error": p.stderr[-2000:]}


def table(run: Run) -> str:
    r = run.res
    lines = [f"dsv4 kernel benchmarks {r['started']}  {r.get('env', {})}",
             f"copy bandwidth: {r.get('copy_gbps', 0):.0f} GB/s (read+write)"]
    c = r.get("correctness", [])
    lines.append(f"correctness: {sum(x['ok'] for x in c)}/{len(c)} ok; failures: {r.get('correctness_failures')}")
    if "engine" in r:
        e = r["engine"]
        lines.append(f"engine checks: {sum(x['ok'] for x in e)}/{len(e)} ok; failures: {r.get('engine_failures')}")
    lines.append(f"launch overhead in a CUDA graph (us/launch): {r.get('launch_us')}")
    for x in r.get("sweep", []):
        lines.append(f"sweep {x['variant']:24s} {x['shape']:16s} {x['fmt']:5s} {x['us']:8.1f} us {x['gbps']:6.0f} GB/s")
    for x in r.get("prefill_compare", []):
        lines.append(f"prefill {x['shape']} {x['fmt']} M={x['M']}: fused {x['fused_tflops']:.0f} TF/s, "
                     f"dequant+cuBLAS {x['default_tflops']:.0f} TF/s, cuBLAS bf16 {x['cublas_tflops']:.0f} TF/s")
    lines.append("")
    lines.append(f"{'model':8s} {'linear':13s} {'fmt':5s} {'M':>5s} {'us':>9s} {'GB/s':>6s} {'%copy':>5s} {'TF/s':>6s} "
                 f"{'cuBLAS us':>9s} {'cuBLAS TF':>9s} {'speedup':>7s}")
    for x in r.get("linear", []):
        lines.append(f"{x['model']:8s} {x['linear']:13s} {x['fmt']:5s} {x['M']:5d} {x['us']:9.1f} {x['gbps']:6.0f} "
                     f"{x['pct_copy']:5.0f} {x['tflops']:6.1f} {x['cublas_us']:9.1f} {x['cublas_tflops']:9.1f} "
                     f"{x['speedup']:7.2f}" + ("" if x.get("gemv_us") is None else f"  gemv {x['gemv_us']:.1f}"))
    lines.append("")
    if r.get("moe"):
        lines.append(f"MoE over expert blocks at tokens {r.get('moe_block_tokens') or 'off'} (other us: the decode "
                     "tiles at <= 8 tokens, else the sorted path)")
    lines.append(f"{'model':8s} {'fmt':5s} {'T':>4s} {'experts':>7s} {'layer us':>9s} {'floor MB':>8s} {'%floor':>6s} "
                 f"{'routed us':>9s} {'%floor':>6s} {'other us':>9s}")
    for x in r.get("moe", []):
        other = x.get("routed_other_us")
        lines.append(f"{x['model']:8s} {x['fmt']:5s} {x['T']:4d} {x['experts_touched']:7.1f} {x['us']:9.1f} "
                     f"{x['floor_mb']:8.0f} {x['pct_floor']:6.0f} {x['routed_us']:9.1f} {x['routed_pct_floor']:6.0f} "
                     + (f"{other:9.1f}" if other is not None else f"{'-':>9s}"))
    mc = r.get("model_check")
    if mc:
        lines.append("")
        lines.append(f"model check: {json.dumps(mc)[:600]}")
    if r["errors"]:
        lines.append("")
        lines.append("errors: " + " | ".join(e.splitlines()[-1][:200] for e in r["errors"]))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    ap.add_argument("--toy", action="store_true", help="CPU interpreter dry run at toy shapes")
    ap.add_argument("--budget", type=float, default=500.0, help="seconds after which remaining sections are skipped")
    ap.add_argument("--sections", default="env,copy,precompile,correctness,sweep,linear,moe,model,prefill")
    ap.add_argument("--ms", default=M_LIST, help="activation rows of the linear table (decode and prefill)")
    ap.add_argument("--moe-tokens", default=MOE_TOKENS, help="tokens of the MoE layer table")
    ap.add_argument("--moe-block-tokens", default="auto",
                    help="FIRST,LAST, off or auto: token counts at which the MoE table runs the GEMV pair over expert "
                         "blocks (`moe(block_tokens=)`; auto: policy.auto_block_tokens, from 9 tokens to 6 pairs per "
                         "expert); its `other us` there is the sorted path (above 8 tokens)")
    ap.add_argument("--layout", choices=("tiled", "row-major"), default="tiled",
                    help="how the benchmarked weights are stored (formats.tiling; the loader tiles on CUDA)")
    ap.add_argument("--summary", metavar="RESULTS_JSON",
                    help="print the current-figures table (markdown) of a finished run's results.json and exit")
    args = ap.parse_args()
    if args.summary:
        import summary

        summary.main(args.summary)
        return
    os.environ[LAYOUT_ENV] = args.layout
    if args.toy:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    run = Run(args)
    want = set(args.sections.split(","))
    plan = [("env", env), ("copy", copy_bw), ("precompile", precompile), ("correctness", correctness),
            ("engine", engine), ("model", model_check), ("precompile", precompile_join), ("copy", launch_overhead),
            ("sweep", sweep), ("moe", moe_table), ("prefill", prefill_compare), ("crossover", crossover),
            ("linear", linear_table)]
    for name, fn in plan:
        if name in want:
            run.section(fn.__name__, lambda fn=fn: fn(run))
    run.res["elapsed_s"] = run.elapsed()
    run.save()
    text = table(run)
    (run.out / "table.txt").write_text(text)
    print(text, flush=True)


if __name__ == "__main__":
    main()
