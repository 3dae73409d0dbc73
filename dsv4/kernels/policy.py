"""Which launcher runs a call, and with which configuration: every tuned threshold and chooser of the Triton
kernels, and the two plans made from them (`plan_linear`, `plan_moe`).

Everything here is a pure function of formats, shapes and the device (no tensors, no Triton), so a plan is the same
on every call of one shape: `dispatch` makes it once per (shape, format, device) and then only launches. Each
tuned constant names its section of docs/tuning.md, which holds the measurements behind it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from types import MappingProxyType
from typing import NamedTuple

import torch

from ..formats import FP4_FORMATS


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def pow2_at_most(n: int, cap: int) -> int:
    return max(16, min(cap, next_pow2(max(1, n))))


# ------------------------------------------------------------------------------------------- inputs

@dataclass(frozen=True)
class Device:
    """What a plan needs of the device the kernels run on."""
    sms: int = 132             # streaming multiprocessors (4 stand in under the interpreter)
    gpu: bool = True           # the kernels run compiled on a CUDA GPU
    interpreted: bool = False  # the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1: the tests)

    @property
    def runs_kernels(self) -> bool:
        return self.gpu or self.interpreted


H200 = Device()
INTERPRETER = Device(sms=4, gpu=False, interpreted=True)


@dataclass(frozen=True)
class Format:
    """A weight's storage format and the dtype of its activations."""
    weight: str                           # fp8 | mxfp4 | nvfp4 | dense (what the kernels read; dense: `_plan_dense`);
                                          # anything else runs the reference
    act: torch.dtype = torch.bfloat16     # activations (fp32: exact runs and the interpreter)
    f32_scales: bool = False              # FP8 block scales stored as fp32 (the -Base checkpoints)


KERNEL_FORMATS = ("fp8", "mxfp4", "nvfp4")
UNREADABLE = "unreadable"   # `Format.weight` of a weight whose tensors the kernels cannot address (dispatch.readable)


def matrix_bytes(fmt: Format, N: int, K: int) -> int:
    """Stored bytes of one [N, K] matrix with its scales (what streams from memory)."""
    if fmt.weight == "fp8":
        return N * K + cdiv(N, 128) * cdiv(K, 128) * (4 if fmt.f32_scales else 1)
    if fmt.weight == "mxfp4":
        return N * K // 2 + N * K // 32
    if fmt.weight == "nvfp4":
        return N * K // 2 + N * K // 16 + 4
    return N * K * 2


# ------------------------------------------------------------------------------------- configurations

@dataclass(frozen=True)
class GemvConfig:
    """One launch of the decode GEMV (`gemv.py`): units of BN weight rows on `num_warps` warps (mma.sync)."""
    BN: int = 64
    split: int = 0            # K splits per output tile (ROWS_TOKEN: per slot); 0 = `plan_splits` chooses
    num_warps: int = 2        # with 4 and BN 128 Triton picks wgmma, which the operand layout is not made for
    maxnreg: int = -1         # registers per thread: -1 = 128 unless gated with 16 rows (it would spill); 0 = no cap
    num_stages: int = 2       # software pipelining of the weight loads (cp.async, then LDS in the operand layout)
    asm: bool | None = None   # PTX decoders; None = wherever the operands are bf16 on a GPU
    prefetch: int = 1         # register prefetch of the weights a loop iteration ahead, a bit mask: 1 FP8, 2 FP4
    pdl: bool = True          # programmatic dependent launch where the device has it
    pdl_l2: int = 2           # with pdl: sub-steps (a power of 2) of the first unit's tiled weights L2-prefetched
                              # before the wait; 0 = none
    group_cols: bool | None = None   # FP4, one x row per unit: the MMA's columns carry the scale groups
                                     # (`gemv.py`); None = in the MoE row modes only

    def __post_init__(self):
        if self.pdl_l2 < 0 or self.pdl_l2 & (self.pdl_l2 - 1):
            raise ValueError(f"GemvConfig.pdl_l2 must be 0 or a power of two (sub-steps), got {self.pdl_l2}")


@dataclass(frozen=True)
class TileConfig:
    """One launch of the fused tiles (`gemm.py`): [BM, BN] output tiles, BK-wide K steps."""
    BM: int
    BN: int
    BK: int
    split_k: int = 1
    group_m: int = 1          # row tiles per group of the launch order (L2 reuse of a weight tile)
    num_warps: int = 4
    num_stages: int = 4
    asm: bool | None = None   # PTX decoders; None = wherever the dot runs in bf16 on a GPU
    maxnreg: int = 0          # registers per thread (0: the compiler's own), e.g. to fit one more CTA per SM


