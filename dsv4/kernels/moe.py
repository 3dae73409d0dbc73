"""Triton MoE: routing, sorting tokens by expert, and the two fused stages.

Decode (T <= DECODE_TOKENS): no sorting, the register-streaming GEMV (`gemv.py`) for both stages, in one
launch or two (`moe_pair.launch_pair`). Gate/up: one unit per (token, slot) pair, N tile and K split, SwiGLU in
the epilogue. Down: one output tile per (token, N tile) whose K splits are (slot, K split): each expert's
partial is scaled by its routing weight and the ordered sum of all of them is the MoE output - the top-k sum
fused and deterministic, no fp32 rows.
When the weights' format or shape does not suit the GEMV, round one's decode tiles (`gemm.py`) run instead:
stage 1 one program per (token, slot) pair and N tile, stage 2 the routed pairs, then a row sum.

Over expert blocks (from 9 tokens up to 6 pairs per expert: `auto_block_tokens`): `expert_blocks` (one program)
lists each distinct expert's pairs in blocks of up to 8, and the same GEMV pair streams each block's expert once, its
pairs as MMA columns (`gemv.launch(blocks=...)`); the shared expert rides in the same launches as token columns
(`gemv.shared_cols`) or, from more tokens, runs beside them: on a second CUDA stream at the same time (`Side`, which
also takes large shared experts out of the pair from 4 tokens: `beside_pair`), else after them (`mlp_op`).

Larger batches: `_align_kernel` (one program: histogram, padded block offsets, scatter) groups the (token,
slot) pairs into blocks of BM rows of one expert; stage 1 and stage 2 are the grouped GEMM of `gemm.py`;
stage 2 writes routing-weighted fp32 rows per pair and `gemm._sum_kernel` adds each token's k rows in slot
order (with `fused_sum`, stage 2 adds them itself: `gemm._topk_sum`).
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..formats import FP4_FORMATS, QWeight
from . import gemm, gemv, moe_pair, ref
from .gemm import EPI_ROUTED, ROWS_DENSE, ROWS_PAIR, ROWS_SORTED, Config
from .host import has_pdl

DECODE_TOKENS = 8
# the routed down GEMM adds each token's k rows itself (`gemm.launch(sum_out=...)`) instead of `gemm.sum_rows`
# after it: the same bits, one launch fewer. Off: on the H200 it gave the same bits but measured level to 4 %
# slower at 64-512 tokens (bench/RESULTS.md, round eleven, runs 85, 86, 89)
FUSED_TOPK_SUM = False
# up to this many tokens, where the GEMV pair runs as two launches (`moe_pair.launch_pair`), gate/up streams with 3
# pipeline stages: V4-Pro 61.9 -> 54.8 us at 1 token, V4-Flash 26.4 -> 25.9; down and 4-8 tokens measured level or
# slower with them (bench/RESULTS.md, run 104)
THREE_STAGE_UP_TOKENS = 2
# `moe`'s default `block_tokens` ("auto", `auto_block_tokens`): from BLOCK_FROM_TOKENS tokens while the (token, slot)
# pairs are at most BLOCK_PAIRS_PER_EXPERT per expert (V4-Flash 9-256 tokens, V4-Pro 9-384), the GEMV pair streams
# each distinct expert once for all its pairs, as MMA columns in blocks of up to 8 (`expert_blocks`); the shared
# expert, if any, rides in the pair's launches as token columns up to `gemv.SHARED_COLS_MAX` tokens, above them
# beside it (`mlp_op`). H200, routed experts alone, median of 3, against round one's sorted grouped GEMM
# (bench/lab/moe_blocks.py, bench/RESULTS.md round eighteen, run 139): V4-Flash NVFP4 1024.1 -> 834.3 / 1259.8 ->
# 1060.5 / 1310.9 -> 1169.5 / 1338.3 -> 1293.7 us at 64 / 128 / 192 / 256 tokens (1.24x slower at 384: 9 pairs per
# expert), V4-Pro NVFP4 3130.4 -> 2627.1 / 4304.1 -> 3544.5 / 4964.6 -> 4196.0 / 5120.9 -> 4865.3 at 64 / 128 / 256 /
# 384 (1.12x slower at 512: 8 per expert); at 4-8 tokens level to 6 % slower than the pair without blocks (runs
# 130-131). Blocks of 16 pairs (MMA N = 16; commit e3ae6b6) measured 1.19-1.44x slower than blocks of 8 up to 6
# pairs per expert and 1.23-1.26x slower than the sorted path at 8-12 (run 139), so blocks hold 8.
BLOCK_FROM_TOKENS = 9
BLOCK_PAIRS_PER_EXPERT = 6
# register cap of the sorted path's FP4 gate/up tiles at BM 16 (above the expert blocks: V4-Flash > 256 tokens,
# V4-Pro > 384). Uncapped they take 188 registers, so 2 CTAs (8 warps) per SM; at 128 (10 spilled) 4 fit, and the
# routed experts took 0.932-0.994 of the uncapped time at 384-512 tokens (V4-Flash NVFP4 / MXFP4, V4-Pro NVFP4;
# bench/RESULTS.md, runs 176-177); caps of 96-120 (more spills) were slower, the down tiles (125 registers, 4 CTAs)
# gained nothing from one
SORTED_UP_MAXNREG_FP4 = 128
# up to this many tokens, experts whose down projection holds at least this many bytes each (w2 and its scales;
# V4-Pro 12.4 MB NVFP4, 11.7 MB MXFP4; V4-Flash 4.7 / 4.5 MB) stream it in units of 128 rows, the pair as two
# launches. MoE layer as the model runs it, V4-Pro NVFP4: 1 token 92.8 -> 90.3 us, 2 tokens 165.3 -> 152.9; MXFP4
# 88.5 -> 86.6, 171.2 -> 147.4; at 3-4 tokens 0.987-1.112 of the time before (7 of 8 readings slower);
# V4-Flash's down launch slower with 128 rows at 1-8 tokens (bench/RESULTS.md, runs 108-109)
WIDE_DOWN_TOKENS = 2
WIDE_DOWN_EXPERT_BYTES = 8e6
WIDE_DOWN = gemv.GemvConfig(BN=128, maxnreg=0, pdl=False)
# up to this many tokens, where gate/up streams the shared expert under programmatic dependent launch (`overlap`),
# the GEMV pair's down launch (64-row units) takes PDL too: its CTAs land as gate/up's finish and wait there instead
# of after a launch gap. MoE layer, V4-Flash NVFP4 (FP8 shared expert), three interleaved rounds each: 1 token
# 43.2 -> 42.6 us, 2 tokens 65.4 -> 64.5 (run 196: 43.0 -> 42.0-42.5, 64.8 -> 64.2; MXFP4 42.0 -> 41.3, 64.0 -> 63.2);
# level at 4-8 tokens; V4-Pro's 128-row down units (WIDE_DOWN) level at 1 token and 1 % slower at 2, so they keep
# plain launches (bench/RESULTS.md, runs 193 and 196). 32-row down units or 3 stages were slower (run 196)
DOWN_PDL_TOKENS = 2
# warps of the routing kernel (one program per token). Its latency sits between the layer's gate/up launch and the
# routed experts' first bytes; with one warp each thread computed 16 of V4-Pro's 384 scores in sequence: routing alone
# 4.4 -> 3.8 us, the MoE layer at 1 token 90.3 -> 89.5 us with 4 warps; V4-Flash (256 experts) level; 8 and 16 warps
# no faster (bench/RESULTS.md, round fifteen, runs 116-121)
ROUTE_WARPS = 4
# the shared expert on a side CUDA stream (`Side`), beside the routed experts instead of inside the GEMV pair's
# launches: from SIDE_FROM_TOKENS tokens for shared experts of at least SIDE_SHARED_BYTES (weights and scales), and
# wherever the pair does not carry it (over expert blocks above `gemv.SHARED_COLS_MAX` tokens, round one's tiles, the
# sorted path), where it ran after the routed experts. MoE layer as the model runs it (routing kernel, then `moe`),
# NVFP4 experts, FP8 shared expert, time against the shared expert in the pair (H200, bench/RESULTS.md run 151):
# V4-Pro (66 MB) 1.046 / 0.976 / 0.957 / 0.998 / 0.958 at 2 / 4 / 8 / 12 / 16 tokens; V4-Flash (25 MB) 1.072 / 1.022 /
# 1.014 / 1.001 at 4 / 8 / 12 / 16 (so it stays in the pair); beside instead of after the routed experts at 32 / 64
# tokens V4-Flash 0.973 / 0.978, V4-Pro 0.994 / 0.993
SIDE_FROM_TOKENS = 4
SIDE_SHARED_BYTES = 50e6


# --------------------------------------------------------------------------------------------- routing

@triton.jit
def _softplus(x):
    """torch's softplus (threshold 20) with a log1p that keeps tiny exp(x) (x << 0) exact to fp32."""
    u = tl.exp(tl.minimum(x, 20.0))
    lg = tl.where(u < 1e-4, u * (1.0 - 0.5 * u), tl.log(1.0 + u))
    return tl.where(x > 20.0, x, lg)


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, tid2eid_ptr, input_ids_ptr, w_ptr, ids_ptr, E, scaling,
                  stride_l, stride_tid, TOPK: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr,
                  HASH: tl.constexpr, PDL: tl.constexpr):
    if PDL:   # the gate/up launch after it may start now and stream the shared expert (`moe(after_route=True)`)
        gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, E_PAD)
    emask = offs_e < E
    offs_j = tl.arange(0, K_PAD)
    kmask = offs_j < TOPK
    if HASH:
        tok = tl.load(input_ids_ptr + t).to(tl.int64)
        ids = tl.load(tid2eid_ptr + tok * stride_tid + offs_j, mask=kmask, other=0).to(tl.int32)
    else:
        logit = tl.load(logits_ptr + t * stride_l + offs_e, mask=emask, other=0.0).to(tl.float32)
        sel = tl.where(emask, tl.sqrt_rn(_softplus(logit))
                       + tl.load(bias_ptr + offs_e, mask=emask, other=0.0).to(tl.float32), float("-inf"))
        ids = tl.zeros((K_PAD,), dtype=tl.int32)
        for j in tl.static_range(TOPK):
            idx = tl.argmax(sel, 0, tie_break_left=True).to(tl.int32)
            ids = tl.where(offs_j == j, idx, ids)
            sel = tl.where(offs_e == idx, float("-inf"), sel)
    # the picked experts' unbiased scores: a gather of their k logits (cache-hot) rather than k reductions
    lg = tl.load(logits_ptr + t * stride_l + ids, mask=kmask, other=0.0).to(tl.float32)
    picked = tl.where(kmask, tl.sqrt_rn(_softplus(lg)), 0.0)
    w = picked / (tl.sum(picked) + 1e-20) * scaling
    tl.store(w_ptr + t * TOPK + offs_j, w, mask=kmask)
    tl.store(ids_ptr + t * TOPK + offs_j, ids.to(tl.int64), mask=kmask)


