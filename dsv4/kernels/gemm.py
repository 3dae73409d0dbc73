"""The fused tiles: one Triton GEMM for every weight-streaming product the decode GEMV does not take,
y = x @ W^T with W in its stored format, dequantized in registers for a bf16 (or fp32) MMA. It serves
* dense linears (`policy.plan_linear`: 9-256 rows, prefill with fp32 activations or FP8 with fp32 scales; with
  `group_r` block-diagonal, as wo_a);
* the shared expert and MoE gate/up (GATED: two shards, clamped SwiGLU in the epilogue);
* the MoE down projection (EPI_ROUTED: routing weight in the epilogue, fp32 rows per (token, slot), which
  `sum_rows` adds per token in slot order);
* the W4A4 emulation (A_FP4: NVFP4 activations, alpha applied once to the fp32 accumulator).
`dequantize` (`_dequant_kernel`) is the Triton twin of `QWeight.dequantize`, for dequantize + cuBLAS.

Row modes: ROWS_DENSE (rows 0..M-1, one weight), ROWS_PAIR (program m = (token, slot) pair m, expert
ids[m]: the decode MoE, no sorting), ROWS_SORTED (blocks of BM rows of one expert, from `moe.align`).
Any mode can split K across programs: partials go to an fp32 workspace and the last program of each output
tile (a self-resetting semaphore from `Scratch`) sums them in split order and runs the epilogue - one launch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..formats import QWeight
from .host import device_info, interpreting, operand, readable, scale_views
from .policy import Format, TileConfig, cdiv, k_block, tiles_take
from .tiles import (TILE_BYTES_C, FMT_CODES, _accumulate_8, _accumulate_fp4, _fp4_natural, _load_fp4,
                    _load_x_tile, _load_xfp4, _sum_split_partials, byte_offsets, epilogue_factor, group_size_c)

ROWS_DENSE, ROWS_PAIR, ROWS_SORTED = 0, 1, 2
EPI_STORE, EPI_ROUTED = 0, 2


class TileIo(NamedTuple):
    """Everything a fused-tiles launch reads and writes but the weight."""
    x: object            # activations [rows, K] (A_FP4: packed FP4 codes)
    stride_x: int
    x_sf: object         # A_FP4: the activations' E4M3 block scales
    stride_x_sf: int
    y: object
    stride_y: int
    rw: object           # EPI_ROUTED: routing weights per (token, slot) row
    rows: object         # ROWS_SORTED: the pairs of every block of BM rows (`moe.align`)
    ids: object          # ROWS_PAIR: expert per pair; ROWS_SORTED: expert per block
    nblk: object         # ROWS_SORTED: blocks used
    ws: object           # fp32 split-K partials [split, (gate, up), rows, N]
    stride_ws: int
    cnt: object          # split-K semaphores, one per output tile
    input_scale: object  # A_FP4: the activations' global scale
    limit: float         # the clamped SwiGLU's limit (GATED)
    group_r: int         # block-diagonal (wo_a): output columns per group (N: one dense weight)
    x_gstride: int       # block-diagonal: x columns from one group to the next
    N: int
    K: int


class TileGrid(NamedTuple):
    """The launch's row blocks and K splits (runtime values, left unspecialized)."""
    M: int               # output rows
    NUM_M: int           # row blocks
    X_DIV: int           # ROWS_PAIR / ROWS_SORTED: pair p reads x row p // X_DIV
    SPLIT_K: int
    GROUP_M: int         # row blocks per group of the launch order (L2 reuse of a weight tile)


class Tiles(NamedTuple):
    """The launch's compile-time choices (one constexpr)."""
    FMT: int
    SCALE_F32: bool
    A_FP4: bool
    ROWS: int
    GATED: bool
    EPI: int
    DOT: object
    PREC: str
    ASM: bool
    BM: int
    BN: int
    BK: int
    EVEN_K: bool
    PROMOTE: bool        # FP8: the block scale applied to each K block's fp32 partial
    SPLIT: bool
    TILED: bool


