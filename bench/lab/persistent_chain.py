"""Question: What would a persistent decode layer buy at batch 1 over one launch per product?

docs/performance.md ("The speed targets still open") argues that a batch-1 layer stays at 2.3-2.7x issue 39's 75 us
because its weight stream stops between the products: each GEMV launch ramps up and drains, and dependent small
kernels sit between them. This lab measures the mechanism alone, without the model: a chain of dependent
matrix-vector products with a V4-Flash layer's byte sizes (int8 weights, one byte each, as FP8 has), each product's
input the previous product's output under an RMS scale (the norm every product of a layer waits for), run

    launches     one launch per product (the same unit code) in a CUDA graph, without PDL, or with it: each
                 program lets the next launch start, then loads its first weight tile, then waits;
    persistent   one launch for the whole chain: a grid of a few programs an SM that meet at a grid barrier (an
                 arrival count per product) before each product, optionally loading the first weight tile of
                 their next unit before they wait: weights never depend on the wait.

Each variant (`Variant`) also sets a unit's rows, the warps and the K loop's pipeline stages.

Both compute the same units (BN rows by the whole K, the sum of squares of their rows added atomically) and are
checked against a float64 chain on the same weights. `--layers L` chains L layers of distinct weights (the products
of a step), the torch copy of the same bytes gives the ceiling. Not modelled: the small kernels' own latency
(attention, mHC, the router), which a persistent layer would also have to run as tasks of the one kernel.

    python bench/lab/persistent_chain.py [--layers 1,4] [--variants SPEC,...] [--out DIR]   # on the GPU
    python bench/lab/persistent_chain.py --toy                                             # CPU dry run

A persistent grid must be resident all at once or its barrier never opens: each wait gives up after SPIN_LIMIT
polls and the launch reports it (`stuck`), so a grid too large shows as an error, not a hang.
Prints one line per (layers, variant): us per chain, GB/s and share of the copy's; writes persistent_chain.json.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository: dsv4
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # bench: common

from common import Timer, copy_bandwidth, lab_parser, median_us, record_failure, write_record  # noqa: E402

# A V4-Flash layer's products at batch 1 as (N, K) with their bytes at one byte a weight: wq_a with wkv (6.3 MB),
# wq_b, wo_a (eight groups as one product), wo_b (33.5 MB each), the MoE's gate/up (six NVFP4 experts and the FP8
# shared expert: 73 MB) and down (38 MB). 218 MB, against the 244 MB a layer reads with its small weights.
LAYER = [(1536, 4096), (32768, 1024), (8192, 4096), (4096, 8192), (17920, 4096), (4096, 9216)]
SMALL = [(1024, 1024)] * 24   # `--chain barriers`: 1 MB products, whose time is mostly the boundary between them
TOY_LAYER = [(64, 64), (128, 32), (64, 128), (128, 64)]
BK = 512                 # weights a loop step reads of each row
ROWS_MAX = 64            # every product's N is a multiple of the largest unit
TOY_BK = 32
W_SCALE = 1.0 / 64       # int8 weights in [-64, 64) times this
EPS = 1e-6
SPIN_LIMIT = 1 << 22     # polls of a barrier before a program gives up: far above any real wait, so a grid that is
                         # not resident at once ends its call in seconds, flagged stuck, instead of hanging


@triton.jit
def _weight_tile(W, w_off, K, rows, cols, mask):
    """Weights [rows, cols] of the product at W + w_off (K a row), int8; where `mask` (None: all) is false, 0."""
    ptrs = W + w_off + rows[:, None].to(tl.int64) * K + cols[None, :]
    if mask is None:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=mask, other=0)


@triton.jit
def _units(W, Y, SS, w_off, x_off, y_off, k, N, K, NX, first, step, w_first,
           HAS_FIRST: tl.constexpr, TMA: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, W_SCALE: tl.constexpr,
           EPS: tl.constexpr):
    """Units first, first + step, ... of product k: y[rows] = W[rows, :] @ x for BN rows each, where
    x[i] = Y[x_off + i % NX] * rsqrt(SS[k] / NX + EPS); the rows' sum of squares is added to SS[k + 1]. One loop
    runs over every (unit, K step) tile of the program, so the pipeline streams across units. With HAS_FIRST, the
    first tile is `w_first` (loaded before the caller's wait). With TMA the weight tiles come through a tensor
    descriptor (the copy engine, into shared memory), else through plain loads."""
    scale = tl.rsqrt(tl.load(SS + k, cache_modifier=".cg") / NX + EPS)
    r = tl.arange(0, BN)
    c = tl.arange(0, BK)
    steps = K // BK
    units = N // BN
    mine = tl.maximum(units - first + step - 1, 0) // step
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    if TMA:
        desc = tl.make_tensor_descriptor(W + w_off, shape=[N.to(tl.int32), K.to(tl.int32)], strides=[K, 1],
                                         block_shape=[BN, BK])
    for t in range(0, mine * steps):
        j = t // steps
        s = t - j * steps
        rows = (first + j * step) * BN + r
        cols = s * BK + c
        if TMA:
            w = desc.load([((first + j * step) * BN).to(tl.int32), (s * BK).to(tl.int32)])
            if HAS_FIRST:
                w = tl.where(t == 0, w_first, w)
        elif HAS_FIRST:
            w = tl.where(t == 0, w_first, _weight_tile(W, w_off, K, rows, cols, t > 0))
        else:
            w = _weight_tile(W, w_off, K, rows, cols, None)
        x = tl.load(Y + x_off + cols % NX, cache_modifier=".cg") * scale
        acc += w.to(tl.float32) * x[None, :]
        if s == steps - 1:
            y = tl.sum(acc, axis=1) * W_SCALE
            tl.store(Y + y_off + rows, y)
            tl.atomic_add(SS + k + 1, tl.sum(y * y, axis=0), sem="relaxed")
            acc = tl.zeros([BN, BK], dtype=tl.float32)


@triton.jit
def _product_kernel(W, Y, SS, w_off, x_off, y_off, k, N, K, NX, PDL: tl.constexpr, TMA: tl.constexpr,
                    BN: tl.constexpr, BK: tl.constexpr, W_SCALE: tl.constexpr, EPS: tl.constexpr):
    """One product as its own launch: a program per unit. Under PDL the program lets the next launch start, loads
    its first weight tile, and only then waits for the previous launch (whose output it reads)."""
    pid = tl.program_id(0)
    w_first = tl.zeros([BN, BK], dtype=tl.int8)
    if PDL:
        gdc_launch_dependents()
        w_first = _weight_tile(W, w_off, K, pid * BN + tl.arange(0, BN), tl.arange(0, BK), None)
        gdc_wait()
    _units(W, Y, SS, w_off, x_off, y_off, k, N, K, NX, pid, N // BN, w_first, PDL, TMA, BN, BK, W_SCALE, EPS)


@triton.jit
def _chain_kernel(W, Y, SS, COUNT, STUCK, WOFF, YOFF, NS, KS, XS, products,
                  PREFETCH: tl.constexpr, TMA: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, W_SCALE: tl.constexpr,
                  EPS: tl.constexpr, SPIN_LIMIT: tl.constexpr):
    """Every product of the chain in one launch. Program p takes units p, p + G, ... of each product (G programs)
    and arrives at COUNT[k] when done; before product k it waits until all G arrived at COUNT[k - 1], after loading
    its first unit's first tile when PREFETCH. A wait that outlasts SPIN_LIMIT polls sets STUCK and goes on."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    rows = pid * BN + tl.arange(0, BN)       # the program's first unit in every product
    for k in range(products):
        N = tl.load(NS + k)
        K = tl.load(KS + k)
        NX = tl.load(XS + k)
        w_off = tl.load(WOFF + k)
        w_first = tl.zeros([BN, BK], dtype=tl.int8)
        if PREFETCH:
            w_first = _weight_tile(W, w_off, K, rows, tl.arange(0, BK), (rows < N)[:, None])
        if k > 0:
            polls = 0
            arrived = tl.atomic_add(COUNT + k - 1, 0, sem="acquire")
            while (arrived < G) & (polls < SPIN_LIMIT):
                arrived = tl.atomic_add(COUNT + k - 1, 0, sem="acquire")
                polls += 1
            if arrived < G:
                tl.atomic_xchg(STUCK, 1)
        _units(W, Y, SS, w_off, tl.load(YOFF + k), tl.load(YOFF + k + 1), k, N, K, NX, pid, G, w_first,
               PREFETCH, TMA, BN, BK, W_SCALE, EPS)
        tl.atomic_add(COUNT + k, 1, sem="release")


class Chain:
    """The chain's weights, activations and tables on one device: `shapes` is the products' (N, K); product k's
    input element i is the previous output's element i modulo its length (the chain's input for product 0)."""

    def __init__(self, shapes: list[tuple[int, int]], device: torch.device, gen: torch.Generator, bk: int):
        assert all(n % ROWS_MAX == 0 and k % bk == 0 for n, k in shapes), shapes
        self.shapes, self.bk, self.device = shapes, bk, device
        sizes = [n * k for n, k in shapes]
        self.w = torch.randint(-64, 64, (sum(sizes),), dtype=torch.int8, device=device, generator=gen)
        self.woff = list(accumulate(sizes[:-1], initial=0))
        lengths = [shapes[0][1]] + [n for n, _ in shapes]          # slot 0: the input; slot k + 1: product k's output
        self.inputs = lengths[:-1]                                 # product k's input length
        self.yoff = list(accumulate(self.inputs, initial=0))
        self.y = torch.zeros(sum(lengths), dtype=torch.float32, device=device)
        self.y[:lengths[0]] = torch.randn(lengths[0], device=device, generator=gen)
        self.ss = torch.zeros(len(shapes) + 1, dtype=torch.float32, device=device)
        self.ss_start = torch.zeros_like(self.ss)                  # the input's sum of squares, then zeros
        self.ss_start[0] = (self.y[:lengths[0]].double() ** 2).sum()
        self.count = torch.zeros(len(shapes), dtype=torch.int32, device=device)
        self.stuck = torch.zeros(1, dtype=torch.int32, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        self.tables = (torch.tensor(self.woff, **i64), torch.tensor(self.yoff, **i64),
                       torch.tensor([n for n, _ in shapes], **i64), torch.tensor([k for _, k in shapes], **i64),
                       torch.tensor(self.inputs, **i64))

    @property
    def nbytes(self) -> int:
        return self.w.numel()

    def _reset(self):
        self.ss.copy_(self.ss_start)
        self.count.zero_()

    def launches(self, v: "Variant"):
        """One launch per product (a program per unit), under programmatic dependent launch when `v.pdl`."""
        self._reset()
        for k, (n, kk) in enumerate(self.shapes):
            _product_kernel[(n // v.rows,)](self.w, self.y, self.ss, self.woff[k], self.yoff[k], self.yoff[k + 1],
                                            k, n, kk, self.inputs[k], PDL=v.pdl, TMA=v.tma, BN=v.rows, BK=v.bk(self.bk),
                                            W_SCALE=W_SCALE, EPS=EPS, num_warps=v.warps, num_stages=v.stages,
                                            **({"launch_pdl": True} if v.pdl else {}))

    def persistent(self, v: "Variant", sms: int):
        """The whole chain in one launch of `v.per_sm` programs an SM."""
        self._reset()
        _chain_kernel[(sms * v.per_sm,)](self.w, self.y, self.ss, self.count, self.stuck, *self.tables,
                                         len(self.shapes), PREFETCH=v.pdl, TMA=v.tma, BN=v.rows, BK=v.bk(self.bk),
                                         W_SCALE=W_SCALE, EPS=EPS, SPIN_LIMIT=SPIN_LIMIT, num_warps=v.warps,
                                         num_stages=v.stages)

    def output(self) -> torch.Tensor:
        return self.y[self.yoff[-1]:].clone()

    def reference(self) -> torch.Tensor:
        """The chain in float64 on the CPU."""
        y = self.y[:self.shapes[0][1]].double().cpu()
        w = self.w.cpu()
        for k, (n, kk) in enumerate(self.shapes):
            x = y.repeat(kk // y.numel() + 1)[:kk] * torch.rsqrt((y * y).sum() / y.numel() + EPS)
            y = (w[self.woff[k]:self.woff[k] + n * kk].view(n, kk).double() @ x) * W_SCALE
        return y


@dataclass(frozen=True)
class Variant:
    """How a chain runs: `kind` "launches" or "persistent"; a unit's `rows`, the programs' `warps` and pipeline
    `stages`; `per_sm` persistent programs an SM; `pdl`: launches under PDL, or a persistent program's first tile
    loaded before each wait."""
    kind: str
    rows: int
    warps: int
    stages: int
    per_sm: int = 0
    pdl: bool = False
    tma: bool = False

    @staticmethod
    def parse(spec: str) -> "Variant":
        """"launches:ROWS:WARPS:STAGES[:pdl][:tma]" or "persistent:ROWS:WARPS:STAGES:PER_SM[:pdl][:tma]"."""
        kind, *rest = spec.split(":")
        flags = {f for f in rest if f in ("pdl", "tma")}
        try:
            nums = [int(x) for x in rest if x not in flags]
        except ValueError:
            nums = []
        if kind not in ("launches", "persistent") or len(nums) != (3 if kind == "launches" else 4):
            raise SystemExit(f"bad variant {spec!r}: {Variant.parse.__doc__}")
        return Variant(kind, *nums, pdl="pdl" in flags, tma="tma" in flags)

    def bk(self, default: int) -> int:
        """Weights a loop step reads of each row: a TMA box holds at most 256 elements a dimension."""
        return min(default, 256) if self.tma else default

    @property
    def name(self) -> str:
        where = f", {self.per_sm}/SM" if self.kind == "persistent" else ""
        extra = (", PDL" if self.kind == "launches" else ", tile first") if self.pdl else ""
        extra += ", TMA" if self.tma else ""
        return f"{self.kind} {self.rows}r {self.warps}w {self.stages}s{where}{extra}"


GPU_VARIANTS = ("launches:8:4:1,launches:8:4:1:pdl,launches:8:4:3:tma,persistent:8:4:3:4,"
                "persistent:16:8:3:2,persistent:32:8:3:1,persistent:32:8:4:1:tma")   # all resident on an H100
TOY_VARIANTS = "launches:8:4:1,launches:8:4:1:tma,persistent:8:4:1:1,persistent:8:4:1:1:pdl,persistent:8:4:1:1:pdl:tma"


def main():
    ap = lab_parser("CPU dry run at toy shapes, one persistent program (checks the script)")
    ap.add_argument("--layers", default="1,4", help="layers of products chained (distinct weights)")
    ap.add_argument("--chain", choices=("layer", "barriers"), default="layer",
                    help="layer: a V4-Flash layer's products; barriers: 24 products of 1 MB a layer")
    ap.add_argument("--variants", help=f"{Variant.parse.__doc__} (default: {GPU_VARIANTS}; toy: {TOY_VARIANTS})")
    args = ap.parse_args()
    dev = torch.device("cpu" if args.toy else args.device)
    gen = torch.Generator(device=dev).manual_seed(0)
    timer, label = Timer(dev), "toy" if args.toy else dev.type
    layer, bk = (TOY_LAYER, TOY_BK) if args.toy else (LAYER if args.chain == "layer" else SMALL, BK)
    sms = 1 if args.toy else torch.cuda.get_device_properties(dev).multi_processor_count
    specs = [Variant.parse(v) for v in (args.variants or (TOY_VARIANTS if args.toy else GPU_VARIANTS)).split(",")]
    if any(v.tma for v in specs):      # device-side tensor descriptors take their scratch from this allocator
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
    copy = 1.0 if args.toy else copy_bandwidth(dev)
    print(f"{label}: copy {copy:.0f} GB/s, {sms} SMs")
    print(f"{label:5s} {'layers':>6s} {'MB':>7s} {'variant':40s} | {'us':>8s} {'GB/s':>7s} {'of copy':>7s} | check")
    rows = []
    for L in map(int, args.layers.split(",")):
        chain = Chain(layer * L, dev, gen, bk)
        want = chain.reference()
        variants = [(v.name, (lambda v=v: chain.launches(v)) if v.kind == "launches" else
                     (lambda v=v: chain.persistent(v, sms))) for v in specs]
        variants += [("torch copy of the bytes", None)]
        scratch = torch.empty_like(chain.w) if not args.toy else None
        for name, fn in variants:
            row = dict(layers=L, variant=name, mbytes=chain.nbytes / 1e6)
            head = f"{label:5s} {L:6d} {chain.nbytes / 1e6:7.1f} {name:40s}"
            moved = chain.nbytes
            try:
                if fn is None:
                    if args.toy:
                        continue
                    fn = lambda: scratch.copy_(chain.w)                                    # noqa: E731
                    row["check"], moved = "-", 2 * chain.nbytes                          # a copy reads and writes
                else:
                    chain.stuck.zero_()
                    fn()
                    got = chain.output().double().cpu()
                    err = float((got - want).abs().max() / want.abs().max())
                    row["rel_err"] = err
                    row["stuck"] = bool(chain.stuck.item())
                    row["check"] = "stuck" if row["stuck"] else ("ok" if err < 1e-4 else f"err {err:.1e}")
                    if row["stuck"]:                    # each stuck wait polls SPIN_LIMIT times: not worth timing
                        print(f"{head} | stuck: the grid is not resident at once", flush=True)
                        rows.append(row)
                        continue
                row["us"] = median_us(timer, [fn], args.rounds)
            except Exception as e:                      # a variant that does not compile or run: say so, go on
                record_failure(row, e, head)
                rows.append(row)
                continue
            gbs = moved / (row["us"] * 1e-6) / 1e9
            row["gb_s"] = gbs
            print(f"{head} | {row['us']:8.1f} {gbs:7.0f} {gbs / copy:7.1%} | {row['check']}", flush=True)
            rows.append(row)
    write_record(args.out, "persistent_chain.json", dict(device=str(dev), copy_gb_s=copy, rows=rows))
    bad = [f"{r['layers']} {r['variant']}: {r.get('check', r.get('error'))}" for r in rows
           if r.get("check", "ok") not in ("ok", "-")]
    if bad:
        raise SystemExit(f"chains that failed their check: {bad}")


if __name__ == "__main__":
    main()
