"""Shared pieces of the kernel benchmarks: V4 shapes, random stored-format weights, timing, byte counts."""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from dsv4.formats import QWeight, why_untileable

LAYOUT_ENV = "DSV4_BENCH_LAYOUT"   # "tiled" (default: what the loader gives the GPU kernels) or "row-major"


def bench_layout() -> str:
    layout = os.environ.get(LAYOUT_ENV, "tiled")
    if layout not in ("tiled", "row-major"):
        raise ValueError(f"{LAYOUT_ENV}={layout!r}: expected 'tiled' or 'row-major'")
    return layout


@dataclass(frozen=True)
class Shapes:
    name: str
    D: int          # hidden
    I: int          # expert intermediate
    E: int          # routed experts
    k: int          # experts per token
    q_lora: int
    heads: int
    head_dim: int
    o_groups: int
    o_lora: int
    index_heads: int = 64
    index_dim: int = 128
    vocab: int = 129280

    def linears(self) -> dict[str, tuple[int, int]]:
        """Benchmark linears: name -> (N, K) of the logical weight."""
        return {
            "expert w1/w3": (self.I, self.D),
            "expert w2": (self.D, self.I),
            "shared w1/w3": (self.I, self.D),
            "shared w2": (self.D, self.I),
            "wq_b": (self.heads * self.head_dim, self.q_lora),
            "wo_a": (self.o_groups * self.o_lora, self.heads * self.head_dim // self.o_groups),
            "wo_b": (self.D, self.o_groups * self.o_lora),
            "indexer wq_b": (self.index_heads * self.index_dim, self.q_lora),
        }

    def dense_linears(self) -> dict[str, tuple[int, int]]:
        """The bf16 products of a decode step, name -> (N, K): a CSA and an HCA layer's dense projections of x as
        one weight (`Attention.x_dense`: the compressor's wkv and wgate, CSA's twice as wide, and on CSA layers the
        indexer compressor's and its weights_proj), and the head."""
        csa = 2 * 2 * self.head_dim + 2 * 2 * self.index_dim + self.index_heads
        return {"x_dense CSA": (csa, self.D), "x_dense HCA": (2 * self.head_dim, self.D), "head": (self.vocab, self.D)}


FLASH = Shapes("V4-Flash", 4096, 2048, 256, 6, 1024, 64, 512, 8, 1024)
PRO = Shapes("V4-Pro", 7168, 3072, 384, 6, 1536, 128, 512, 16, 1024)
TOY = Shapes("toy", 128, 128, 8, 2, 128, 4, 64, 2, 64, 4, 32)   # K multiples of 128: the GEMV runs

# formats of each benchmark linear: the official release, and dsv4 convert --format nvfp4
LINEAR_FORMATS = {
    "expert w1/w3": ("nvfp4", "mxfp4"), "expert w2": ("nvfp4", "mxfp4"),
    "shared w1/w3": ("fp8", "nvfp4"), "shared w2": ("fp8", "nvfp4"),
    "wq_b": ("fp8", "nvfp4"), "wo_a": ("fp8", "nvfp4"), "wo_b": ("fp8", "nvfp4"),
    "indexer wq_b": ("fp8", "nvfp4"),
}


def random_qweight(fmt: str, lead: tuple, n: int, k: int, device, gen: torch.Generator,
                   scale_2: float | None = None) -> QWeight:
    """Random valid stored bytes (weights of magnitude ~0.02): every packed byte is two E2M1 codes; block scales
    stay in a realistic range. `scale_2` pins NVFP4's per-tensor scale (a power of two keeps bf16 exact).
    Stored tile-major where the shape allows, as the loader does on CUDA, unless `bench_layout()` is row-major."""
    w = _random_qweight(fmt, lead, n, k, device, gen, scale_2)
    if bench_layout() == "tiled" and not why_untileable(w.fmt, n, w.weight.shape[-1]):
        w = w.tile()
    return w


def rotated_qweights(fmt: str, n: int, k: int, device, gen: torch.Generator, count: int | None = None) -> list[QWeight]:
    """`count` weights of one shape for a timed batch (`Timer`), drawn one after the other by `random_qweight`;
    None: `rotations` of the first one's bytes."""
    w0 = random_qweight(fmt, (), n, k, device, gen)
    count = rotations(nbytes(w0)) if count is None else count
    return [w0] + [random_qweight(fmt, (), n, k, device, gen) for _ in range(count - 1)]


def _random_qweight(fmt: str, lead: tuple, n: int, k: int, device, gen: torch.Generator,
                    scale_2: float | None) -> QWeight:
    shape = (*lead, n)

    def rbytes(*s, lo=0, hi=256):
        return torch.randint(lo, hi, s, dtype=torch.uint8, device=device, generator=gen)

    if fmt == "nvfp4":
        w = rbytes(*shape, k // 2)
        sc = rbytes(*shape, k // 16, lo=0x30, hi=0x40).view(torch.float8_e4m3fn)   # 2^-3 .. 0.94
        s2 = torch.full(lead, scale_2 if scale_2 is not None else 0.0123, dtype=torch.float32, device=device)
        if scale_2 is None:
            s2 = s2 * (1 + 0.1 * torch.rand(lead, device=device, generator=gen))
        return QWeight("nvfp4", w, sc, s2, torch.full(lead, 0.011, dtype=torch.float32, device=device))
    if fmt == "mxfp4":
        scale = rbytes(*shape, k // 32, lo=118, hi=123).view(torch.float8_e8m0fnu)
        return QWeight("mxfp4", rbytes(*shape, k // 2), scale)
    if fmt == "fp8":
        w = rbytes(*shape, k)
        w = torch.where((w & 0x7F) == 0x7F, w ^ 0x01, w)      # no NaN codes
        tiles = (-(-n // 128), -(-k // 128))
        scale = rbytes(*lead, *tiles, lo=118, hi=124).view(torch.float8_e8m0fnu)
        return QWeight("fp8", w.view(torch.float8_e4m3fn), scale)
    if fmt == "dense":
        return QWeight("dense", torch.randn(*shape, k, device=device, generator=gen, dtype=torch.bfloat16) * 0.02)
    raise ValueError(fmt)


def random_routing(E: int, T: int, k: int, device, gen: torch.Generator) -> torch.Tensor:
    """Expert ids [T, k] as a router gives them: k distinct experts of E per token, uniformly at random."""
    return torch.stack([torch.randperm(E, device=device, generator=gen)[:k] for _ in range(T)])


def moe_decode_inputs(s: Shapes, T: int, rot: int, device, gen: torch.Generator):
    """`rot` rotated input sets of the MoE decode pair for T tokens of model `s`: x [T, D] bf16, ids [T, k] (k
    distinct experts per token), routing weights [T * k], h [T * k + T, I] and out [T, D] buffers, and the mean
    number of distinct experts the routings touch."""
    P = T * s.k
    xs = [torch.randn(T, s.D, device=device, generator=gen).bfloat16() for _ in range(rot)]
    ids = [random_routing(s.E, T, s.k, device, gen) for _ in range(rot)]
    rws = [torch.rand(P, device=device, generator=gen) for _ in range(rot)]
    hs = [torch.empty(P + T, s.I, device=device, dtype=torch.bfloat16) for _ in range(rot)]
    outs = [torch.empty(T, s.D, device=device, dtype=torch.bfloat16) for _ in range(rot)]
    return xs, ids, rws, hs, outs, sum(i.unique().numel() for i in ids) / rot


def nbytes(w: QWeight) -> int:
    """Bytes a kernel must read for this weight (packed values + scales)."""
    return sum(t.numel() * t.element_size() for t in (w.weight, w.scale, w.scale_2) if t is not None)


def expert_bytes(w13: QWeight, w2: QWeight, experts) -> int:
    per = (nbytes(w13) // w13.leading[0]) + (nbytes(w2) // w2.leading[0])
    return per * len(experts)


def rotations(nbytes_one: int, budget: int = 200 * 2**20, cap: int = 48) -> int:
    """How many rotated copies of an input of `nbytes_one` bytes a timed batch cycles through: enough that together
    they outgrow the L2 cache (`budget` bytes), so no call reads the previous call's bytes from it; 2 to `cap`."""
    return max(2, min(cap, -(-budget // max(1, nbytes_one))))


def rel_err(y: torch.Tensor, r: torch.Tensor) -> float:
    y, r = y.double(), r.double()
    return float((y - r).norm() / r.norm().clamp_min(1e-30))


class Timer:
    """Median time of a batch of calls. On CUDA: one CUDA graph holding all calls (each on its own rotated
    inputs, so nothing is served from L2), replayed under triton.testing.do_bench; elsewhere: the wall clock of the
    first call."""

    def __init__(self, device: torch.device):
        self.device = device

    def per_call_ms(self, calls, graph: bool = True, rep: int = 60) -> float:
        if self.device.type != "cuda":   # CPU dry runs (toy shapes, the interpreter): the first call once, no warm-up
            t = time.perf_counter()      # (the others are the same launch on rotated inputs: they check nothing more)
            calls[0]()
            return (time.perf_counter() - t) * 1e3
        import triton

        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for c in calls:
                c()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        if not graph:
            return triton.testing.do_bench(lambda: [c() for c in calls], warmup=10, rep=rep,
                                           return_mode="median") / len(calls)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for c in calls:
                c()
        ms = triton.testing.do_bench(g.replay, warmup=10, rep=rep, return_mode="median")
        del g
        return ms / len(calls)

    def rotated_us(self, fn, *args) -> float:
        """Median us per call of fn over rotated arguments: fn(args[0][i], args[1][i], ...) for each i."""
        return self.per_call_ms([functools.partial(fn, *a) for a in zip(*args)]) * 1e3


def lab_parser(toy_help: str) -> argparse.ArgumentParser:
    """A lab's parser with the arguments every variant-timing lab takes: --device, --rounds (timings per case, the
    median printed), --out, --toy (a CPU dry run that checks the script)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rounds", type=int, default=3, help="timings per case (the median is printed)")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    ap.add_argument("--toy", action="store_true", help=toy_help)
    return ap


def write_record(out: str, name: str, record: dict) -> Path:
    """A lab's record as JSON at out/name (the folder made if need be)."""
    path = Path(out, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
    return path


def median_us(timer: "Timer", calls, rounds: int) -> float:
    """The median over `rounds` timings of the calls' per-call time, in us."""
    return statistics.median(timer.per_call_ms(calls) * 1e3 for _ in range(rounds))


def record_failure(row: dict, error: Exception, head: str) -> None:
    """A lab case or variant that does not compile or run: its error into `row` (300 characters at most) and
    printed after the case's `head`, so that the lab goes on to the next."""
    row["error"] = f"{type(error).__name__}: {error}"[:300]
    print(f"{head} | failed: {row['error']}", flush=True)


def copy_bandwidth(device: torch.device, gib: float = 2.0) -> float:
    """GB/s of a large device-to-device copy, counting bytes read plus bytes written."""
    n = int(gib * 2**30) // 4
    a = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    b = torch.empty_like(a)
    t = Timer(device)
    ms = t.per_call_ms([lambda: b.copy_(a)], graph=False, rep=200)
    del a, b
    return 2 * n * 4 / (ms * 1e-3) / 1e9


def bench_start(toy: bool) -> tuple[torch.device, torch.Generator, Timer, float]:
    """What an MoE benchmark starts with: its device (the CPU for a `--toy` dry run, else CUDA), a generator seeded
    0 on it, a Timer, and the copy bandwidth in GB/s (printed; 1.0 on the toy run, whose percentages mean nothing)."""
    dev = torch.device("cpu" if toy else "cuda")
    copy = 1.0 if toy else copy_bandwidth(dev)
    print(f"copy bandwidth {copy:.0f} GB/s")
    return dev, torch.Generator(device=dev).manual_seed(0), Timer(dev), copy


def on_one_stream(model: torch.nn.Module, fuse_queries: bool) -> None:
    """The model without its second stream, for comparisons: every module's `Ops` table without `beside` (work
    started beside runs at once, on the current stream); with fuse_queries, each placed CSA layer's query products
    fused as on a table without a second stream (`Transformer.fuse_projections_`), else the same products as
    before."""
    from dsv4.kernels import Ops
    from dsv4.model.attention import Attention
    for module in model.modules():
        ops = getattr(module, "ops", None)
        if isinstance(ops, Ops):
            module.ops = replace(ops, beside=None)
        if fuse_queries and isinstance(module, Attention) and module.x_query_kv is not None:
            module.fuse_queries_()


def dummy_bench_model(model: str, layers: int, fmt: str, device: str | None):
    """(device, compute dtype, config, model): dummy weights in checkpoint format `fmt` for a preset or config.json
    `model` cut to `layers`; on CUDA (the default where there is one) in bf16 with the weights laid out for the kernels,
    else in fp32."""
    from dsv4.checkpoint.dummy import dummy_model
    from dsv4.config import ModelConfig
    from dsv4.kernels import ops_for

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    base = ModelConfig.from_json(model) if model.endswith(".json") else ModelConfig.preset(model)
    cfg = base.with_layers(layers)
    built = dummy_model(cfg, fmt, dev, dtype, ops_for(dev))
    if dev.type == "cuda":
        built.prepare_for_kernels_()
    return dev, dtype, cfg, built