@triton.jit(do_not_specialize=["grid"])
def _qgemm_kernel(io, grid, w, T: tl.constexpr):
    """Program (tile, K split): output rows of row block pid_m (by row mode, `_tile_rows`) x columns of N tile
    pid_n, over K split pid_k (`_tile_acc`), then the epilogue (`_tile_store`). io / grid / w: `TileIo`, `TileGrid`,
    `host.Operand`; T: `Tiles`."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(io.N, T.BN)
    width = grid.GROUP_M * num_n
    first_m = (pid // width) * grid.GROUP_M
    group_rows = tl.minimum(grid.NUM_M - first_m, grid.GROUP_M)
    pid_m = first_m + (pid % width) % group_rows
    pid_n = (pid % width) // group_rows
    if T.ROWS == 2:
        if pid_m >= tl.load(io.nblk):
            return   # a block past those `moe.align` used
    rmask, xrow, yrow, e64 = _tile_rows(pid_m, io, grid, T)
    offs_n = pid_n * T.BN + tl.arange(0, T.BN)
    nmask = offs_n < io.N
    acc, acc_u = _tile_acc(io, grid, w, e64, xrow, rmask, offs_n, nmask, pid_n, T)
    _tile_store(acc, acc_u, io, grid, w, e64, yrow, rmask, offs_n, nmask, pid_m * num_n + pid_n, T)


@triton.jit
def _tile_rows(pid_m, io, grid, T: tl.constexpr):
    """(row mask, x rows, y rows, expert as int64) of row block pid_m: ROWS_DENSE rows pid_m * BM.., ROWS_PAIR pair
    pid_m (expert ids[pid_m]), ROWS_SORTED the pairs `moe.align` put in block pid_m (expert ids[pid_m])."""
    ROWS: tl.constexpr = T.ROWS
    BM: tl.constexpr = T.BM
    offs_r = tl.arange(0, BM)
    if ROWS == 0:
        rows = pid_m * BM + offs_r
        rmask = rows < grid.M
        xrow = rows
        yrow = rows
        e = pid_m * 0
    elif ROWS == 1:
        rmask = offs_r == 0
        yrow = pid_m + offs_r * 0
        xrow = yrow // grid.X_DIV
        e = tl.load(io.ids + pid_m).to(tl.int32)
    else:
        pair = tl.load(io.rows + pid_m * BM + offs_r)
        rmask = pair < grid.M
        yrow = tl.where(rmask, pair, 0)
        xrow = yrow // grid.X_DIV
        e = tl.load(io.ids + pid_m)
    return rmask, xrow, yrow, e.to(tl.int64)


@triton.jit
def _tile_acc(io, grid, w, e64, xrow, rmask, offs_n, nmask, pid_n, T: tl.constexpr):
    """fp32 [BM, BN] partial(s) (gate, up when GATED) of the program's K split: the weight decoded in registers, one
    dot per K step."""
    FMT: tl.constexpr = T.FMT
    SCALE_F32: tl.constexpr = T.SCALE_F32
    A_FP4: tl.constexpr = T.A_FP4
    GATED: tl.constexpr = T.GATED
    DOT: tl.constexpr = T.DOT
    PREC: tl.constexpr = T.PREC
    ASM: tl.constexpr = T.ASM
    BM: tl.constexpr = T.BM
    BN: tl.constexpr = T.BN
    BK: tl.constexpr = T.BK
    EVEN_K: tl.constexpr = T.EVEN_K
    PROMOTE: tl.constexpr = T.PROMOTE
    TILED: tl.constexpr = T.TILED
    wbase = w.w + e64 * w.stride_we
    sbase = w.s + e64 * w.stride_se
    # block-diagonal weights (wo_a): output columns [g*group_r, (g+1)*group_r) read x columns from g*x_gstride on
    # (the launcher keeps each N tile inside one group); x_gstride 0: one dense weight
    x_ptr = io.x + ((pid_n * BN) // io.group_r).to(tl.int64) * io.x_gstride
    n_chunks = tl.cdiv(io.K, BK)
    per_split = tl.cdiv(n_chunks, grid.SPLIT_K)
    c0 = tl.program_id(1) * per_split
    c1 = tl.minimum(c0 + per_split, n_chunks)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = acc
    for c in range(c0, c1):
        k0 = c * BK
        if FMT >= 2:  # packed FP4 weights
            if A_FP4:
                xt = _load_xfp4(x_ptr, io.x_sf, xrow, rmask, k0, io.stride_x, io.stride_x_sf, BM, BK, DOT, ASM)
            else:
                xt = _load_x_tile(x_ptr, xrow, rmask, k0, 0, io.stride_x, BK, True, DOT)
            acc = _accumulate_fp4(acc, xt, wbase, sbase, offs_n, nmask, k0, w.stride_wn, w.stride_sn,
                                  FMT, BM, BN, BK, DOT, PREC, ASM, TILED)
            if GATED:
                acc_u = _accumulate_fp4(acc_u, xt, wbase + w.stride_wg, sbase + w.stride_sg, offs_n, nmask, k0,
                                        w.stride_wn, w.stride_sn, FMT, BM, BN, BK, DOT, PREC, ASM,
                                        TILED)
        else:
            xt = _load_x_tile(x_ptr, xrow, rmask, k0, io.K, io.stride_x, BK, EVEN_K, DOT)
            acc = _accumulate_8(acc, xt, wbase, sbase, offs_n, nmask, k0, io.K, w.stride_wn, w.stride_sn,
                                FMT, SCALE_F32, BK, EVEN_K, DOT, PREC, PROMOTE, TILED, ASM)
            if GATED:
                acc_u = _accumulate_8(acc_u, xt, wbase + w.stride_wg, sbase + w.stride_sg, offs_n, nmask, k0, io.K,
                                      w.stride_wn, w.stride_sn, FMT, SCALE_F32, BK, EVEN_K, DOT,
                                      PREC, PROMOTE, TILED, ASM)
    return acc, acc_u


@triton.jit
def _tile_store(acc, acc_u, io, grid, w, e64, yrow, rmask, offs_n, nmask, tile, T: tl.constexpr):
    """The program's output tile through the epilogue (the factor undoing the decode prescale; GATED: SwiGLU;
    EPI_ROUTED: fp32 rows times the routing weight). SPLIT: split-K in one launch - park the fp32 partial(s), count
    arrivals on the tile's semaphore; the last program sums the partials in split order (deterministic), re-arms the
    semaphore and stores. Partials are indexed by output row, so every row mode can split."""
    FMT: tl.constexpr = T.FMT
    A_FP4: tl.constexpr = T.A_FP4
    GATED: tl.constexpr = T.GATED
    EPI: tl.constexpr = T.EPI
    BM: tl.constexpr = T.BM
    BN: tl.constexpr = T.BN
    SPLIT: tl.constexpr = T.SPLIT
    offs_y = yrow.to(tl.int64)[:, None] * io.stride_y + offs_n[None, :]
    omask = rmask[:, None] & nmask[None, :]
    if SPLIT:
        offs_ws = yrow.to(tl.int64)[:, None] * io.N + offs_n[None, :]
        plane = io.N.to(tl.int64) * grid.M          # (grid.M may be specialized to the constant 1)
        part = io.ws + tl.program_id(1).to(tl.int64) * io.stride_ws
        tl.store(part + offs_ws, acc, mask=omask)
        if GATED:
            tl.store(part + plane + offs_ws, acc_u, mask=omask)
        tl.debug_barrier()
        arrived = tl.atomic_add(io.cnt + tile, 1, sem="acq_rel", scope="gpu")
        last = arrived == grid.SPLIT_K - 1
        if last:
            acc, acc_u = _sum_split_partials(io.ws, io.stride_ws, plane, offs_ws, omask, grid.SPLIT_K, BM, BN,
                                             GATED)
            tl.atomic_xchg(io.cnt + tile, 0, sem="relaxed", scope="gpu")
        omask = omask & ((tl.zeros((BM, BN), dtype=tl.int32) + arrived) == grid.SPLIT_K - 1)  # the last stores
    s2base = w.s2 + e64 * w.stride_s2e
    f = epilogue_factor(s2base, FMT)
    if A_FP4:  # alpha = input_scale * weight_scale_2, once; 2^18 undoes both operands' prescale
        f = tl.load(s2base).to(tl.float32) * tl.load(io.input_scale).to(tl.float32) * 262144.0
    if GATED:
        f_u = epilogue_factor(s2base + w.stride_s2g, FMT)
        g = tl.minimum(acc * f, io.limit)
        u = tl.minimum(tl.maximum(acc_u * f_u, -io.limit), io.limit)
        e = tl.exp(-tl.abs(g))  # sigmoid without overflow for large |g|
        h = g * tl.where(g >= 0, 1.0 / (1.0 + e), e / (1.0 + e)) * u
        tl.store(io.y + offs_y, h.to(io.y.dtype.element_ty), mask=omask)
    elif EPI == 0:
        tl.store(io.y + offs_y, (acc * f).to(io.y.dtype.element_ty), mask=omask)
    else:
        rw = tl.load(io.rw + yrow, mask=rmask, other=0.0).to(tl.float32)
        tl.store(io.y + offs_y, acc * f * rw[:, None], mask=omask)


@triton.jit
def _sum_kernel(src_ptr, w_ptr, dst_ptr, N, S, stride_ss, stride_sr, stride_dr, BLOCK: tl.constexpr):
    """dst[r, :] = sum_{s < S} src[s * stride_ss + r * stride_sr + :] in fp32, in s order (deterministic), without
    the rows s whose weight w[r * S + s] is 0 (rows that may be unwritten)."""
    r = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(S):
        read = mask & (tl.load(w_ptr + r * S + s + offs * 0) != 0.0)     # the row's weight, in every lane
        acc += tl.load(src_ptr + s * stride_ss + r * stride_sr + offs, mask=read, other=0.0).to(tl.float32)
    tl.store(dst_ptr + r * stride_dr + offs, acc.to(dst_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------------- launching

def dot_dtype(x: torch.Tensor):
    """(operand dtype, input precision, asm allowed). The interpreter's bf16 tl.dot is broken, so it gets fp32."""
    if interpreting() or x.dtype == torch.float32:
        return tl.float32, "ieee", False
    return tl.bfloat16, "tf32", x.device.type == "cuda"


