"""One Triton GEMM family for every weight-streaming product: y = x @ W^T with W in its stored format.

The same kernel serves
* dense linears (bf16 MMA after in-register dequantization) of 9..256 rows where the GEMV does not take them
  (`dense_tiles`; with `group_r` block-diagonal, as wo_a); above 64 rows in bf16 on CUDA only for weights it
  streams faster than Triton dequantize (`_dequant_kernel`) + cuBLAS (`fused_beats_cublas`), and at prefill sizes
  (M > 256) only for fp32 activations and FP8 with fp32 scales: there dequantize + cuBLAS measured ~1.8x faster;
* the shared expert and MoE gate/up (GATED: two shards, clamped SwiGLU in the epilogue);
* the MoE down projection (EPI_ROUTED: routing weight in the epilogue, fp32 rows per (token, slot); with
  `launch(sum_out=...)` the same launch also adds each token's top-k rows into its output row);
* the W4A4 emulation (A_FP4: NVFP4 activations, alpha applied once to the fp32 accumulator).

Row modes: ROWS_DENSE (rows 0..M-1, one weight), ROWS_PAIR (program m = (token, slot) pair m, expert
ids[m]: the decode MoE, no sorting), ROWS_SORTED (blocks of BM rows of one expert, from `moe.align`).
Any mode can split K across programs: partials go to an fp32 workspace and the last program of each output
tile (a self-resetting semaphore from `Scratch`) sums them in split order and runs the epilogue - one launch.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import torch
import triton
import triton.language as tl

from ..formats import FP4_FORMATS, QWeight
from . import gemv
from .host import interpreting, lead_strides, num_sms, scale_views
from .tiles import (TILE_BYTES_C, FMT_CODES, _accumulate_8, _accumulate_fp4, _fp4_natural, _load_fp4,
                    _load_x_tile, _load_xfp4, _sum_split_partials, byte_offsets, epilogue_factor, group_size_c)

ROWS_DENSE, ROWS_PAIR, ROWS_SORTED = 0, 1, 2
EPI_STORE, EPI_ROUTED = 0, 2
EPI_ROUTED_SUM = 3   # EPI_ROUTED, then the top-k sum in the same launch (`launch(sum_out=...)`)


@triton.jit(do_not_specialize=["M", "NUM_M", "X_DIV", "SPLIT_K", "GROUP_M"])
def _qgemm_kernel(
    x_ptr, xs_ptr, w_ptr, s_ptr, s2_ptr, a_ptr, y_ptr, rw_ptr, rows_ptr, ids_ptr, nblk_ptr, ws_ptr, cnt_ptr,
    sum_ptr, sum_cnt_ptr, stride_sum, TOPK,
    M, N, K, NUM_M, X_DIV, SPLIT_K, GROUP_M, limit, GROUP_R, X_GSTRIDE,
    stride_xm, stride_xsm,
    stride_we, stride_wg, stride_wn,
    stride_se, stride_sg, stride_sn,
    stride_s2e, stride_s2g,
    stride_ym, stride_ysplit,
    FMT: tl.constexpr, SCALE_F32: tl.constexpr, A_FP4: tl.constexpr, ROWS: tl.constexpr,
    GATED: tl.constexpr, EPI: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, ASM: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, PROMOTE: tl.constexpr,
    SPLIT: tl.constexpr, TILED: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_n = tl.cdiv(N, BN)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    group_rows = tl.minimum(NUM_M - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_rows
    pid_n = (pid % width) // group_rows

    offs_r = tl.arange(0, BM)
    if ROWS == 0:
        rows = pid_m * BM + offs_r
        rmask = rows < M
        xrow = rows
        yrow = rows
        e = pid_m * 0
    elif ROWS == 1:
        rmask = offs_r == 0
        yrow = pid_m + offs_r * 0
        xrow = yrow // X_DIV
        e = tl.load(ids_ptr + pid_m).to(tl.int32)
    else:
        if pid_m >= tl.load(nblk_ptr):
            return
        pair = tl.load(rows_ptr + pid_m * BM + offs_r)
        rmask = pair < M
        yrow = tl.where(rmask, pair, 0)
        xrow = yrow // X_DIV
        e = tl.load(ids_ptr + pid_m)
    e64 = e.to(tl.int64)
    wbase = w_ptr + e64 * stride_we
    sbase = s_ptr + e64 * stride_se
    s2base = s2_ptr + e64 * stride_s2e

    offs_n = pid_n * BN + tl.arange(0, BN)
    nmask = offs_n < N
    # block-diagonal weights (wo_a): output columns [g*GROUP_R, (g+1)*GROUP_R) read x columns from g*X_GSTRIDE on
    # (the launcher keeps each N tile inside one group); X_GSTRIDE 0: one dense weight
    x_ptr += ((pid_n * BN) // GROUP_R).to(tl.int64) * X_GSTRIDE
    n_chunks = tl.cdiv(K, BK)
    per_split = tl.cdiv(n_chunks, SPLIT_K)
    c0 = pid_k * per_split
    c1 = tl.minimum(c0 + per_split, n_chunks)

    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if GATED:
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for c in range(c0, c1):
        k0 = c * BK
        if FMT >= 2:  # packed FP4 weights
            if A_FP4:
                xt = _load_xfp4(x_ptr, xs_ptr, xrow, rmask, k0, stride_xm, stride_xsm, BM, BK, DOT, ASM)
            else:
                xt = _load_x_tile(x_ptr, xrow, rmask, k0, 0, stride_xm, BK, True, DOT)
            acc = _accumulate_fp4(acc, xt, wbase, sbase, offs_n, nmask, k0, stride_wn, stride_sn,
                                  FMT, BM, BN, BK, DOT, PREC, ASM, TILED)
            if GATED:
                acc_u = _accumulate_fp4(acc_u, xt, wbase + stride_wg, sbase + stride_sg, offs_n, nmask, k0,
                                        stride_wn, stride_sn, FMT, BM, BN, BK, DOT, PREC, ASM, TILED)
        else:
            xt = _load_x_tile(x_ptr, xrow, rmask, k0, K, stride_xm, BK, EVEN_K, DOT)
            acc = _accumulate_8(acc, xt, wbase, sbase, offs_n, nmask, k0, K, stride_wn, stride_sn,
                                FMT, SCALE_F32, BN, BK, EVEN_K, DOT, PREC, PROMOTE, TILED, ASM)
            if GATED:
                acc_u = _accumulate_8(acc_u, xt, wbase + stride_wg, sbase + stride_sg, offs_n, nmask, k0, K,
                                      stride_wn, stride_sn, FMT, SCALE_F32, BN, BK, EVEN_K, DOT, PREC, PROMOTE, TILED,
                                      ASM)

    offs_y = yrow.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    omask = rmask[:, None] & nmask[None, :]
    stored = rmask   # rows this program writes (with split-K: only the last split's program)
    if SPLIT:
        # split-K in one launch: park the fp32 partial(s), count arrivals on this output tile's semaphore; the
        # last program sums the partials in split order (deterministic), re-arms the semaphore for the next
        # call and runs the epilogue. Partials are indexed by output row, so every row mode can split.
        offs_ws = yrow.to(tl.int64)[:, None] * N + offs_n[None, :]
        plane = M.to(tl.int64) * N
        part = ws_ptr + pid_k.to(tl.int64) * stride_ysplit
        tl.store(part + offs_ws, acc, mask=omask)
        if GATED:
            tl.store(part + plane + offs_ws, acc_u, mask=omask)
        tl.debug_barrier()
        tile = pid_m * num_n + pid_n
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        last = arrived == SPLIT_K - 1
        if last:
            acc, acc_u = _sum_split_partials(ws_ptr, stride_ysplit, plane, offs_ws, omask, SPLIT_K, BM, BN, GATED)
            tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")
        omask = omask & ((tl.zeros((BM, BN), dtype=tl.int32) + arrived) == SPLIT_K - 1)  # only the last stores
        stored = rmask & ((offs_r * 0 + arrived) == SPLIT_K - 1)

    f = epilogue_factor(s2base, FMT)
    if A_FP4:  # alpha = input_scale * weight_scale_2, once; 2^18 undoes both operands' prescale
        f = tl.load(s2base).to(tl.float32) * tl.load(a_ptr).to(tl.float32) * 262144.0
    if GATED:
        f_u = epilogue_factor(s2base + stride_s2g, FMT)
        g = tl.minimum(acc * f, limit)
        u = tl.minimum(tl.maximum(acc_u * f_u, -limit), limit)
        e = tl.exp(-tl.abs(g))  # sigmoid without overflow for large |g|
        h = g * tl.where(g >= 0, 1.0 / (1.0 + e), e / (1.0 + e)) * u
        tl.store(y_ptr + offs_y, h.to(y_ptr.dtype.element_ty), mask=omask)
    elif EPI == 0:
        tl.store(y_ptr + offs_y, (acc * f).to(y_ptr.dtype.element_ty), mask=omask)
    else:
        rw = tl.load(rw_ptr + yrow, mask=rmask, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs_y, acc * f * rw[:, None], mask=omask)
        if EPI == 3:
            _topk_sum(y_ptr, sum_ptr, sum_cnt_ptr + pid_n, yrow, stored, offs_n, nmask, stride_ym, stride_sum,
                      num_n, TOPK, BM, BN)


@triton.jit
def _topk_sum(y_ptr, sum_ptr, cnt_ptr, yrow, stored, offs_n, nmask, stride_ym, stride_sum, num_n, TOPK,
              BM: tl.constexpr, BN: tl.constexpr):
    """The top-k sum fused into the routed down projection: y row p = token * TOPK + slot holds the slot's fp32
    routed output. Each row this program stored counts into its token's semaphore for this N tile (cnt_ptr +
    token * num_n, acquire-release); the program whose row is a token's last to arrive adds that token's TOPK
    rows in slot order (whoever arrives last: deterministic, the bits of `_sum_kernel`), writes the sum row and
    re-arms the semaphore."""
    tl.debug_barrier()   # every thread's y stores come before the release
    token = yrow // TOPK
    sem = cnt_ptr + token * num_n
    seen = tl.atomic_add(sem, 1, mask=stored, sem="acq_rel", scope="gpu")
    done = stored & (seen == TOPK - 1)
    dmask = done[:, None] & nmask[None, :]
    total = tl.zeros((BM, BN), dtype=tl.float32)
    for j in range(0, TOPK):
        row = (token * TOPK + j).to(tl.int64)
        total += tl.load(y_ptr + row[:, None] * stride_ym + offs_n[None, :], mask=dmask, other=0.0,
                         cache_modifier=".cg")
    tl.store(sum_ptr + token.to(tl.int64)[:, None] * stride_sum + offs_n[None, :],
             total.to(sum_ptr.dtype.element_ty), mask=dmask)
    tl.atomic_xchg(sem, 0, mask=done, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=["R"])
def _sum_kernel(src_ptr, dst_ptr, R, N, S, stride_ss, stride_sr, stride_dr, BLOCK: tl.constexpr):
    """dst[r, :] = sum_{s < S} src[s * stride_ss + r * stride_sr + :] in fp32, in s order (deterministic)."""
    r = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(S):
        acc += tl.load(src_ptr + s * stride_ss + r * stride_sr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst_ptr + r * stride_dr + offs, acc.to(dst_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------------- launching

@dataclass(frozen=True)
class Config:
    BM: int
    BN: int
    BK: int
    split_k: int = 1
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 4
    asm: bool | None = None  # None: ASM wherever the dot runs in bf16 on a GPU
    maxnreg: int = 0         # register cap per thread (0: the compiler's own count), e.g. to fit one more CTA per SM


def dot_dtype(x: torch.Tensor):
    """(operand dtype, input precision, asm allowed). The interpreter's bf16 tl.dot is broken, so it gets fp32."""
    if interpreting() or x.dtype == torch.float32:
        return tl.float32, "ieee", False
    return tl.bfloat16, "tf32", x.device.type == "cuda"