def route(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, scaling: float,
          tid2eid: torch.Tensor | None = None, input_ids: torch.Tensor | None = None, *, fallback=None,
          warps: int = ROUTE_WARPS):
    """Same contract as `ref.route`: (weights fp32 [T, k], ids int64 [T, k]); ids in selection order. `warps`: of
    each token's program (the same results with any)."""
    T, E = logits.shape
    hashed = tid2eid is not None
    if hashed and (input_ids is None or input_ids.numel() != T or tid2eid.shape[1] != top_k):
        raise ValueError(f"hash routing needs input_ids for all {T} tokens and tid2eid [vocab, {top_k}]; got "
                         f"input_ids {None if input_ids is None else tuple(input_ids.shape)}, "
                         f"tid2eid {tuple(tid2eid.shape)}")
    if not hashed and bias is None:
        raise ValueError("biased top-k routing needs the gate bias (or tid2eid for a hash layer)")
    if logits.stride(-1) != 1 or (hashed and tid2eid.stride(-1) != 1):
        return fallback(logits, bias, top_k, scaling, tid2eid, input_ids)
    w = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    if T == 0:
        return w, ids
    dummy = logits
    _route_kernel[(T,)](
        logits, bias if bias is not None else dummy, tid2eid if hashed else dummy,
        input_ids.reshape(-1) if hashed else dummy, w, ids, E, float(scaling),
        logits.stride(0), tid2eid.stride(0) if hashed else 0,
        TOPK=top_k, E_PAD=triton.next_power_of_2(E), K_PAD=triton.next_power_of_2(top_k), HASH=hashed,
        PDL=has_pdl(logits.device), num_warps=warps)
    return w, ids