# ------------------------------------------------------------------------------------------- the GEMV

ROWS_DENSE, ROWS_PAIR, ROWS_TOKEN = 0, 1, 2   # the GEMV's row modes (`gemv.py`)
MAX_ROWS = 16             # x rows per unit (the MMA's N) at most; at 32 the x sub-tiles spill
ALWAYS_ROWS = 8           # tuned on H200: docs/tuning.md#gemv-rows
PREFERRED_BYTES = MappingProxyType({"fp8": 20e6, "mxfp4": 30e6, "nvfp4": 30e6})   # docs/tuning.md#gemv-rows
MOE_TOKENS = 8            # the MoE's GEMV pair without expert blocks: docs/tuning.md#gemv-rows
THREE_STAGE_FP4_BYTES = 40e6   # tuned on H200: docs/tuning.md#gemv-stages
LARGE_FP4_8_ROWS = GemvConfig(num_stages=3)
LARGE_FP4_16_ROWS = GemvConfig(BN=128, maxnreg=0, num_stages=3)
UNIT_OVERHEAD_STEPS = 3   # a unit's fixed cost in sub-steps (index math, pipeline fill, epilogue), from SASS
COLS_TOKENS = 8           # tokens per row block of the shared expert's token columns: the MMA's N
SHARED_COLS_TOKENS = 4    # tuned on H200: docs/tuning.md#shared-expert-columns
SHARED_COLS_MAX = 16      # tuned on H200: docs/tuning.md#shared-expert-columns


def mma_n(rows: int) -> int:
    """The MMA's N (x rows per unit) for `rows` rows of x: 8 up to 8 rows, else 16."""
    return max(8, next_pow2(max(1, rows)))


def steps_of(fmt: str, K: int) -> int:
    """GEMV sub-steps of a K-wide row: 64 bytes each (128 FP4 or 64 FP8 elements)."""
    return K // (128 if fmt in FP4_FORMATS else 64)


def gemv_takes(fmt: Format, rows: int, K: int, device: Device) -> bool:
    """Formats, shapes and dtypes the GEMV reads: FP4 / FP8 weights, K a multiple of 128, at most MAX_ROWS rows of
    bf16 activations on a GPU (fp32 too under the interpreter)."""
    if fmt.weight not in KERNEL_FORMATS or rows > MAX_ROWS or K % 128:
        return False
    if device.interpreted:
        return fmt.act in (torch.float32, torch.bfloat16)
    return device.gpu and fmt.act == torch.bfloat16


def gemv_preferred(fmt: Format, rows: int, K: int, nbytes: float, device: Device) -> bool:
    """The GEMV takes the call and beats the fused tiles on it: at most ALWAYS_ROWS rows, or a large weight
    (always under the interpreter, where every kernel is tested)."""
    return gemv_takes(fmt, rows, K, device) and (device.interpreted or rows <= ALWAYS_ROWS
                                                 or nbytes >= PREFERRED_BYTES[fmt.weight])


def gemv_config(fmt: str, nbytes: float, rows: int = 1) -> GemvConfig:
    """The dense GEMV's configuration: GemvConfig(), but 3 stages for large FP4 weights, and from 9 rows (MMA N 16)
    units of 128 rows."""
    if fmt in FP4_FORMATS and nbytes >= THREE_STAGE_FP4_BYTES:
        return LARGE_FP4_8_ROWS if mma_n(rows) == 8 else LARGE_FP4_16_ROWS
    return GemvConfig()


def group_cols_on(cfg: GemvConfig, rows: int, M: int, fmt: str, shared_fmt: str | None) -> bool:
    """The group columns: where every unit reads one x row (the MoE row modes, or a dense call of one row) and the
    routed or shared weight is FP4; `cfg.group_cols` None = in the MoE row modes only (docs/tuning.md#group-columns)."""
    wanted = rows != ROWS_DENSE if cfg.group_cols is None else cfg.group_cols
    fp4 = fmt in FP4_FORMATS or shared_fmt in FP4_FORMATS
    return wanted and fp4 and (rows != ROWS_DENSE or M == 1)


def shared_cols(rows: int, R: int, pairs: int, shared) -> bool:
    """Whether the MoE's shared expert runs as row blocks whose MMA columns are COLS_TOKENS tokens each, so that each
    of its weight tiles is read and decoded once per 8 tokens instead of once per token (`shared`: the launch has
    one)."""
    tokens = R - pairs if rows == ROWS_PAIR else R
    return bool(shared) and rows in (ROWS_PAIR, ROWS_TOKEN) and SHARED_COLS_TOKENS <= tokens <= SHARED_COLS_MAX