def _pow2_at_most(n: int, cap: int, floor: int = 16) -> int:
    return max(floor, min(cap, triton.next_power_of_2(max(1, n))))


def k_block(fmt: str, K: int, want: int) -> int | None:
    """Largest BK <= want that the format allows: FP4 needs BK | K and BK >= 32 (one asm pack per half-group);
    FP8 needs BK | 128 (one block scale per K step); dense anything (masked tail)."""
    if fmt in FP4_FORMATS:
        for bk in (256, 128, 64, 32):
            if bk <= want and K % bk == 0:
                return bk
        return None
    return min(want, 128, _pow2_at_most(K, 128))


@dataclass(frozen=True)
class DecodeTiles:
    """Weight-tile shape of the decode path (M <= 64), per format family. Measured on an H200 (bench/RESULTS.md)."""
    BN: int = 128
    BK: int = 128
    num_warps: int = 4
    num_stages: int = 4


# winners of the 32-point grid of bench/run_all.py (V4-Pro wq_b and V4-Flash wo_b at M = 1, H200, 2026-11-30)
DECODE_TILES_FP4 = DecodeTiles(128, 128, 4, 3)
DECODE_TILES_FP8 = DecodeTiles(128, 128, 8, 3)


def decode_split(tiles: int, k_steps: int, sms: int) -> int:
    """Split-K of the decode tiles for row-block launches (the MoE's `row_blocks`): none once `tiles` output tiles
    give 2 programs per SM, else enough splits for about that many programs, each keeping at least two of the
    `k_steps` K steps."""
    return 1 if tiles >= 2 * sms else max(1, min(k_steps // 2, triton.cdiv(2 * sms, tiles)))


# Dense linears of 17..MID_ROWS rows (`dense_tiles`). Measured on an H200 (bench/RESULTS.md round twenty-two,
# bench/lab/profile_tiles.py over 12 V4 linears at 32-256 rows): a launch of more programs than fit at once (2 CTAs
# per SM for these tiles) ends on a second, mostly idle wave, and a program of fewer than ~6 K steps spends its
# time in its pipeline fill and split-K partial; `decode_split`'s ~2 programs per SM with 2 steps each took up to
# 1.9x the best tiles (V4-Flash expert w1/w3 NVFP4 at 64 rows: 22.2 against 11.6 us).
MID_ROWS = 256
MID_MIN_STEPS = 6        # K steps per program at least, where the split allows
MID_CTAS_PER_SM = 2      # programs that fit on an SM at once, taken for every candidate tile
MID_UNIT_OVERHEAD = 3    # fixed cost per program in K steps (prologue, epilogue, split-K partial)
MID_MAX_SPLIT_ROWS_64 = 4   # above 64 rows: 64-128 row tiles park 32-64 KB fp32 partials each, which the last program
                            # sums alone; splits of 10-11 measured 1.5x split 4 (V4-Flash expert w1/w3 NVFP4, 128 rows:
                            # 36.3 against 25.0 us), and only splits up to 4 were measured there


def dense_tiles(M: int, N: int, K: int, fmt: str, sms: int) -> Config | None:
    """Fused tiles for a dense linear of 17..MID_ROWS rows of x (and of fewer rows where the GEMV does not take the
    call, e.g. 9..16 rows on weights of a few MB): BM the rows' power of two (64 at most up to 64 rows, then 64 / 128), BN 64 or 128 and split-K
    chosen by `waves x (K steps per program + MID_UNIT_OVERHEAD)`, each candidate splitting K as far as one wave
    of programs and MID_MIN_STEPS steps per program allow (above 64 rows at most MID_MAX_SPLIT_ROWS_64); ties go to
    BN 64 (more programs)."""
    small = M <= 64
    BM = _pow2_at_most(M, 64) if small else (128 if M >= 128 else 64)
    decode = DECODE_TILES_FP4 if fmt in FP4_FORMATS else DECODE_TILES_FP8
    BK = k_block(fmt, K, decode.BK if small else 64)
    if BK is None:
        return None
    slots = MID_CTAS_PER_SM * sms
    chunks = triton.cdiv(K, BK)
    best = None
    for BN in sorted({min(bn, _pow2_at_most(N, 128)) for bn in (64, 128)}):   # narrow weights: one N tile
        tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
        split = max(1, min(chunks // MID_MIN_STEPS, slots // tiles, 64 if small else MID_MAX_SPLIT_ROWS_64))
        cost = triton.cdiv(tiles * split, slots) * (triton.cdiv(chunks, split) + MID_UNIT_OVERHEAD)
        if best is None or cost < best[0]:
            best = (cost, BN, split)
    _, BN, split = best
    if small:
        return Config(BM, BN, BK, split, 1, decode.num_warps, decode.num_stages)
    return Config(BM, BN, BK, split, 8, 4, 4)


def pick_config(M: int, N: int, K: int, fmt: str, device: torch.device, *, gated: bool = False,
                a_fp4: bool = False, tiles: DecodeTiles | None = None, row_blocks: int = 1) -> Config | None:
    """Heuristic tiles. Dense linears of up to MID_ROWS rows (one weight, not gated, bf16 / fp32 activations):
    `dense_tiles`. Other decode calls (M <= 64 rows per block; `row_blocks` blocks, e.g. MoE pairs): the measured
    `DecodeTiles`, then split-K (reduced in the same launch, SwiGLU included) until ~2 programs per SM.
    Prefill (fused path): 128x128 output tiles grouped for L2 reuse, split-K only when the grid would leave
    SMs idle (M ~ 256)."""
    sms = num_sms(device)
    chunks_of = lambda bk: triton.cdiv(K, bk)  # noqa: E731
    if M <= MID_ROWS and not gated and not a_fp4 and tiles is None and row_blocks == 1:
        return dense_tiles(M, N, K, fmt, sms)
    if M <= 64:
        BM = _pow2_at_most(M, 64)
        t = tiles or (DECODE_TILES_FP4 if fmt in FP4_FORMATS else DECODE_TILES_FP8)
        BK = k_block(fmt, K, 64 if a_fp4 else t.BK)
        if BK is None:
            return None
        BN = min(t.BN, _pow2_at_most(N, 128))
        ntiles = triton.cdiv(N, BN) * row_blocks
        return Config(BM, BN, BK, decode_split(ntiles, chunks_of(BK), sms), 1, t.num_warps, t.num_stages)
    BK = k_block(fmt, K, 64)
    if BK is None:
        return None
    BM = 128 if M >= 128 else 64
    BN = min(64 if gated else 128, _pow2_at_most(N, 128))  # gated: two accumulators
    ntiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    split = 1 if ntiles >= sms else max(1, min(chunks_of(BK) // 4, triton.cdiv(sms, ntiles)))
    return Config(BM, BN, BK, split, 8, 8 if BM == 128 else 4, 4)


def weight_supported(w: QWeight, device: torch.device) -> bool:
    """Whether the Triton kernels read this (possibly stacked) weight; anything else runs the reference."""
    if w.fmt not in ("fp8", "mxfp4", "nvfp4") or w.weight.device != device:
        return False
    if w.weight.stride(-1) != 1 or (w.scale is not None and w.scale.stride(-1) != 1):
        return False
    if w.fmt in FP4_FORMATS and k_block(w.fmt, w.in_features, 256) is None:
        return False
    if w.fmt == "nvfp4" and w.scale_2 is None:
        return False
    return device.type == "cuda" or interpreting()


def supported(x: torch.Tensor, w: QWeight) -> bool:
    """Whether the Triton kernels take x @ W^T (activation dtype, width and device, and the weight)."""
    return (x.dtype in (torch.bfloat16, torch.float32) and x.shape[-1] == w.in_features
            and weight_supported(w, x.device))


def launch(x, w: QWeight, y, cfg: Config, *, M: int, rows: int = ROWS_DENSE, gated: bool = False,
           epi: int = EPI_STORE, x_div: int = 1, num_m: int | None = None, limit: float = 0.0,
           ids=None, rows_idx=None, nblk=None, rw=None, x_sf=None, input_scale=None, scratch=None,
           sum_out=None, topk: int = 1, group_r: int = 0, x_gstride: int = 0):
    """Launch `_qgemm_kernel` for one (possibly stacked) QWeight into `y`. cfg.split_k > 1 (any row mode)
    reduces in-kernel through an fp32 workspace and semaphores from `scratch` (a fresh zeroed set without one).

    `sum_out` [M / topk, N] (EPI_ROUTED only): the top-k sum in the same launch - y holds the routed fp32 row of
    every (token, slot) pair p = token * topk + slot, and sum_out[token] gets the sum of its topk rows in slot
    order (`_topk_sum`; the bits of `sum_rows`).

    `group_r` > 0 (ROWS_DENSE, a multiple of cfg.BN): block-diagonal, as `grouped_linear` - output columns
    [g*group_r, (g+1)*group_r) read x columns [g*x_gstride, g*x_gstride + K). Returns the compiled kernel (its
    registers and shared memory)."""
    N, K = w.out_features, w.in_features
    if group_r and (rows != ROWS_DENSE or group_r % cfg.BN or N % group_r or x_sf is not None):
        raise ValueError(f"grouped columns need dense rows, no NVFP4 activations and group_r ({group_r}) a multiple "
                         f"of BN ({cfg.BN}) dividing N ({N})")
    fmt = FMT_CODES[w.fmt]
    scale, scale_f32, s2 = scale_views(w)
    wt = w.weight.view(torch.uint8) if w.fmt != "dense" else w.weight
    lead = w.leading
    swe, swg = lead_strides(wt, lead, gated)
    sse, ssg = lead_strides(scale, lead, gated)
    s2e, s2g = lead_strides(s2, lead, gated)
    dot, prec, asm_ok = dot_dtype(x)
    asm = asm_ok if cfg.asm is None else (cfg.asm and asm_ok)
    if num_m is None:
        num_m = triton.cdiv(M, cfg.BM)
    tiles = num_m * triton.cdiv(N, cfg.BN)
    grid = (tiles, cfg.split_k)
    dummy = wt
    ws = cnt = sum_cnt = None
    if sum_out is not None and (epi != EPI_ROUTED or gated or M % topk or sum_out.shape[0] * topk != M):
        raise ValueError(f"the fused top-k sum needs the routed down projection (EPI_ROUTED, not gated) over "
                         f"tokens x topk rows; got epi {epi}, gated {gated}, M {M}, topk {topk}, "
                         f"sum_out {tuple(sum_out.shape)}")
    n_sum = (M // topk) * triton.cdiv(N, cfg.BN) if sum_out is not None else 0
    if cfg.split_k > 1 or n_sum:
        # semaphores: split-K's per output tile, then the top-k sum's per (token, N tile)
        n_split = tiles if cfg.split_k > 1 else 0
        buf = scratch.counters(x.device, n_split + n_sum) if scratch is not None else \
            torch.zeros(n_split + n_sum, dtype=torch.int32, device=x.device)
        cnt, sum_cnt = buf[:max(n_split, 1)], buf[n_split:n_split + n_sum]
    if cfg.split_k > 1:  # fp32 partials [split, (gate, up), rows, N]; rows are output rows (M, or pairs)
        ws = torch.empty(cfg.split_k, 2 if gated else 1, M, N, dtype=torch.float32, device=x.device)
    out = y
    return _qgemm_kernel[grid](
        x, x_sf if x_sf is not None else dummy, wt, scale if scale is not None else dummy,
        s2 if s2 is not None else dummy, input_scale if input_scale is not None else dummy,
        out, rw if rw is not None else dummy, rows_idx if rows_idx is not None else dummy,
        ids if ids is not None else dummy, nblk if nblk is not None else dummy,
        ws if ws is not None else dummy, cnt if cnt is not None else dummy,
        sum_out if sum_out is not None else dummy, sum_cnt if sum_cnt is not None else dummy,
        sum_out.stride(0) if sum_out is not None else 0, topk,
        M, N, K, num_m, x_div, cfg.split_k, min(cfg.group_m, num_m), float(limit), group_r or N,
        x_gstride if group_r else 0,
        x.stride(0), x_sf.stride(0) if x_sf is not None else 0,
        swe, swg, wt.stride(-2),
        sse, ssg, scale.stride(-2) if scale is not None else 0,
        s2e, s2g,
        out.stride(-2), ws.stride(0) if ws is not None else 0,
        FMT=fmt, SCALE_F32=scale_f32, A_FP4=x_sf is not None, ROWS=rows, GATED=gated,
        EPI=EPI_ROUTED_SUM if sum_out is not None else epi,
        DOT=dot, PREC=prec, ASM=asm, BM=cfg.BM, BN=cfg.BN, BK=cfg.BK,
        EVEN_K=K % cfg.BK == 0, PROMOTE=scale_f32 or cfg.BM < 64, SPLIT=cfg.split_k > 1, TILED=w.tiled,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg and not interpreting() else {}),
    )


def sum_rows(src: torch.Tensor, dst: torch.Tensor, R: int, N: int, S: int, stride_ss: int, stride_sr: int):
    BLOCK = min(1024, triton.next_power_of_2(N))
    _sum_kernel[(R, triton.cdiv(N, BLOCK))](src, dst, R, N, S, stride_ss, stride_sr, dst.stride(0), BLOCK=BLOCK)


class Scratch:
    """Split-K semaphores, zeroed once per device and re-armed by the kernels themselves, so a split-K product
    is one launch; and the resident-CTA count of each compiled GEMV (the slots its split plan fills). Owned by the
    `Ops` table that hands it to its calls (one stream at a time)."""

    def __init__(self):
        self._counters: dict[torch.device, torch.Tensor] = {}
        self._resident: dict = {}

    def resident(self, key, compute) -> int:
        if key not in self._resident:
            self._resident[key] = compute()
        return self._resident[key]

    def counters(self, device: torch.device, n: int) -> torch.Tensor:
        buf = self._counters.get(device)
        if buf is None or buf.numel() < n:
            buf = torch.zeros(max(n, 8192), dtype=torch.int32, device=device)
            self._counters[device] = buf
        return buf


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
    if w.leading or not weight_supported(w, w.weight.device):
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


# Weights that the fused tiles stream faster than Triton dequantize + cuBLAS at 65..MID_ROWS rows (H200, bench/RESULTS.md
# rounds twenty-two and twenty-three): FP4 from ~15 MB (V4-Flash wq_b NVFP4 at 128 / 256 rows: 24 / 44 against 48 / 52
# us; V4-Pro wo_b 93 / 160 against 155 / 168), FP8 from ~30 MB (with the integer e4m3 decoder, at 256 rows: V4-Pro wq_b
# 133 against 158 us, wo_b 170 against 178, V4-Flash wo_b 60 against 61). Below these the dequantize pass is cheap and
# cuBLAS's MMA loop wins (V4-Flash expert w1/w3 at 128 rows: 16.2 against 17.8 us for the best fused tiles).
FUSED_MID_BYTES = MappingProxyType({"nvfp4": 15e6, "mxfp4": 15e6, "fp8": 30e6})


def fused_beats_cublas(fmt: str, nbytes: int, M: int) -> bool:
    """At M > 64 rows: whether the fused tiles (`dense_tiles`) beat Triton dequantize + cuBLAS for this weight."""
    return M <= MID_ROWS and fmt in FUSED_MID_BYTES and nbytes >= FUSED_MID_BYTES[fmt]


def prefers_cublas(x: torch.Tensor, w: QWeight, M: int) -> bool:
    """Prefill (M > 64) on CUDA in bf16: dequantize once (2.5 B/element of traffic) and run cuBLAS, which beats
    the fused tiles there - but for large weights at up to MID_ROWS rows (`fused_beats_cublas`). NVFP4 weights
    then carry weight_scale_2 rounded into bf16 (one rounding per weight, far below the bf16 output rounding);
    FP8 with fp32 scales keeps the fused kernel's exact promotion."""
    return (M > 64 and x.device.type == "cuda" and x.dtype == torch.bfloat16 and not interpreting()
            and not (w.fmt == "fp8" and w.scale.dtype == torch.float32)
            and not fused_beats_cublas(w.fmt, w.nbytes(), M))


def linear(x: torch.Tensor, w: QWeight, *, config: Config | None = None, out: torch.Tensor | None = None,
           fallback=None, scratch: Scratch | None = None) -> torch.Tensor:
    """y = x @ W^T: x [..., K] -> [..., N] in x.dtype. Decode (M <= gemv.MAX_ROWS) runs the register-streaming
    GEMV of `gemv.py` where it is preferred (`gemv.preferred`: large weights), other calls of up to 64 rows
    this module's fused tiles (`dense_tiles`); above, dequantize + cuBLAS (`prefers_cublas`) or the fused tiles.
    Shapes and formats no kernel takes go to `fallback` (the reference). `config` forces this module's fused
    kernel with those tiles (a `gemv.GemvConfig` forces the GEMV)."""
    if w.leading:
        raise ValueError(f"linear takes one weight, got stacked leading dims {w.leading}")
    if not supported(x, w):
        return fallback(x, w)
    shape = x.shape
    M, N = x.numel() // max(1, shape[-1]), w.out_features
    if config is None or isinstance(config, gemv.GemvConfig):
        x2 = x.reshape(-1, shape[-1])
        if gemv.preferred(w, x2, M) or (config is not None and gemv.supported(w, x2, M)):
            x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
            y = gemv.linear(x2, w, config, out=None if out is None else out.view(M, N), scratch=scratch)
            return y.reshape(*shape[:-1], N)
        if config is not None:
            raise ValueError(f"a GemvConfig was forced on a call the GEMV does not take ({w.fmt}, M={M}, x {x.dtype})")
    if config is None and prefers_cublas(x, w, M):
        y = torch.nn.functional.linear(x, dequantize(w, x.dtype))
        if out is not None:
            out.copy_(y.reshape(out.shape))
            return out
        return y
    cfg = config or pick_config(M, N, w.in_features, w.fmt, x.device)
    if cfg is None:
        return fallback(x, w)
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = out if out is not None else torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M:
        launch(x2, w, y, cfg, M=M, scratch=scratch)
    return y.reshape(*shape[:-1], N)


def grouped_linear(x: torch.Tensor, w: QWeight, groups: int, *, fallback=None,
                   scratch: Scratch | None = None) -> torch.Tensor:
    """Same contract as `ref.grouped_linear`. Decode (<= gemv.MAX_ROWS tokens): one GEMV launch over all groups
    (each N tile reads its group's x columns); up to MID_ROWS tokens the fused tiles the same way (`dense_tiles`,
    where `fused_beats_cublas` on CUDA); otherwise, bf16 on CUDA: Triton dequantize + one cuBLAS bmm."""
    from .ref import check_grouped
    check_grouped(x, w, groups)
    c = x.shape[-1]
    R = w.out_features // groups
    x2 = x.reshape(-1, groups * c)
    T = x2.shape[0]
    cfg = gemv.GemvConfig()
    if R % cfg.BN == 0 and gemv.supported(w, x2, T):
        x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
        y = torch.empty(T, groups * R, dtype=x.dtype, device=x.device)
        if T:
            gemv.launch(x2, w, y, cfg, M=T, group_r=R, x_gstride=c, scratch=scratch)
        return y.reshape(*x.shape[:-1], R)
    tiles = pick_config(T, w.out_features, c, w.fmt, x.device) if T <= MID_ROWS else None
    # `supported` on one group's columns: its width check is the weight's in_features, c
    if (tiles is not None and R % tiles.BN == 0 and T and supported(x2[:, :c], w)
            and not prefers_cublas(x2, w, T)):
        x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
        y = torch.empty(T, groups * R, dtype=x.dtype, device=x.device)
        launch(x2, w, y, tiles, M=T, group_r=R, x_gstride=c, scratch=scratch)
        return y.reshape(*x.shape[:-1], R)
    if weight_supported(w, x.device) and x.device.type == "cuda" and x.dtype == torch.bfloat16 and not interpreting():
        wt = dequantize(w, x.dtype).view(groups, R, c).transpose(1, 2)
        y = torch.bmm(x2.view(T, groups, c).transpose(0, 1), wt)
        return y.transpose(0, 1).reshape(*x.shape[:-1], R)
    return fallback(x, w, groups)
