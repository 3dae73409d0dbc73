"""The MoE's small kernels: the router's logits (`router_logits`), routing (`route`), each distinct expert's pairs
in blocks (`expert_blocks`, for the GEMV pair over expert blocks) and the pairs sorted into blocks of one expert
(`align`, for the sorted grouped tiles).

Which of the MoE's paths runs, and how its stages are launched, is `dispatch.moe`'s (its plan: `policy.plan_moe`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from . import ref
from .host import has_pdl
from .pieces import dot_pieces
from .policy import ROUTE_WARPS, mma_n, next_pow2

EXPERT_BLOCKS_CHUNK = 64     # pairs a program of the expert-block table places (its rank is a CHUNK x CHUNK compare)
ROUTER_TOKENS = 16           # the router's logits in one launch up to this many tokens (`router_logits`)
ROUTER_EXPERTS = 2           # experts a router program (V4-Flash: 128 programs of 32 KB of fp32 weight)
ROUTER_PRODUCTS = 16384      # products a router program's K step holds (64 registers a thread on 8 warps)
ROUTER_BLOCK = 64            # above ROUTER_TOKENS: tokens, experts and K columns of a tensor-core step (`_router_gemm`)
ROUTER_CHUNK = 512           # K columns a program of that launch sums (its split of K: V4-Flash 8 chunks)

# --------------------------------------------------------------------------------------------- routing

@triton.jit
def _softplus(x):
    """torch's softplus (threshold 20) with a log1p that keeps tiny exp(x) (x << 0) exact to fp32."""
    u = tl.exp(tl.minimum(x, 20.0))
    lg = tl.where(u < 1e-4, u * (1.0 - 0.5 * u), tl.log(1.0 + u))
    return tl.where(x > 20.0, x, lg)


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, tid2eid_ptr, input_ids_ptr, w_ptr, ids_ptr, E, scaling, held_start,
                  held_count, stride_l, stride_tid, TOPK: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr,
                  HASH: tl.constexpr, HELD: tl.constexpr, PDL: tl.constexpr):
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
    if HELD:   # expert parallel (`ref.held_picks`): local ids; picks held elsewhere weigh 0 on the first held pick
        local = ids - held_start
        mine = (local >= 0) & (local < held_count) & kmask
        first = tl.min(tl.where(mine, offs_j, K_PAD), 0)
        stand_in = tl.sum(tl.where(offs_j == first, local, 0), 0)     # 0 where no pick is held
        ids = tl.where(mine, local, stand_in)
        w = tl.where(mine, w, 0.0)
    tl.store(w_ptr + t * TOPK + offs_j, w, mask=kmask)
    tl.store(ids_ptr + t * TOPK + offs_j, ids.to(tl.int64), mask=kmask)