# ---------------------------------------------------------------------------- sorting pairs by expert

@triton.jit
def _expert_counts(ids_ptr, P, E, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Pairs per expert [E_PAD] of the P expert ids at ids_ptr (one program, CHUNK at a time; 0 from E on)."""
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for c in range(0, P, CHUNK):
        offs = c + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + offs, mask=offs < P, other=E).to(tl.int32)  # padding counts in bin E
        counts += tl.histogram(e, E_PAD)
    return tl.where(tl.arange(0, E_PAD) < E, counts, 0)


@triton.jit(do_not_specialize=["P", "NB"])
def _expert_blocks_kernel(ids_ptr, table_ptr, work_ptr, P, NB, E, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
                          MP: tl.constexpr, PDL: tl.constexpr):
    """One program: the P (token, slot) pairs' distinct experts as blocks of at most MP pairs, in expert order, each
    expert's pairs in pair order. Row b of table (int32 [NB, 2 + MP], NB at least the blocks there can be): expert,
    pairs in the block (0 past the last block), then the pairs (flat indices t * k + j). work (int32 [2 * E_PAD]):
    each expert's first block, then the pairs of it placed by earlier chunks. Cost O(P * (E_PAD + CHUNK)): a
    histogram, a scan, and per chunk of pairs their ranks among the chunk's pairs of the same expert."""
    if PDL:   # the gate/up launch after it may start and stream the shared expert; the ids are routing's
        gdc_launch_dependents()
        gdc_wait()
    offs_e = tl.arange(0, E_PAD)
    counts = _expert_counts(ids_ptr, P, E, E_PAD, CHUNK)
    nb = (counts + MP - 1) // MP
    starts = tl.cumsum(nb, 0) - nb
    total = tl.sum(nb, axis=0)
    tl.store(work_ptr + offs_e, starts)
    for j in range(0, tl.max(nb, axis=0)):   # block j of every expert that has one
        has = nb > j
        row = table_ptr + (starts + j) * (2 + MP)
        tl.store(row, offs_e, mask=has)
        tl.store(row + 1, tl.minimum(counts - j * MP, MP), mask=has)
    for c in range(0, NB, CHUNK):   # rows past the last block: no pairs
        b = c + tl.arange(0, CHUNK)
        empty = (b >= total) & (b < NB)
        tl.store(table_ptr + b * (2 + MP), tl.zeros_like(b), mask=empty)
        tl.store(table_ptr + b * (2 + MP) + 1, tl.zeros_like(b), mask=empty)
    placed = tl.zeros((E_PAD,), dtype=tl.int32)
    for c in range(0, P, CHUNK):
        tl.store(work_ptr + E_PAD + offs_e, placed)
        tl.debug_barrier()   # (one CTA: its own stores are visible to its loads after the barrier)
        offs = c + tl.arange(0, CHUNK)
        valid = offs < P
        e = tl.load(ids_ptr + offs, mask=valid, other=E).to(tl.int32)
        before = (e[:, None] == e[None, :]) & (offs[None, :] < offs[:, None])
        col = tl.load(work_ptr + E_PAD + e, mask=valid, other=0) + tl.sum(before.to(tl.int32), axis=1)
        blk = tl.load(work_ptr + e, mask=valid, other=0) + col // MP
        tl.store(table_ptr + blk * (2 + MP) + 2 + col % MP, offs, mask=valid)
        placed += tl.histogram(e, E_PAD)
        tl.debug_barrier()   # every load of this chunk done before the next chunk's store


def block_rows(pairs: int, n_experts: int) -> int:
    """Rows of the expert-block table: the most blocks `pairs` pairs over n_experts experts can need. Expert e with
    c_e pairs takes ceil(c_e / MP) <= (c_e + MP - 1) / MP blocks, so all take at most (pairs + (MP - 1) * d) / MP
    with d <= min(n_experts, pairs) distinct experts (V4-Flash, 256 experts, 64 tokens of 6: 272 rows, not 384)."""
    MP = gemv.mma_n(1)
    return min(pairs, (pairs + (MP - 1) * min(n_experts, pairs)) // MP)


def expert_blocks(ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """The expert-block table of routing ids [T, k] (experts < n_experts) for the GEMV pair
    (`gemv.launch(blocks=...)`): int32 [block_rows(T * k, n_experts), 2 + MP] (MP = the GEMV's MMA N), one row per
    block of at most MP pairs of one expert (experts in increasing order), rows past the last with 0 pairs
    (`_expert_blocks_kernel`)."""
    P, MP = ids.numel(), gemv.mma_n(1)
    NB = block_rows(P, n_experts)
    table = torch.empty(NB, 2 + MP, dtype=torch.int32, device=ids.device)
    if P:
        pdl = has_pdl(ids.device)
        E_PAD = triton.next_power_of_2(n_experts + 1)
        work = torch.empty(2 * E_PAD, dtype=torch.int32, device=ids.device)
        _expert_blocks_kernel[(1,)](ids.reshape(-1), table, work, P, NB, n_experts, E_PAD=E_PAD, CHUNK=64, MP=MP,
                                    PDL=pdl, num_warps=4, **({"launch_pdl": True} if pdl else {}))
    return table


@triton.jit(do_not_specialize=["P"])
def _align_kernel(ids_ptr, rows_ptr, blk_e_ptr, nblk_ptr, cursor_ptr, P, E, NUM_BLOCKS,
                  BM: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr, BCHUNK: tl.constexpr):
    """Lay out the P = T*k (token, slot) pairs in blocks of BM rows of a single expert.

    rows[b*BM + i] = pair index (or P for padding), blk_e[b] = expert of block b, nblk = blocks used.
    Single program: histogram, exclusive scan of padded block counts, then a scatter whose positions come
    from atomics on a per-expert cursor (order inside an expert's blocks does not change any row's result).
    """
    offs_e = tl.arange(0, E_PAD)
    counts = _expert_counts(ids_ptr, P, E, E_PAD, CHUNK)
    nb = (counts + BM - 1) // BM
    ends = tl.cumsum(nb, 0)
    starts = ends - nb
    total = tl.sum(nb)
    tl.store(nblk_ptr, total)
    tl.store(cursor_ptr + offs_e, starts * BM)
    for c in range(0, NUM_BLOCKS * BM, CHUNK):
        offs = c + tl.arange(0, CHUNK)
        tl.store(rows_ptr + offs, tl.full((CHUNK,), 0, tl.int32) + P, mask=offs < NUM_BLOCKS * BM)
    for c in range(0, NUM_BLOCKS, BCHUNK):
        b = c + tl.arange(0, BCHUNK)
        owner = tl.sum((ends[None, :] <= b[:, None]).to(tl.int32), axis=1)  # first expert whose end > b
        tl.store(blk_e_ptr + b, tl.minimum(owner, E - 1), mask=b < NUM_BLOCKS)
    tl.debug_barrier()
    for c in range(0, P, CHUNK):
        offs = c + tl.arange(0, CHUNK)
        valid = offs < P
        e = tl.load(ids_ptr + offs, mask=valid, other=0).to(tl.int32)
        pos = tl.atomic_add(cursor_ptr + e, 1, mask=valid)
        tl.store(rows_ptr + pos, offs, mask=valid)


def align(ids: torch.Tensor, n_experts: int, BM: int):
    """(rows int32 [NB*BM], block experts int32 [NB], number of used blocks int32 [1]); NB is the static bound
    P/BM + min(P, E) so that CUDA graphs can capture the whole MoE."""
    P = ids.numel()
    nb_max = triton.cdiv(P, BM) + min(P, n_experts)
    dev = ids.device
    rows = torch.empty(nb_max * BM, dtype=torch.int32, device=dev)
    blk_e = torch.empty(nb_max, dtype=torch.int32, device=dev)
    nblk = torch.empty(1, dtype=torch.int32, device=dev)
    E_PAD = triton.next_power_of_2(n_experts + 1)
    cursor = torch.empty(E_PAD, dtype=torch.int32, device=dev)
    _align_kernel[(1,)](ids.reshape(-1), rows, blk_e, nblk, cursor, P, n_experts, nb_max,
                        BM=BM, E_PAD=E_PAD, CHUNK=256, BCHUNK=max(16, 8192 // E_PAD), num_warps=8)
    return rows, blk_e, nblk, nb_max


# ------------------------------------------------------------------------------------------- wrappers

def _fp4(fmt: str) -> bool:
    return fmt in FP4_FORMATS


def decode_configs(T: int, k: int, I: int, K: int, D: int, fmt_up: str, fmt_down: str, device):
    """Tiles of the decode path: both stages use the dense decode tiles over T*k one-row blocks (split-K in
    the same launch when that leaves SMs idle)."""
    return (gemm.pick_config(1, I, K, fmt_up, device, gated=True, row_blocks=T * k),
            gemm.pick_config(1, D, I, fmt_down, device, row_blocks=T * k))


def sorted_configs(P: int, E: int, I: int, K: int, D: int, fmt_up: str, fmt_down: str):
    """Tiles of the grouped path; BM follows the mean rows per touched expert."""
    per_expert = P / max(1, min(E, P))
    BM = 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64 if per_expert <= 96 else 128
    if BM <= 32:  # decode-like: the dense decode weight tiles
        t_up = gemm.DECODE_TILES_FP4 if _fp4(fmt_up) else gemm.DECODE_TILES_FP8
        t_dn = gemm.DECODE_TILES_FP4 if _fp4(fmt_down) else gemm.DECODE_TILES_FP8
        bk_up, bk_down = gemm.k_block(fmt_up, K, t_up.BK), gemm.k_block(fmt_down, I, t_dn.BK)
        if bk_up is None or bk_down is None:
            return None, None
        up = Config(BM, min(t_up.BN, gemm._pow2_at_most(I, 128)), bk_up, 1, 1, t_up.num_warps, t_up.num_stages,
                    maxnreg=SORTED_UP_MAXNREG_FP4 if BM == 16 and _fp4(fmt_up) else 0)
        down = Config(BM, min(t_dn.BN, gemm._pow2_at_most(D, 128)), bk_down, 1, 1, t_dn.num_warps, t_dn.num_stages)
        return up, down
    bk_up, bk_down = gemm.k_block(fmt_up, K, 64), gemm.k_block(fmt_down, I, 64)
    if bk_up is None or bk_down is None:
        return None, None
    warps = 8 if BM == 128 else 4
    up = Config(BM, min(64, gemm._pow2_at_most(I, 64)), bk_up, 1, 1, warps, 4)
    down = Config(BM, min(128, gemm._pow2_at_most(D, 128)), bk_down, 1, 1, warps, 4)
    return up, down


def mlp(x: torch.Tensor, w13: QWeight, w2: QWeight, limit: float, *, fallback=None, linear=None,
        config: Config | None = None, scratch: gemm.Scratch | None = None) -> torch.Tensor:
    """Shared expert: gate/up with the clamped SwiGLU fused (one launch), then the down projection."""
    if w13.leading != (2,) or w2.leading:
        raise ValueError(f"mlp wants w13 with leading (2,) and an unstacked w2, got {w13.leading}, {w2.leading}")
    T, K = x.shape
    I = w13.out_features
    x = x if x.stride(-1) == 1 else x.contiguous()
    if config is None and gemm.supported(x, w13) and gemv.preferred(w13, x, T):
        h = torch.empty(T, I, dtype=x.dtype, device=x.device)
        if T:
            gemv.launch(x, w13, h, gemv.GemvConfig(), M=T, gated=True, limit=limit, scratch=scratch)
        return linear(h, w2)
    cfg = None
    if gemm.supported(x, w13):
        cfg = config or gemm.pick_config(T, I, K, w13.fmt, x.device, gated=True)
    if cfg is None:
        return fallback(x, w13, w2, limit)
    h = torch.empty(T, I, dtype=x.dtype, device=x.device)
    if T:
        gemm.launch(x, w13, h, cfg, M=T, rows=ROWS_DENSE, gated=True, limit=limit, scratch=scratch)
    return linear(h, w2)


class Side:
    """A second CUDA stream on which `moe` runs the shared expert beside the routed experts (`SIDE_FROM_TOKENS`),
    as `mlp` with split-K semaphores of its own (kernels running at the same time on two streams must not share
    them). `fallback` / `linear_fallback`: `mlp`'s and its down projection's, as the Ops table's. Owned by the `Ops`
    table, one stream per device, created on first use."""

    def __init__(self, fallback=None, linear_fallback=None):
        self.scratch = gemm.Scratch()
        self._linear = partial(gemm.linear, fallback=linear_fallback, scratch=self.scratch)
        self._fallback = fallback
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def mlp(self, x: torch.Tensor, w13: QWeight, w2: QWeight, limit: float) -> torch.Tensor:
        return mlp(x, w13, w2, limit, fallback=self._fallback, linear=self._linear, scratch=self.scratch)

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def beside(self, x: torch.Tensor, shared: tuple[QWeight, QWeight], limit: float, routed) -> torch.Tensor:
        """routed() on the current stream while the shared expert of x runs on the side stream; their sum
        (`ref.moe`'s order: each output rounded, then added). Works inside a CUDA graph capture (fork and join
        are event waits). Off CUDA (the interpreter) one after the other."""
        if not x.is_cuda:
            return routed().add_(self.mlp(x, *shared, limit))
        main, side = torch.cuda.current_stream(x.device), self.stream(x.device)
        side.wait_stream(main)   # x and the weights are ready
        with torch.cuda.stream(side):
            y_shared = self.mlp(x, *shared, limit)
        out = routed()
        main.wait_stream(side)
        y_shared.record_stream(main)   # allocated on the side stream, read here
        return out.add_(y_shared)


def beside_pair(tokens: int, shared: tuple[QWeight, QWeight], pair_carries: bool) -> bool:
    """Whether `moe` with a `Side` runs the shared expert on it: where the GEMV pair does not carry it, or from
    SIDE_FROM_TOKENS tokens when it holds at least SIDE_SHARED_BYTES."""
    big = sum(w.nbytes() for w in shared) >= SIDE_SHARED_BYTES
    return not pair_carries or (tokens >= SIDE_FROM_TOKENS and big)


def pair_configs(tokens: int, expert_down_bytes: float, overlap: bool):
    """The GEMV pair's plan at `tokens` tokens as (up, down, up_alone, fused) for `moe_pair.launch_pair`:
    `expert_down_bytes` is one expert's w2 with its scales, `overlap` whether gate/up streams the shared expert
    while the routing kernel runs (PDL on gate/up, and on down up to DOWN_PDL_TOKENS tokens: measured level or
    slower elsewhere, gemv.GemvConfig)."""
    up, down = gemv.GemvConfig(pdl=overlap), gemv.GemvConfig(pdl=overlap and tokens <= DOWN_PDL_TOKENS)
    up_alone = replace(up, num_stages=3) if tokens <= THREE_STAGE_UP_TOKENS else None
    if tokens <= WIDE_DOWN_TOKENS and expert_down_bytes >= WIDE_DOWN_EXPERT_BYTES:
        return up_alone or up, WIDE_DOWN, None, False   # two launches: the one-launch pair needs equal BN
    return up, down, up_alone, None


def moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: QWeight, w2: QWeight, limit: float,
        *, fallback=None, decode_tokens: int = DECODE_TOKENS, configs: dict | None = None,
        decode: str = "auto", scratch: gemm.Scratch | None = None, fused_sum: bool = FUSED_TOPK_SUM,
        shared: tuple[QWeight, QWeight] | None = None, mlp_op=None, after_route: bool = False,
        block_tokens: tuple[int, int] | None | str = "auto", side: Side | None = None) -> torch.Tensor:
    """Same contract as `ref.moe`. Decode (T <= decode_tokens): `decode="auto"` runs the GEMV pair for up to
    `gemv.MOE_TOKENS` tokens (measured faster there) and round one's kernels above; "gemv" forces the GEMV
    pair (all decode sizes), "round1" (or `configs` = {"up": Config, "down": Config}) round one's kernels
    (gate/up over the pairs, then the routed down projection over the pairs and a row sum). At `block_tokens`
    (by default `auto_block_tokens`) the GEMV pair over expert blocks; else above decode_tokens the sorted grouped
    GEMM.

    `shared` (w13 (2,), w2): the shared expert. The GEMV pair streams it in the same launches (one more
    pair per token for gate/up, one more slot per token for down, summed in fp32 with the routed slots; from
    4 tokens one row block for all tokens, `gemv.shared_cols`);
    every other path adds `mlp_op(x, *shared, limit)` (the Ops table's shared-expert op; default `ref.mlp`).
    With `side` the shared expert runs on its stream beside the routed experts instead, where
    `beside_pair` says: wherever the pair does not carry it, and from SIDE_FROM_TOKENS tokens for large shared
    experts; the two outputs are then rounded to x's dtype and added, as in `ref.moe`.

    `after_route=True` is the caller's promise that the previous kernel on the stream is `route`'s and that x
    was written before it: the GEMV pair's gate/up launch then streams the shared expert first, overlapping
    the routing kernel where the GPU has programmatic dependent launch (`gemv.launch(x_ready=True)`). The
    result is the same bits either way, as it is in one launch or two (`moe_pair.launch_pair`).

    `fused_sum` (round one's decode tiles and the sorted path): the routed down projection adds each token's
    k rows in the same launch instead of a separate sum kernel; the same bits.

    `block_tokens` ((first, last), None: off, or "auto": `auto_block_tokens`): at these token counts (`decode`
    "auto" or "gemv") the GEMV pair runs over expert blocks (`expert_blocks`; in one launch or two, as `launch_pair`
    decides), each distinct expert streamed once for all the pairs routed to it; the shared expert rides in its
    launches as token columns (`gemv.shared_cols`: 4 to `gemv.SHARED_COLS_MAX` tokens), else `mlp_op` adds it."""
    block_tokens = resolve_block_tokens(block_tokens, w13.leading[0] if w13.leading else 0, ids.shape[-1])
    in_blocks = in_block_range(x.shape[0], block_tokens) and decode in ("auto", "gemv")
    gemv_pair = _gemv_pair(x, ids, w13, w2, shared, decode, decode_tokens, configs, in_blocks)
    on_side = shared is not None and side is not None and x.shape[0] > 0 and beside_pair(x.shape[0], shared, gemv_pair)
    if shared is not None and (on_side or not gemv_pair):   # the routed experts alone, the shared expert beside
        routed = partial(moe, x, ids, weights, w13, w2, limit, fallback=fallback, decode_tokens=decode_tokens,
                         configs=configs, decode=decode, scratch=scratch, fused_sum=fused_sum,
                         block_tokens=block_tokens)
        if on_side:
            return side.beside(x, shared, limit, routed)
        return routed() + (mlp_op or ref.mlp)(x, *shared, limit)
    T, K = x.shape
    k = ids.shape[1]
    if len(w13.leading) != 2 or w13.leading[1] != 2 or w2.leading != w13.leading[:1]:
        raise ValueError(f"moe wants w13 leading (E, 2) and w2 leading (E,), got {w13.leading}, {w2.leading}")
    E, I, D = w13.leading[0], w13.out_features, w2.out_features
    if not (gemm.supported(x, w13) and gemm.weight_supported(w2, x.device)) or w2.in_features != I:
        return fallback(x, ids, weights, w13, w2, limit)
    configs = configs or {}
    x = x if x.stride(-1) == 1 else x.contiguous()
    ids = ids.contiguous()
    weights = weights.contiguous()
    P = T * k
    out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    if gemv_pair:
        rows = P + (T if shared is not None else 0)   # h: the routed pairs, then the shared expert's rows
        h = torch.empty(rows, I, dtype=x.dtype, device=x.device)
        # PDL measured level or slower for the pair (gemv.GemvConfig), except where the gate/up launch streams
        # the shared expert while the routing kernel runs (and the down launch after it, `DOWN_PDL_TOKENS`)
        overlap = after_route and shared is not None
        up, down, up_alone, fused = pair_configs(T, w2.nbytes() / E, overlap)
        # (`_gemv_pair`: with blocks, the shared expert is here only as token columns)
        blocks = expert_blocks(ids, E) if in_blocks else None   # each distinct expert streamed once
        moe_pair.launch_pair(x, w13, h, w2, out, up, down, tokens=T, topk=k, ids=ids, rw=weights.reshape(-1),
                             limit=limit, shared=shared, scratch=scratch, x_ready=overlap, up_alone=up_alone,
                             fused=fused, blocks=blocks)
        return out
    h = torch.empty(P, I, dtype=x.dtype, device=x.device)
    if T <= decode_tokens:
        up, down = decode_configs(T, k, I, K, D, w13.fmt, w2.fmt, x.device)
        up, down = configs.get("up", up), configs.get("down", down)
        if up is None or down is None:
            return fallback(x, ids, weights, w13, w2, limit)
        up = replace(up, BM=16, group_m=P)
        gemm.launch(x, w13, h, up, M=P, rows=ROWS_PAIR, gated=True, x_div=k, num_m=P, limit=limit, ids=ids,
                    scratch=scratch)
        _routed_down(h, w2, out, replace(down, BM=16, group_m=P), weights, k, fused_sum, scratch,
                     rows=ROWS_PAIR, num_m=P, ids=ids)
        return out
    up, down = sorted_configs(P, E, I, K, D, w13.fmt, w2.fmt)
    up, down = configs.get("up", up), configs.get("down", down)
    if up is None or down is None:
        return fallback(x, ids, weights, w13, w2, limit)
    rows, blk_e, nblk, nb_max = align(ids, E, up.BM)
    up = replace(up, group_m=nb_max)
    down = replace(down, BM=up.BM, group_m=nb_max)
    gemm.launch(x, w13, h, up, M=P, rows=ROWS_SORTED, gated=True, x_div=k, num_m=nb_max, limit=limit,
                ids=blk_e, rows_idx=rows, nblk=nblk, scratch=scratch)
    _routed_down(h, w2, out, down, weights, k, fused_sum, scratch, rows=ROWS_SORTED, num_m=nb_max, ids=blk_e,
                 rows_idx=rows, nblk=nblk)
    return out


def _routed_down(h, w2: QWeight, out, cfg: Config, weights, k: int, fused_sum: bool, scratch, **row_mode):
    """Round one's down projection over the (token, slot) pairs of h into routing-weighted fp32 rows, then each
    token's k rows summed in slot order into out: in the same launch (`fused_sum`) or by `gemm.sum_rows`.
    `row_mode`: the launch's row mode and its indices (`gemm.launch`'s rows, num_m, ids, rows_idx, nblk)."""
    T, D = out.shape
    P = T * k
    y = torch.empty(P, D, dtype=torch.float32, device=h.device)
    gemm.launch(h, w2, y, cfg, M=P, epi=EPI_ROUTED, x_div=1, rw=weights.reshape(-1), scratch=scratch,
                sum_out=out if fused_sum else None, topk=k, **row_mode)
    if not fused_sum:
        gemm.sum_rows(y, out, T, D, k, y.stride(0), k * y.stride(0))


def auto_block_tokens(n_experts: int, topk: int) -> tuple[int, int]:
    """`moe`'s token range over expert blocks for n_experts experts and topk per token (`block_tokens="auto"`): from
    BLOCK_FROM_TOKENS to where the pairs reach BLOCK_PAIRS_PER_EXPERT per expert (V4-Flash 256, V4-Pro 384)."""
    return BLOCK_FROM_TOKENS, BLOCK_PAIRS_PER_EXPERT * n_experts // max(1, topk)


def resolve_block_tokens(block_tokens: tuple[int, int] | None | str, n_experts: int,
                         topk: int) -> tuple[int, int] | None:
    """`moe`'s `block_tokens` as a range: (first, last) or None as given, "auto" as `auto_block_tokens`."""
    if isinstance(block_tokens, str):
        if block_tokens != "auto":
            raise ValueError(f"moe: block_tokens {block_tokens!r}: expected (first, last), None or 'auto'")
        return auto_block_tokens(n_experts, topk)
    return block_tokens


def in_block_range(tokens: int, block_tokens: tuple[int, int] | None) -> bool:
    """Whether `moe` at this many tokens runs the GEMV pair over expert blocks (`block_tokens`: (first, last) or
    None)."""
    return block_tokens is not None and block_tokens[0] <= tokens <= block_tokens[1]


def _gemv_pair(x, ids, w13: QWeight, w2: QWeight, shared, decode: str, decode_tokens: int, configs,
               in_blocks: bool) -> bool:
    """Whether `moe` runs the decode GEMV pair (with the shared expert in its launches when given): up to
    `gemv.MOE_TOKENS` tokens, or over expert blocks (`in_blocks`, the shared expert only as token columns)."""
    T = x.shape[0]
    gemv_tokens = {"auto": gemv.MOE_TOKENS, "gemv": decode_tokens}.get(decode, 0)
    if not (0 < T <= min(decode_tokens, gemv_tokens) or in_blocks) or configs or not gemm.supported(x, w13):
        return False
    if len(w13.leading) != 2 or w2.leading != w13.leading[:1] or w2.in_features != w13.out_features:
        return False
    h = x.new_empty(0, w13.out_features)
    if not (gemv.supported(w13, x, 1) and gemv.supported(w2, h, 1)):
        return False
    if shared is None:
        return True
    P = ids.numel()
    if in_blocks and not gemv.shared_cols(ROWS_PAIR, P + T, P, shared[0]):
        return False
    sw13, sw2 = shared
    return (sw13.leading == (2,) and not sw2.leading and gemv.supported(sw13, x, 1) and gemv.supported(sw2, h, 1)
            and (sw13.out_features, sw13.in_features) == (w13.out_features, w13.in_features)
            and (sw2.out_features, sw2.in_features) == (w2.out_features, w2.in_features))