def choose_split(units_per_split: int, n_steps: int, slots: int) -> int:
    """K splits minimizing waves x (steps per unit + UNIT_OVERHEAD_STEPS): splitting fills idle CTAs, but every unit
    pays its own prologue, epilogue and partial store; splits keep whole step pairs."""
    best, best_cost = 1, None
    for split in range(1, max(1, min(64, n_steps // 2)) + 1):
        chunk = cdiv(n_steps, split)
        chunk += chunk % 2
        used = cdiv(n_steps, chunk)
        cost = cdiv(units_per_split * used, slots) * (chunk + UNIT_OVERHEAD_STEPS)
        if best_cost is None or cost < best_cost:
            best, best_cost = used, cost
    return best


class Splits(NamedTuple):
    """The K splits of one GEMV launch: routed units of `chunk` sub-steps (`split` per output tile or slot), the
    shared expert's of `chunk_s` (`split_s`), and the partials each output tile sums."""
    units: int
    parts: int
    split: int
    chunk: int
    split_s: int
    chunk_s: int


def plan_splits(rows: int, R: int, routed_rows: int, topk: int, num_n: int, n_steps: int, n_steps_s: int,
                slots: int, forced: int = 0, cols: bool = False, blocks: int = 0) -> Splits:
    """The split plan of one launch over R row blocks (of which `routed_rows` stream the routed weight, the rest the
    shared expert's with n_steps_s sub-steps; 0 = none), ROWS_TOKEN slots of `topk` routed experts plus the shared
    one. Chunks are whole step pairs. `cols`: the shared expert has one row block per COLS_TOKENS tokens. `blocks`
    (> 0): the routed row blocks are the rows of the expert-block table.

    The routed split is `forced` or `choose_split`'s, and the shared expert gets the same. An FP8 shared expert
    beside FP4 experts has twice their sub-steps per unit; plans whose shared units are as long as the routed ones
    replace it where they fit one wave and cost less (cost = waves x (longest unit + UNIT_OVERHEAD_STEPS)); with
    `cols` it always gets twice the routed split (docs/tuning.md#shared-expert-splits)."""
    shared = n_steps_s > 0
    routed_blocks = blocks or (R * topk if rows == ROWS_TOKEN else routed_rows)
    shared_tokens = (R if rows == ROWS_TOKEN else R - routed_rows) if shared else 0
    shared_blocks = cdiv(shared_tokens, COLS_TOKENS) if cols else shared_tokens

    def plan(split, split_s):
        chunk = cdiv(n_steps, split)
        chunk += chunk % 2   # even: FP8 splits hold whole 128-K scale blocks, FP4 splits whole step pairs
        split = cdiv(n_steps, chunk)
        chunk_s = cdiv(max(n_steps_s, 1), split_s)
        chunk_s += chunk_s % 2
        split_s = cdiv(max(n_steps_s, 1), chunk_s)
        if rows == ROWS_TOKEN:
            parts = split * topk + (split_s if shared else 0)
        else:
            parts = max(split, split_s) if shared else split
        units = num_n * (routed_blocks * split + shared_blocks * split_s)
        longest = max(chunk, chunk_s) if shared else chunk
        return Splits(units, parts, split, chunk, split_s, chunk_s), cdiv(units, slots) * (longest + UNIT_OVERHEAD_STEPS)

    split = forced or choose_split((routed_blocks + shared_blocks) * num_n, n_steps, slots)
    ratio = n_steps_s // n_steps
    if cols and ratio > 1 and not forced:
        return plan(split, split * ratio)[0]
    best, best_cost = plan(split, split)
    if ratio > 1 and not forced:
        for s in range(1, max(1, n_steps // 2) + 1):
            balanced, cost = plan(s, s * ratio)
            if balanced.units > slots:
                break   # units only grow with the split
            if cost < best_cost:
                best, best_cost = balanced, cost
    return best


# -------------------------------------------------------------------------------------- the fused tiles

MID_ROWS = 256            # tuned on H200: docs/tuning.md#fused-tiles
MID_MIN_STEPS = 6         # tuned on H200: docs/tuning.md#fused-tiles
MID_CTAS_PER_SM = 2       # programs of these tiles that fit on an SM at once
MID_UNIT_OVERHEAD = 3     # a program's fixed cost in K steps (prologue, epilogue, split-K partial)
MID_MAX_SPLIT_ROWS_64 = 4   # tuned on H200: docs/tuning.md#fused-tiles
# the decode tiles (BM set per call): tuned on H200, docs/tuning.md#decode-tiles
DECODE_TILES_FP4 = TileConfig(0, 128, 128, num_warps=4, num_stages=3)
DECODE_TILES_FP8 = TileConfig(0, 128, 128, num_warps=8, num_stages=3)
FUSED_MID_BYTES = MappingProxyType({"nvfp4": 15e6, "mxfp4": 15e6, "fp8": 30e6})   # docs/tuning.md#fused-or-cublas


def k_block(fmt: str, K: int, want: int) -> int | None:
    """Largest BK <= want that the format allows: FP4 needs BK | K and BK >= 32 (one asm pack per half-group);
    FP8 needs BK | 128 (one block scale per K step); dense anything (masked tail)."""
    if fmt in FP4_FORMATS:
        return next((bk for bk in (256, 128, 64, 32) if bk <= want and K % bk == 0), None)
    return min(want, 128, pow2_at_most(K, 128))


def tiles_take(fmt: Format, K: int, device: Device) -> bool:
    """Whether the fused tiles read this weight (format, K) with these activations on this device."""
    if fmt.weight not in KERNEL_FORMATS or fmt.act not in (torch.bfloat16, torch.float32):
        return False
    if fmt.weight in FP4_FORMATS and k_block(fmt.weight, K, 256) is None:
        return False
    return device.runs_kernels


def decode_split(tiles: int, k_steps: int, sms: int) -> int:
    """Split-K of the decode tiles for row-block launches: none once `tiles` output tiles give 2 programs per SM,
    else enough splits for about that many programs, each keeping at least two of the `k_steps` K steps."""
    return 1 if tiles >= 2 * sms else max(1, min(k_steps // 2, cdiv(2 * sms, tiles)))


def dense_tiles(M: int, N: int, K: int, fmt: str, sms: int) -> TileConfig | None:
    """Fused tiles for a dense linear of up to MID_ROWS rows: BM the rows' power of two (at most 64 up to 64 rows,
    then 64 / 128), BN 64 or 128 and split-K chosen by `waves x (K steps per program + MID_UNIT_OVERHEAD)`, each
    candidate splitting K as far as one wave of programs and MID_MIN_STEPS steps per program allow (above 64 rows at
    most MID_MAX_SPLIT_ROWS_64); ties go to BN 64 (more programs)."""
    small = M <= 64
    BM = pow2_at_most(M, 64) if small else (128 if M >= 128 else 64)
    decode = DECODE_TILES_FP4 if fmt in FP4_FORMATS else DECODE_TILES_FP8
    BK = k_block(fmt, K, decode.BK if small else 64)
    if BK is None:
        return None
    slots = MID_CTAS_PER_SM * sms
    chunks = cdiv(K, BK)
    best = None
    for BN in sorted({min(bn, pow2_at_most(N, 128)) for bn in (64, 128)}):   # narrow weights: one N tile
        tiles = cdiv(M, BM) * cdiv(N, BN)
        split = max(1, min(chunks // MID_MIN_STEPS, slots // tiles, 64 if small else MID_MAX_SPLIT_ROWS_64))
        cost = cdiv(tiles * split, slots) * (cdiv(chunks, split) + MID_UNIT_OVERHEAD)
        if best is None or cost < best[0]:
            best = (cost, BN, split)
    _, BN, split = best
    if small:
        return TileConfig(BM, BN, BK, split, 1, decode.num_warps, decode.num_stages)
    return TileConfig(BM, BN, BK, split, 8, 4, 4)


def tile_config(M: int, N: int, K: int, fmt: str, sms: int, *, gated: bool = False, a_fp4: bool = False,
                row_blocks: int = 1) -> TileConfig | None:
    """Fused tiles. Dense linears of up to MID_ROWS rows (one weight, not gated, bf16 / fp32 activations):
    `dense_tiles`. Other decode calls (M <= 64 rows per block; `row_blocks` blocks, e.g. MoE pairs): the decode
    tiles, then split-K until ~2 programs per SM. Prefill: 128 x 128 output tiles grouped for L2 reuse, split-K only
    when the grid would leave SMs idle (M ~ 256)."""
    if M <= MID_ROWS and not gated and not a_fp4 and row_blocks == 1:
        return dense_tiles(M, N, K, fmt, sms)
    if M <= 64:
        BM = pow2_at_most(M, 64)
        t = DECODE_TILES_FP4 if fmt in FP4_FORMATS else DECODE_TILES_FP8
        BK = k_block(fmt, K, 64 if a_fp4 else t.BK)
        if BK is None:
            return None
        BN = min(t.BN, pow2_at_most(N, 128))
        split = decode_split(cdiv(N, BN) * row_blocks, cdiv(K, BK), sms)
        return TileConfig(BM, BN, BK, split, 1, t.num_warps, t.num_stages)
    BK = k_block(fmt, K, 64)
    if BK is None:
        return None
    BM = 128 if M >= 128 else 64
    BN = min(64 if gated else 128, pow2_at_most(N, 128))  # gated: two accumulators
    ntiles = cdiv(M, BM) * cdiv(N, BN)
    split = 1 if ntiles >= sms else max(1, min(cdiv(K, BK) // 4, cdiv(sms, ntiles)))
    return TileConfig(BM, BN, BK, split, 8, 8 if BM == 128 else 4, 4)


def fused_beats_cublas(fmt: str, nbytes: float, M: int) -> bool:
    """At M > 64 rows: whether the fused tiles beat Triton dequantize + cuBLAS for this weight."""
    return M <= MID_ROWS and fmt in FUSED_MID_BYTES and nbytes >= FUSED_MID_BYTES[fmt]


def prefers_cublas(fmt: Format, M: int, nbytes: float, device: Device) -> bool:
    """Above 64 rows in bf16 on a GPU: dequantize once and run cuBLAS, but for large weights up to MID_ROWS rows
    (`fused_beats_cublas`) and FP8 with fp32 scales (the fused tiles keep their exact promotion)."""
    return (M > 64 and device.gpu and fmt.act == torch.bfloat16 and not (fmt.weight == "fp8" and fmt.f32_scales)
            and not fused_beats_cublas(fmt.weight, nbytes, M))


# ------------------------------------------------------------------------------------------ linear plans

class Kernel(Enum):
    GEMV = "gemv"             # the decode GEMV (`gemv_launch.launch`)
    TILES = "tiles"           # the fused tiles (`gemm.launch`)
    CUBLAS = "cublas"         # Triton dequantize, then cuBLAS (`gemm.dequantize`)
    REFERENCE = "reference"   # `kernels.ref` (the Ops table's fallback)


@dataclass(frozen=True)
class LinearPlan:
    """How one product x @ W^T runs: `kernel` with `config` (a GemvConfig for GEMV, a TileConfig for TILES)."""
    kernel: Kernel
    config: GemvConfig | TileConfig | None = None


_REFERENCE = LinearPlan(Kernel.REFERENCE)


def plan_linear(fmt: Format, M: int, N: int, K: int, device: Device, *, gated: bool = False, groups: int = 1,
                force: GemvConfig | TileConfig | None = None) -> LinearPlan:
    """The plan of y = x @ W^T for x [M, K] and W [N, K]. `gated`: W is the shared expert's gate and up [2, N, K]
    with the clamped SwiGLU fused (no cuBLAS there). `groups` > 1: W is block-diagonal (wo_a), groups of N / groups
    rows each reading its own K columns of x. `force`: that GEMV or tile configuration (tests and benchmarks);
    a GemvConfig the GEMV cannot take is refused."""
    if groups > 1:
        return _plan_grouped(fmt, M, N, K, device, groups)
    if fmt.weight == "dense" and not gated:
        return _plan_dense(fmt, M, N, K, device, force)
    if not tiles_take(fmt, K, device):
        return _REFERENCE
    nbytes = matrix_bytes(fmt, N, K) * (2 if gated else 1)
    if isinstance(force, GemvConfig):
        if not gemv_takes(fmt, M, K, device):
            raise ValueError(f"a GemvConfig was forced on a call the GEMV does not take ({fmt.weight}, M={M}, "
                             f"K={K}, x {fmt.act})")
        return LinearPlan(Kernel.GEMV, force)
    if force is None and gemv_preferred(fmt, M, K, nbytes, device):
        return LinearPlan(Kernel.GEMV, GemvConfig() if gated else gemv_config(fmt.weight, nbytes, M))
    if force is None and not gated and prefers_cublas(fmt, M, nbytes, device):
        return LinearPlan(Kernel.CUBLAS)
    tiles = force or tile_config(M, N, K, fmt.weight, device.sms, gated=gated)
    return LinearPlan(Kernel.TILES, tiles) if tiles is not None else _REFERENCE


def _plan_dense(fmt: Format, M: int, N: int, K: int, device: Device,
                force: GemvConfig | TileConfig | None) -> LinearPlan:
    """A dense weight in its activations' dtype (`dispatch` sees any other as unreadable): the reference's F.linear
    (cuBLAS on a GPU), or the fused tiles where a TileConfig is forced and the kernels run (why cuBLAS is the
    default: docs/tuning.md#dense-decode)."""
    if isinstance(force, GemvConfig):
        raise ValueError(f"a GemvConfig was forced on a dense weight, which the GEMV does not read (M={M}, K={K})")
    if isinstance(force, TileConfig) and device.runs_kernels:
        return LinearPlan(Kernel.TILES, force)
    return _REFERENCE


def _plan_grouped(fmt: Format, M: int, N: int, K: int, device: Device, groups: int) -> LinearPlan:
    """Block-diagonal wo_a: one GEMV launch over all groups at decode (each N tile reads its group's x columns), the
    fused tiles the same way up to MID_ROWS rows, else Triton dequantize + one cuBLAS bmm (bf16 on a GPU)."""
    R = N // groups
    if R % GemvConfig().BN == 0 and gemv_takes(fmt, M, K, device):
        return LinearPlan(Kernel.GEMV, GemvConfig())
    tiles = tile_config(M, N, K, fmt.weight, device.sms) if M <= MID_ROWS else None
    if (tiles is not None and R % tiles.BN == 0 and M and tiles_take(fmt, K, device)
            and not prefers_cublas(fmt, M, matrix_bytes(fmt, N, K), device)):
        return LinearPlan(Kernel.TILES, tiles)
    if tiles_take(fmt, K, device) and device.gpu and fmt.act == torch.bfloat16:
        return LinearPlan(Kernel.CUBLAS)
    return _REFERENCE


# ------------------------------------------------------------------------------------------------ MoE

DECODE_TOKENS = 8             # at most this many tokens run the decode paths (the GEMV pair, or its tiles)
THREE_STAGE_UP_TOKENS = 2     # tuned on H200: docs/tuning.md#moe-stages
BLOCK_FROM_TOKENS = 9         # tuned on H200: docs/tuning.md#expert-blocks
BLOCK_PAIRS_PER_EXPERT = 6    # tuned on H200: docs/tuning.md#expert-blocks
SORTED_UP_MAXNREG_FP4 = 128   # tuned on H200: docs/tuning.md#sorted-registers
WIDE_DOWN_TOKENS = 2          # tuned on H200: docs/tuning.md#wide-down-units
WIDE_DOWN_EXPERT_BYTES = 8e6  # tuned on H200: docs/tuning.md#wide-down-units
WIDE_DOWN = GemvConfig(BN=128, maxnreg=0, pdl=False)
DOWN_PDL_TOKENS = 2           # tuned on H200: docs/tuning.md#moe-pdl
ROUTE_WARPS = 4               # tuned on H200: docs/tuning.md#route-warps
SIDE_FROM_TOKENS = 4          # tuned on H200: docs/tuning.md#side-stream
SIDE_SHARED_BYTES = 50e6      # tuned on H200: docs/tuning.md#side-stream
BESIDE_TOKENS = 256           # a step of at most this many tokens runs `Ops.start`'s work on the second stream
                              # (tuned on H100: docs/tuning.md#beside)


@dataclass(frozen=True)
class Experts:
    """A SwiGLU expert (stack) as a plan sees it: gate/up [2, I, D] and down [D, I] per expert."""
    up: Format
    down: Format
    D: int
    I: int

    def nbytes(self) -> int:
        """Stored bytes of one expert."""
        return 2 * matrix_bytes(self.up, self.I, self.D) + matrix_bytes(self.down, self.D, self.I)


class Routed(Enum):
    PAIR = "pair"             # the GEMV pair (`moe_pair.launch_pair`), over expert blocks where `blocks`
    TILES = "tiles"           # decode tiles over the (token, slot) pairs, then the routed down rows and their sum
    SORTED = "sorted"         # `moe.align`'s expert-sorted blocks through the grouped fused tiles
    REFERENCE = "reference"   # the Ops table's fallback
    EMPTY = "empty"           # no tokens: nothing to run


class Shared(Enum):
    NONE = "none"             # no shared expert
    IN_PAIR = "in-pair"       # streamed in the GEMV pair's launches
    SIDE = "side"             # on a second CUDA stream beside the routed experts (`dispatch.Side`)
    AFTER = "after"           # the Ops table's `mlp`, added after the routed experts


@dataclass(frozen=True)
class MoePlan:
    """How one MoE layer runs: the routed experts' path and configurations, and where the shared expert goes.
    PAIR: `up` / `down` GemvConfigs, `up_alone` gate/up's where the pair runs as two launches, `fused` one launch
    (True), two (False) or by waves (None: one launch where the down projection takes more than one wave).
    TILES / SORTED: TileConfigs. `x_ready`: gate/up streams the shared expert while the routing kernel runs."""
    routed: Routed
    shared: Shared = Shared.NONE
    blocks: bool = False
    up: GemvConfig | TileConfig | None = None
    down: GemvConfig | TileConfig | None = None
    up_alone: GemvConfig | None = None
    fused: bool | None = None
    x_ready: bool = False


def auto_block_tokens(n_experts: int, topk: int) -> tuple[int, int]:
    """Token counts that run the GEMV pair over expert blocks: from BLOCK_FROM_TOKENS to where the (token, slot)
    pairs reach BLOCK_PAIRS_PER_EXPERT per expert (V4-Flash 256, V4-Pro 384)."""
    return BLOCK_FROM_TOKENS, BLOCK_PAIRS_PER_EXPERT * n_experts // max(1, topk)


def resolve_block_tokens(block_tokens: tuple[int, int] | None | str, n_experts: int,
                         topk: int) -> tuple[int, int] | None:
    """A `block_tokens` option as a range: (first, last) or None as given, "auto" as `auto_block_tokens`."""
    if isinstance(block_tokens, str):
        if block_tokens != "auto":
            raise ValueError(f"moe: block_tokens {block_tokens!r}: expected (first, last), None or 'auto'")
        return auto_block_tokens(n_experts, topk)
    return block_tokens


def in_block_range(tokens: int, block_tokens: tuple[int, int] | None) -> bool:
    return block_tokens is not None and block_tokens[0] <= tokens <= block_tokens[1]


def beside_pair(tokens: int, shared_bytes: float, pair_carries: bool) -> bool:
    """Whether the shared expert runs on the side stream: wherever the GEMV pair does not carry it, and from
    SIDE_FROM_TOKENS tokens when it holds at least SIDE_SHARED_BYTES."""
    return not pair_carries or (tokens >= SIDE_FROM_TOKENS and shared_bytes >= SIDE_SHARED_BYTES)


def pair_configs(tokens: int, expert_down_bytes: float, overlap: bool):
    """The GEMV pair's (up, down, up_alone, fused) at `tokens` tokens: `expert_down_bytes` is one expert's w2 with
    its scales, `overlap` whether gate/up streams the shared expert while the routing kernel runs (PDL on gate/up,
    and on down up to DOWN_PDL_TOKENS tokens)."""
    up, down = GemvConfig(pdl=overlap), GemvConfig(pdl=overlap and tokens <= DOWN_PDL_TOKENS)
    up_alone = replace(up, num_stages=3) if tokens <= THREE_STAGE_UP_TOKENS else None
    if tokens <= WIDE_DOWN_TOKENS and expert_down_bytes >= WIDE_DOWN_EXPERT_BYTES:
        return up_alone or up, WIDE_DOWN, None, False   # two launches: the one-launch pair needs equal BN
    return up, down, up_alone, None


def tiles_configs(pairs: int, ex: Experts, sms: int):
    """Decode tiles of both stages over `pairs` one-row blocks (split-K in the same launch where SMs would idle)."""
    return (tile_config(1, ex.I, ex.D, ex.up.weight, sms, gated=True, row_blocks=pairs),
            tile_config(1, ex.D, ex.I, ex.down.weight, sms, row_blocks=pairs))


def sorted_configs(P: int, E: int, I: int, K: int, D: int, fmt_up: str, fmt_down: str):
    """Tiles of the sorted grouped path; BM follows the mean rows per touched expert."""
    per_expert = P / max(1, min(E, P))
    BM = 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64 if per_expert <= 96 else 128
    if BM <= 32:  # decode-like: the decode weight tiles
        t_up = DECODE_TILES_FP4 if fmt_up in FP4_FORMATS else DECODE_TILES_FP8
        t_dn = DECODE_TILES_FP4 if fmt_down in FP4_FORMATS else DECODE_TILES_FP8
        bk_up, bk_down = k_block(fmt_up, K, t_up.BK), k_block(fmt_down, I, t_dn.BK)
        if bk_up is None or bk_down is None:
            return None, None
        up = TileConfig(BM, min(t_up.BN, pow2_at_most(I, 128)), bk_up, 1, 1, t_up.num_warps, t_up.num_stages,
                        maxnreg=SORTED_UP_MAXNREG_FP4 if BM == 16 and fmt_up in FP4_FORMATS else 0)
        down = TileConfig(BM, min(t_dn.BN, pow2_at_most(D, 128)), bk_down, 1, 1, t_dn.num_warps, t_dn.num_stages)
        return up, down
    bk_up, bk_down = k_block(fmt_up, K, 64), k_block(fmt_down, I, 64)
    if bk_up is None or bk_down is None:
        return None, None
    warps = 8 if BM == 128 else 4
    return (TileConfig(BM, min(64, pow2_at_most(I, 64)), bk_up, 1, 1, warps, 4),
            TileConfig(BM, min(128, pow2_at_most(D, 128)), bk_down, 1, 1, warps, 4))


def _override(forced: tuple | None, default: tuple) -> tuple:
    """(up, down) configurations: the forced ones where given (an entry None keeps its default)."""
    return default if forced is None else tuple(f or d for f, d in zip(forced, default))


def _pair_carries(tokens: int, ex: Experts, shared: Experts, blocks: bool, device: Device) -> bool:
    """Whether the GEMV pair streams the shared expert in its launches: it has the routed experts' shapes, the GEMV
    reads it, and over expert blocks only as token columns."""
    return ((shared.D, shared.I) == (ex.D, ex.I) and gemv_takes(shared.up, 1, ex.D, device)
            and gemv_takes(shared.down, 1, ex.I, device) and (not blocks or shared_cols(ROWS_TOKEN, tokens, 0, True)))


def plan_moe(tokens: int, experts: int, top_k: int, weights: Experts, shared: Experts | None, device: Device, *,
             decode: str = "auto", decode_tokens: int = DECODE_TOKENS,
             block_tokens: tuple[int, int] | None | str = "auto", tiles: tuple | None = None,
             after_route: bool = False, side: bool = False) -> MoePlan:
    """The plan of one MoE layer of `tokens` tokens over `experts` experts, `top_k` per token.

    Routed experts: up to MOE_TOKENS tokens (`decode` "auto"; "gemv": up to `decode_tokens`) and over expert blocks
    at `block_tokens` (default `auto_block_tokens`), the GEMV pair; other calls of up to `decode_tokens` tokens the
    decode tiles ("tiles", or `tiles` = (up, down) TileConfigs); above, the sorted grouped tiles. The shared expert
    rides in the GEMV pair where it can, else runs beside the routed experts on a side stream (`side`: the caller
    has one) or after them; on the side stream also from SIDE_FROM_TOKENS tokens when it is large (`beside_pair`).
    `after_route`: the caller's promise that the routing kernel ran just before (`MoePlan.x_ready`)."""
    ex, T, P = weights, tokens, tokens * top_k
    if T == 0:
        return MoePlan(Routed.EMPTY)
    block_range = resolve_block_tokens(block_tokens, experts, top_k)
    blocks = in_block_range(T, block_range) and decode in ("auto", "gemv")
    gemv_tokens = {"auto": MOE_TOKENS, "gemv": decode_tokens}.get(decode, 0)
    if not (tiles_take(ex.up, ex.D, device) and tiles_take(ex.down, ex.I, device)):
        routed = Routed.REFERENCE
    elif ((T <= min(decode_tokens, gemv_tokens) or blocks) and tiles is None
          and gemv_takes(ex.up, 1, ex.D, device) and gemv_takes(ex.down, 1, ex.I, device)):
        routed = Routed.PAIR
    else:
        routed = Routed.TILES if T <= decode_tokens else Routed.SORTED
    carries = shared is not None and routed is Routed.PAIR and _pair_carries(T, ex, shared, blocks, device)
    if shared is None:
        place = Shared.NONE
    elif side and beside_pair(T, shared.nbytes(), carries):
        place = Shared.SIDE
    else:
        place = Shared.IN_PAIR if carries else Shared.AFTER
    if routed is Routed.PAIR:
        overlap = after_route and place is Shared.IN_PAIR
        up, down, up_alone, fused = pair_configs(T, matrix_bytes(ex.down, ex.D, ex.I), overlap)
        return MoePlan(routed, place, blocks, up, down, up_alone, fused, overlap)
    if routed is Routed.TILES:
        up, down = _override(tiles, tiles_configs(P, ex, device.sms))
        if up is None or down is None:
            return MoePlan(Routed.REFERENCE, place)
        return MoePlan(routed, place, up=replace(up, BM=16, group_m=P), down=replace(down, BM=16, group_m=P))
    if routed is Routed.SORTED:
        up, down = _override(tiles, sorted_configs(P, experts, ex.I, ex.D, ex.D, ex.up.weight, ex.down.weight))
        if up is None or down is None:
            return MoePlan(Routed.REFERENCE, place)
        nb_max = cdiv(P, up.BM) + min(P, experts)
        return MoePlan(routed, place, up=replace(up, group_m=nb_max), down=replace(down, BM=up.BM, group_m=nb_max))
    return MoePlan(routed, place)