def launch(x, w: QWeight, y, cfg: TileConfig, *, M: int, rows: int = ROWS_DENSE, gated: bool = False,
           epi: int = EPI_STORE, x_div: int = 1, num_m: int | None = None, limit: float = 0.0,
           ids=None, rows_idx=None, nblk=None, rw=None, x_sf=None, input_scale=None, scratch=None,
           group_r: int = 0, x_gstride: int = 0):
    """Launch `_qgemm_kernel` for one (possibly stacked) QWeight into `y`. cfg.split_k > 1 (any row mode)
    reduces in-kernel through an fp32 workspace and semaphores from `scratch` (a fresh zeroed set without one).

    `group_r` > 0 (ROWS_DENSE, a multiple of cfg.BN): block-diagonal, as `grouped_linear` - output columns
    [g*group_r, (g+1)*group_r) read x columns [g*x_gstride, g*x_gstride + K). Returns the compiled kernel (its
    registers and shared memory)."""
    N, K = w.out_features, w.in_features
    if group_r and (rows != ROWS_DENSE or group_r % cfg.BN or N % group_r or x_sf is not None):
        raise ValueError(f"grouped columns need dense rows, no NVFP4 activations and group_r ({group_r}) a multiple "
                         f"of BN ({cfg.BN}) dividing N ({N})")
    scale_f32 = scale_views(w)[1]
    op = operand(w, gated)
    dot, prec, asm_ok = dot_dtype(x)
    asm = asm_ok if cfg.asm is None else (cfg.asm and asm_ok)
    if num_m is None:
        num_m = cdiv(M, cfg.BM)
    tiles = num_m * cdiv(N, cfg.BN)
    unused = op.w   # a typed pointer for what this launch does not read
    ws = cnt = None
    if cfg.split_k > 1:  # semaphores per output tile; fp32 partials [split, (gate, up), rows, N] by output row
        cnt = scratch.counters(x.device, tiles) if scratch is not None else \
            torch.zeros(tiles, dtype=torch.int32, device=x.device)
        ws = torch.empty(cfg.split_k, 2 if gated else 1, M, N, dtype=torch.float32, device=x.device)

    def given(t):
        return unused if t is None else t

    io = TileIo(x, x.stride(0), given(x_sf), 0 if x_sf is None else x_sf.stride(0), y, y.stride(-2), given(rw),
                given(rows_idx), given(ids), given(nblk), given(ws), 0 if ws is None else ws.stride(0), given(cnt),
                given(input_scale), float(limit), group_r or N, x_gstride if group_r else 0, N, K)
    tiles_c = Tiles(FMT_CODES[w.fmt], scale_f32, x_sf is not None, rows, gated, epi, dot, prec, asm, cfg.BM, cfg.BN,
                    cfg.BK, K % cfg.BK == 0, scale_f32 or cfg.BM < 64, cfg.split_k > 1, w.tiled)
    return _qgemm_kernel[(tiles, cfg.split_k)](
        io, TileGrid(M, num_m, x_div, cfg.split_k, min(cfg.group_m, num_m)), op, T=tiles_c,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg and not interpreting() else {}))