@triton.jit
def _router_kernel(x_ptr, w_ptr, out_ptr, T, E, K, stride_xt, stride_we, stride_ot, TP: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr):
    """Program n: logits[t, e] = sum_k x[t, k] w[e, k] in fp32 for experts e of [n BN, (n + 1) BN) and every token
    (TP >= T), K in BK steps, each step's products summed in registers."""
    t = tl.arange(0, TP)
    e = tl.program_id(0) * BN + tl.arange(0, BN)
    tmask, emask = t < T, e < E
    acc = tl.zeros([TP, BN], tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        kmask = k < K
        x = tl.load(x_ptr + t[:, None].to(tl.int64) * stride_xt + k[None, :], mask=tmask[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)
        w = tl.load(w_ptr + e[:, None].to(tl.int64) * stride_we + k[None, :], mask=emask[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    tl.store(out_ptr + t[:, None] * stride_ot + e[None, :], acc, mask=tmask[:, None] & emask[None, :])


@triton.jit
def _router_gemm(x_ptr, w_ptr, part_ptr, T, E, stride_xt, stride_we, stride_pc, stride_pt, CHUNK: tl.constexpr,
                 BLOCK: tl.constexpr, DOT: tl.constexpr):
    """Program (token block, chunk c, expert block): part[c, t, e] = sum_{k in chunk c} x[t, k] w[e, k] for BLOCK
    tokens and experts, x bf16, w fp32 or bf16, on the tensor cores (`pieces.dot_pieces`: exact products, fp32 sums)."""
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    c = tl.program_id(1)
    e = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    tmask, emask = t < T, e < E
    acc = tl.zeros([BLOCK, BLOCK], tl.float32)
    for k0 in range(c * CHUNK, (c + 1) * CHUNK, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + t[:, None].to(tl.int64) * stride_xt + k[None, :], mask=tmask[:, None], other=0.0)
        w = tl.load(w_ptr + e[None, :].to(tl.int64) * stride_we + k[:, None], mask=emask[None, :], other=0.0)
        acc += dot_pieces(x, w.to(tl.float32), DOT)
    tl.store(part_ptr + c * stride_pc + t[:, None] * stride_pt + e[None, :], acc, mask=tmask[:, None] & emask[None, :])


def router_logits(x: torch.Tensor, weight: torch.Tensor, *, fallback=None) -> torch.Tensor:
    """Same contract as `ref.router_logits`. Up to ROUTER_TOKENS tokens one launch (`_router_kernel`, ROUTER_EXPERTS
    experts a program) reads x and the weight (fp32 or bf16) in their own dtypes: no fp32 copy of x, no cuBLAS fp32
    GEMV. More tokens of bf16 x (K a multiple of ROUTER_BLOCK): `_router_gemm` on the tensor cores, K split in chunks
    of up to ROUTER_CHUNK columns whose sums one `sum` adds in a fixed order; other x, `ref.router_logits`' fp32
    GEMM."""
    lead, K = x.shape[:-1], x.shape[-1]
    E = weight.shape[0]
    rows = x.reshape(-1, K)
    T = rows.shape[0]
    if weight.dtype not in (torch.float32, torch.bfloat16) or weight.shape[1] != K or weight.stride(-1) != 1 \
            or rows.stride(-1) != 1:
        return fallback(x, weight)
    if T > ROUTER_TOKENS:
        if x.dtype != torch.bfloat16 or K % ROUTER_BLOCK:
            return ref.router_logits(x, weight)
        chunk = math.gcd(K, ROUTER_CHUNK)
        part = torch.empty(K // chunk, T, E, dtype=torch.float32, device=x.device)
        _router_gemm[(triton.cdiv(T, ROUTER_BLOCK), K // chunk, triton.cdiv(E, ROUTER_BLOCK))](
            rows, weight, part, T, E, rows.stride(0), weight.stride(0), part.stride(0), part.stride(1), chunk,
            ROUTER_BLOCK, tl.bfloat16 if x.device.type == "cuda" else tl.float32, num_warps=4)
        return part.sum(0).view(*lead, E)
    out = torch.empty(T, E, dtype=torch.float32, device=x.device)
    if T:
        tp = next_pow2(T)      # K in one step up to 16K products a program (one round of loads at batch 1 and 2)
        bk = min(next_pow2(K), max(64, ROUTER_PRODUCTS // (tp * ROUTER_EXPERTS)))
        _router_kernel[(triton.cdiv(E, ROUTER_EXPERTS),)](rows, weight, out, T, E, K, rows.stride(0), weight.stride(0),
                                                         out.stride(0), tp, ROUTER_EXPERTS, bk, num_warps=8)
    return out.view(*lead, E)


def route(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, scaling: float,
          tid2eid: torch.Tensor | None = None, input_ids: torch.Tensor | None = None, held: range | None = None, *,
          fallback=None, warps: int = ROUTE_WARPS):
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
        return fallback(logits, bias, top_k, scaling, tid2eid, input_ids, held)
    w = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    if T == 0:
        return w, ids
    dummy = logits
    _route_kernel[(T,)](
        logits, bias if bias is not None else dummy, tid2eid if hashed else dummy,
        input_ids.reshape(-1) if hashed else dummy, w, ids, E, float(scaling),
        held.start if held is not None else 0, len(held) if held is not None else E,
        logits.stride(0), tid2eid.stride(0) if hashed else 0,
        TOPK=top_k, E_PAD=triton.next_power_of_2(E), K_PAD=triton.next_power_of_2(top_k), HASH=hashed,
        HELD=held is not None, PDL=has_pdl(logits.device), num_warps=warps)
    return w, ids


# ---------------------------------------------------------------------------- sorting pairs by expert

@triton.jit
def _pair_experts(ids_ptr, w_ptr, offs, pairs, E):
    """The experts of pairs offs (int32), E for padding and for pairs of routing weight 0."""
    e = tl.load(ids_ptr + offs, mask=offs < pairs, other=E).to(tl.int32)
    return tl.where(tl.load(w_ptr + offs, mask=offs < pairs, other=1.0) == 0.0, E, e)


@triton.jit
def _expert_counts(ids_ptr, w_ptr, pairs, E, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Pairs per expert [E_PAD] of the pairs expert ids at ids_ptr (one program, CHUNK at a time; 0 from E on,
    where padding and pairs of weight 0 count)."""
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for c in range(0, pairs, CHUNK):
        counts += tl.histogram(_pair_experts(ids_ptr, w_ptr, c + tl.arange(0, CHUNK), pairs, E), E_PAD)
    return tl.where(tl.arange(0, E_PAD) < E, counts, 0)


@triton.jit(do_not_specialize=["pairs", "n_blocks"])
def _expert_blocks_kernel(ids_ptr, table_ptr, work_ptr, pairs, n_blocks, E, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
                          SCAN: tl.constexpr, MMA_N: tl.constexpr, PDL: tl.constexpr):
    """The pairs (token, slot) pairs' distinct experts as blocks of at most MMA_N pairs, in expert order, each
    expert's pairs in pair order. Row b of table (int32 [n_blocks, 2 + MMA_N], n_blocks at least the blocks there
    can be): expert, pairs in the block (0 past the last block), then the pairs (flat indices t * k + j). Program c
    places the pairs of chunk c (CHUNK pairs): it histograms every pair (SCAN at a time) for the experts' first blocks
    and the pairs before its chunk for each expert's pairs already placed, stores both in its row of work (int32
    [programs, 2 * E_PAD]) to gather them back per pair, and ranks its pairs among the chunk's pairs of the same
    expert; program 0 also writes the blocks' experts and counts. Cost per program O(pairs + CHUNK * CHUNK)."""
    if PDL:   # the gate/up launch after it may start and stream the shared expert; the ids are routing's
        gdc_launch_dependents()
        gdc_wait()
    c = tl.program_id(0)
    offs_e = tl.arange(0, E_PAD)
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    earlier = tl.zeros((E_PAD,), dtype=tl.int32)
    for s0 in range(0, pairs, SCAN):
        offs = s0 + tl.arange(0, SCAN)
        e = tl.load(ids_ptr + offs, mask=offs < pairs, other=E).to(tl.int32)    # padding counts in bin E
        counts += tl.histogram(e, E_PAD)
        earlier += tl.histogram(e, E_PAD, mask=offs < c * CHUNK)
    counts = tl.where(offs_e < E, counts, 0)
    nb = (counts + MMA_N - 1) // MMA_N
    starts = tl.cumsum(nb, 0) - nb
    work = work_ptr + c * (2 * E_PAD)
    tl.store(work + offs_e, starts)
    tl.store(work + E_PAD + offs_e, earlier)
    if c == 0:
        total = tl.sum(nb, axis=0)
        for j in range(0, tl.max(nb, axis=0)):   # block j of every expert that has one
            has = nb > j
            row = table_ptr + (starts + j) * (2 + MMA_N)
            tl.store(row, offs_e, mask=has)
            tl.store(row + 1, tl.minimum(counts - j * MMA_N, MMA_N), mask=has)
        for b0 in range(0, n_blocks, CHUNK):   # rows past the last block: no pairs
            b = b0 + tl.arange(0, CHUNK)
            empty = (b >= total) & (b < n_blocks)
            tl.store(table_ptr + b * (2 + MMA_N), tl.zeros_like(b), mask=empty)
            tl.store(table_ptr + b * (2 + MMA_N) + 1, tl.zeros_like(b), mask=empty)
    tl.debug_barrier()   # (one CTA: its own stores are visible to its loads after the barrier)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    valid = offs < pairs
    e = tl.load(ids_ptr + offs, mask=valid, other=E).to(tl.int32)
    before = (e[:, None] == e[None, :]) & (offs[None, :] < offs[:, None])
    col = tl.load(work + E_PAD + e, mask=valid, other=0) + tl.sum(before.to(tl.int32), axis=1)
    blk = tl.load(work + e, mask=valid, other=0) + col // MMA_N
    tl.store(table_ptr + blk * (2 + MMA_N) + 2 + col % MMA_N, offs, mask=valid)


def block_rows(pairs: int, n_experts: int) -> int:
    """Rows of the expert-block table: the most blocks `pairs` pairs over n_experts experts can need. Expert e with
    c_e pairs takes ceil(c_e / n) <= (c_e + n - 1) / n blocks of n = the GEMV's MMA N, so all take at most
    (pairs + (n - 1) d) / n with d <= min(n_experts, pairs) distinct experts (V4-Flash, 256 experts, 64 tokens of 6:
    272 rows, not 384)."""
    n = mma_n(1)
    return min(pairs, (pairs + (n - 1) * min(n_experts, pairs)) // n)


def expert_blocks(ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """The expert-block table of routing ids [T, k] (experts < n_experts) for the GEMV pair
    (`gemv_launch.launch(blocks=...)`): int32 [block_rows(T * k, n_experts), 2 + n] (n = the GEMV's MMA N), one row
    per block of at most n pairs of one expert (experts in increasing order), rows past the last with 0 pairs
    (`_expert_blocks_kernel`)."""
    pairs, n = ids.numel(), mma_n(1)
    n_blocks = block_rows(pairs, n_experts)
    table = torch.empty(n_blocks, 2 + n, dtype=torch.int32, device=ids.device)
    if pairs:
        pdl = has_pdl(ids.device)
        E_PAD = triton.next_power_of_2(n_experts + 1)
        programs = triton.cdiv(pairs, EXPERT_BLOCKS_CHUNK)
        work = torch.empty(programs, 2 * E_PAD, dtype=torch.int32, device=ids.device)
        _expert_blocks_kernel[(programs,)](ids.reshape(-1), table, work, pairs, n_blocks, n_experts, E_PAD=E_PAD,
                                           CHUNK=EXPERT_BLOCKS_CHUNK, SCAN=min(1024, next_pow2(pairs)),
                                           MMA_N=n, PDL=pdl, num_warps=4, **({"launch_pdl": True} if pdl else {}))
    return table


@triton.jit(do_not_specialize=["pairs"])
def _align_kernel(ids_ptr, w_ptr, rows_ptr, blk_e_ptr, nblk_ptr, cursor_ptr, pairs, E, NUM_BLOCKS,
                  BM: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr, BCHUNK: tl.constexpr):
    """Lay out the T*k (token, slot) pairs in blocks of BM rows of a single expert (those of routing weight 0 in
    none).

    rows[b*BM + i] = pair index (or `pairs` for padding), blk_e[b] = expert of block b, nblk = blocks used.
    Single program: histogram, exclusive scan of padded block counts, then a scatter whose positions come
    from atomics on a per-expert cursor (order inside an expert's blocks does not change any row's result).
    """
    offs_e = tl.arange(0, E_PAD)
    counts = _expert_counts(ids_ptr, w_ptr, pairs, E, E_PAD, CHUNK)
    nb = (counts + BM - 1) // BM
    ends = tl.cumsum(nb, 0)
    starts = ends - nb
    total = tl.sum(nb)
    tl.store(nblk_ptr, total)
    tl.store(cursor_ptr + offs_e, starts * BM)
    for c in range(0, NUM_BLOCKS * BM, CHUNK):
        offs = c + tl.arange(0, CHUNK)
        tl.store(rows_ptr + offs, tl.full((CHUNK,), 0, tl.int32) + pairs, mask=offs < NUM_BLOCKS * BM)
    for c in range(0, NUM_BLOCKS, BCHUNK):
        b = c + tl.arange(0, BCHUNK)
        owner = tl.sum((ends[None, :] <= b[:, None]).to(tl.int32), axis=1)  # first expert whose end > b
        tl.store(blk_e_ptr + b, tl.minimum(owner, E - 1), mask=b < NUM_BLOCKS)
    tl.debug_barrier()
    for c in range(0, pairs, CHUNK):
        offs = c + tl.arange(0, CHUNK)
        e = _pair_experts(ids_ptr, w_ptr, offs, pairs, E)
        valid = e < E
        pos = tl.atomic_add(cursor_ptr + e, 1, mask=valid)
        tl.store(rows_ptr + pos, offs, mask=valid)


def align(ids: torch.Tensor, n_experts: int, BM: int, weights: torch.Tensor):
    """(rows int32 [n*BM], block experts int32 [n], number of used blocks int32 [1], n); n is the static bound
    pairs / BM + min(pairs, experts), so that CUDA graphs can capture the whole MoE. The pairs whose routing weight
    (`weights` fp32 [T, k]) is 0 are in no block (they add nothing: expert parallel's picks of other ranks' experts,
    `ref.held_picks`)."""
    pairs = ids.numel()
    nb_max = triton.cdiv(pairs, BM) + min(pairs, n_experts)
    dev = ids.device
    rows = torch.empty(nb_max * BM, dtype=torch.int32, device=dev)
    blk_e = torch.empty(nb_max, dtype=torch.int32, device=dev)
    nblk = torch.empty(1, dtype=torch.int32, device=dev)
    E_PAD = triton.next_power_of_2(n_experts + 1)
    cursor = torch.empty(E_PAD, dtype=torch.int32, device=dev)
    _align_kernel[(1,)](ids.reshape(-1), weights.reshape(-1), rows, blk_e, nblk, cursor, pairs, n_experts, nb_max,
                        BM=BM, E_PAD=E_PAD, CHUNK=256, BCHUNK=max(16, 8192 // E_PAD), num_warps=8)
    return rows, blk_e, nblk, nb_max