def sum_rows(src: torch.Tensor, dst: torch.Tensor, R: int, N: int, S: int, stride_ss: int, stride_sr: int,
             weights: torch.Tensor):
    """dst [R, N] = each row r's S rows of src summed (`_sum_kernel`), those whose weight (weights contiguous
    [R, S]) is 0 left out."""
    BLOCK = min(1024, triton.next_power_of_2(N))
    _sum_kernel[(R, triton.cdiv(N, BLOCK))](src, weights, dst, N, S, stride_ss, stride_sr, dst.stride(0),
                                            BLOCK=BLOCK)


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, s2_ptr, y_ptr, N, K, stride_wn, stride_sn, stride_yn,
                    FMT: tl.constexpr, SCALE_F32: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    ASM: tl.constexpr, TILED: tl.constexpr):
    """W [N, K] in its stored format (row-major or tiled) -> y [N, K] row-major (y's dtype): one rounding, of
    the exact fp32 value."""
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    nmask = offs_n < N
    k0 = tl.program_id(1) * BK
    rows = offs_n.to(tl.int64)[:, None]
    offs_k = k0 + tl.arange(0, BK)
    if FMT >= 2:
        GS: tl.constexpr = group_size_c(FMT)
        b, m = _load_fp4(w_ptr, s_ptr, rows, nmask, k0, stride_wn, stride_sn, FMT, BK, ASM, TILED)
        w = _fp4_natural(b, m, BN, BK, GS, tl.bfloat16, ASM, TILED).to(tl.float32) * epilogue_factor(s2_ptr, FMT)
        mask = nmask[:, None]
    else:
        mask = nmask[:, None] & (offs_k[None, :] < K)
        raw = tl.load(w_ptr + byte_offsets(rows, offs_k[None, :], stride_wn, TILE_BYTES_C, TILED), mask=mask, other=0)
        srow = s_ptr + (offs_n // 128).to(tl.int64) * stride_sn + k0 // 128
        if SCALE_F32:
            sv = tl.load(srow, mask=nmask, other=0.0)
        else:
            sv = (tl.load(srow, mask=nmask, other=0).to(tl.int32) << 23).to(tl.float32, bitcast=True)
        w = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sv[:, None]
    tl.store(y_ptr + rows * stride_yn + offs_k[None, :], w.to(y_ptr.dtype.element_ty), mask=mask)


def dequantize(w: QWeight, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Triton twin of `QWeight.dequantize` for one unstacked weight (exact in fp32; rounded once otherwise)."""
    dev = w.weight.device
    if w.leading or not (readable(w, dev) and tiles_take(Format(w.fmt), w.in_features, device_info(dev))):
        return w.dequantize(dtype)
    N, K = w.out_features, w.in_features
    fmt = FMT_CODES[w.fmt]
    scale, scale_f32, s2 = scale_views(w)
    wt = w.weight.view(torch.uint8)
    y = torch.empty(N, K, dtype=dtype, device=w.weight.device)
    BK = k_block(w.fmt, K, 128) or 128
    BN = 64
    _dequant_kernel[(triton.cdiv(N, BN), triton.cdiv(K, BK))](
        wt, scale, s2 if s2 is not None else wt, y, N, K, wt.stride(0), scale.stride(0), y.stride(0),
        FMT=fmt, SCALE_F32=scale_f32, BN=BN, BK=BK, ASM=w.weight.device.type == "cuda" and not interpreting(),
        TILED=w.tiled, num_warps=4)
    return y
