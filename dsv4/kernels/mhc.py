"""mHC hyper-connections as Triton kernels: the collapse before a block (`hc_pre`), the residual update after it
(`hc_post`), and the HyperHead's final collapse (`hc_head`). Same contracts as `ref.hc_pre` / `hc_post` / `hc_head`
(the math is written out there).

Per token, streams X [n, d] (n = hc_mult, R = (2 + n) n mixing rows, or n for the head):
    m = fn @ X_flat * rsqrt(mean(X_flat^2) + norm_eps)          fn [R, n d] fp32
    pre, post, comb = sigmoid / 2 sigmoid / Sinkhorn of m * scale + base
    u = sum_j pre[j] X[j]
`hc_pre` and `hc_head` are two launches: `_mix_kernel` splits n*d into chunks over programs (a decode step has a
few tokens but fn is R x n d: 1.5 MB for V4-Flash; `plan_hc` sizes the chunks so that the launch fills the GPU) and
writes per-chunk partial products (fp32) and sums of squares; `_finish_kernel` (one program per token) adds
the chunks as one tile (a fixed order), normalises, runs the sigmoids and the Sinkhorn iterations in registers, and
collapses the streams; given the block's norm weight it holds the whole row and applies that RMSNorm too
(`norm_rope_row`, the norm kernel's code: the next kernel's round trip saved). The RMS factor multiplies the finished
dot product instead of every input: the same value within fp32 rounding. bf16 streams multiply fn as three exact
bf16 pieces on the tensor cores (`HcPlan.precision` "bf16x3", `pieces.dot_pieces`): the same sums within fp32
rounding as fp32 FMAs, without the FMA product's instructions. `hc_post` is one launch,
X'[k] = post[k] out + sum_j comb[j, k] X[j], accumulated in fp32 and rounded once to the stream dtype.
`hc_post_pre` (a sub-block's update, then the next sub-block's collapse) computes X' inside the mixing launch
(`_post_mix_kernel`: each program makes the columns of X' it multiplies, from the same columns of every stream, as
`_post_kernel` does, and stores them), then `_finish_kernel`: two launches for what `hc_post` + `hc_pre` do in three.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from .host import has_pdl
from .norm_rope import norm_rope_row
from .pieces import dot_pieces
from .policy import cdiv, next_pow2

MIX_CHUNK = 512       # fn columns per `_mix_kernel` program (at most)
MIX_BK = 64           # columns per inner step of a chunk (and the fewest a chunk has)
MIX_TOKENS = 16       # tokens per `_mix_kernel` program up to this many tokens: the rows of its products
                      # (tl.dot's least M)
MIX_TOKENS_MANY = 32  # tokens per program above MIX_TOKENS tokens (docs/tuning.md#mhc-mixing)
MIX_TOKENS_BF16 = 64  # the same for bf16 streams: a warp group's 64 rows of tensor-core products
MIX_PROGRAMS = 256    # chunks halve (down to MIX_BK columns) until a launch has this many programs: a decode step's
                      # few tokens then read fn (1.5 MB for V4-Flash) over the whole GPU, not 32 SMs
COLLAPSE_BD = 512     # hidden columns per step of the collapse and of `hc_post`
MIX_PRECISION = "ieee"  # the mixing product's tl.dot for fp32 streams: fp32 FMAs (bench/lab/mhc.py times others)
MIX_PRECISION_BF16 = "bf16x3"  # for bf16 streams: fn as three bf16 pieces on the tensor cores (module
                               # docstring)


@dataclass(frozen=True)
class HcPlan:
    """Launch geometry of one (tokens, streams, hidden, mixing rows) shape."""
    tokens: int
    streams: int          # n
    hidden: int           # d
    rows: int             # R: (2 + n) n for hc_pre, n for hc_head
    rows_p2: int          # R rounded up to a power of two, at least 16 (the products' N)
    chunk: int            # columns of n d per `_mix_kernel` program
    chunks: int           # programs per token block
    block_tokens: int = MIX_TOKENS       # tokens per mixing program (MIX_TOKENS, MIX_TOKENS_MANY or MIX_TOKENS_BF16)
    precision: str = MIX_PRECISION       # the mixing product: "bf16x3" (bf16 streams) or a tl.dot input precision
    warps: int = 4                       # of a mixing program

    @property
    def token_blocks(self) -> int:
        return cdiv(self.tokens, self.block_tokens)

    @property
    def chunks_p2(self) -> int:
        """The chunk partials `_finish_kernel` adds as one tile."""
        return next_pow2(self.chunks)


def takes_shape(streams: int, hidden: int) -> bool:
    """A power-of-two hc_mult, and hc_mult * hidden with a chunk (its gcd with MIX_CHUNK) that is a multiple of
    MIX_BK."""
    return not streams & (streams - 1) and math.gcd(streams * hidden, MIX_CHUNK) % MIX_BK == 0


@lru_cache(maxsize=None)
def plan_hc(tokens: int, streams: int, hidden: int, rows: int, bf16: bool = False) -> HcPlan:
    """The geometry of one shape (pure, cached; bf16: the streams are bf16): the mixing product in MIX_PRECISION_BF16
    for bf16 streams, else MIX_PRECISION; MIX_TOKENS tokens a mixing program up to that many tokens, above
    MIX_TOKENS_BF16 for bf16 streams, else MIX_TOKENS_MANY. The mixing product's chunks are MIX_CHUNK columns, or the
    largest divisor of n d below it that is a multiple of MIX_BK (a power of two), halved while the launch has fewer
    than MIX_PROGRAMS programs and a chunk more than MIX_BK columns."""
    width = streams * hidden
    chunk = math.gcd(width, MIX_CHUNK)
    if not takes_shape(streams, hidden):
        raise ValueError(f"hc kernels need a power-of-two hc_mult and hc_mult * hidden divisible by {MIX_BK}, "
                         f"got {streams} x {hidden}")
    block_tokens = MIX_TOKENS if tokens <= MIX_TOKENS else MIX_TOKENS_BF16 if bf16 else MIX_TOKENS_MANY
    blocks = cdiv(tokens, block_tokens)
    while chunk > MIX_BK and blocks * (width // chunk) < MIX_PROGRAMS:
        chunk //= 2
    return HcPlan(tokens, streams, hidden, rows, max(16, next_pow2(rows)), chunk, width // chunk, block_tokens,
                  MIX_PRECISION_BF16 if bf16 else MIX_PRECISION)


@triton.jit
def _mix_block(acc, sq, x, fn_ptr, r, rmask, k, K, PRECISION: tl.constexpr, DOT: tl.constexpr):
    """One block of the flattened streams x [BT, BK] (columns k, the streams' dtype) into the partial products acc
    [BT, RP] and the squares sq [BT, BK] (summed over the blocks column by column; the caller sums their columns
    once, after the last block). PRECISION "bf16x3" (bf16 streams): fn's block as three bf16 pieces on the tensor
    cores in DOT (`pieces.dot_pieces`), its block sum added to acc once. Else one tl.dot in that input precision."""
    w = tl.load(fn_ptr + r[:, None] * K + k[None, :], mask=rmask[:, None], other=0.0)
    xf = x.to(tl.float32)
    if PRECISION == "bf16x3":
        acc += dot_pieces(x, tl.trans(w), DOT)
    else:
        acc = tl.dot(xf, tl.trans(w), acc, input_precision=PRECISION)
    return acc, sq + xf * xf


@triton.jit
def _store_partials(part_ptr, acc, sq, c, t, tmask, r, stride_pc, stride_pt, RP: tl.constexpr):
    """Chunk c's partials of tokens t: part[c, t, :RP] = acc, part[c, t, RP] = the sum of the squares sq [BT, BK]."""
    ss = tl.sum(sq, axis=1)
    base = part_ptr + c * stride_pc + t[:, None] * stride_pt
    tl.store(base + r[None, :], acc, mask=tmask[:, None])
    tl.store(part_ptr + c * stride_pc + t * stride_pt + RP, ss, mask=tmask)


@triton.jit
def _mix_kernel(x_ptr, fn_ptr, part_ptr, T, K, R, stride_xt, stride_pc, stride_pt,
                RP: tl.constexpr, BT: tl.constexpr, CHUNK: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
                DOT: tl.constexpr):
    """Partial products of chunk c: part[c, t, r] = sum_{k in chunk} fn[r, k] x[t, k] for r < R, and
    part[c, t, RP] = sum_{k in chunk} x[t, k]^2 (x = the flattened streams, in fp32)."""
    tb, c = tl.program_id(0), tl.program_id(1)
    t = tb * BT + tl.arange(0, BT)
    r = tl.arange(0, RP)
    tmask, rmask = t < T, r < R
    acc = tl.zeros([BT, RP], tl.float32)
    sq = tl.zeros([BT, BK], tl.float32)
    for k0 in range(c * CHUNK, (c + 1) * CHUNK, BK):
        k = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + t[:, None].to(tl.int64) * stride_xt + k[None, :], mask=tmask[:, None], other=0.0)
        acc, sq = _mix_block(acc, sq, x, fn_ptr, r, rmask, k, K, PRECISION, DOT)
    _store_partials(part_ptr, acc, sq, c, t, tmask, r, stride_pc, stride_pt, RP)


@triton.jit
def _post_mix_kernel(out_ptr, x_ptr, post_ptr, comb_ptr, y_ptr, fn_ptr, part_ptr, T, K, R, D, stride_ot, stride_xt,
                     stride_yt, stride_pc, stride_pt, N: tl.constexpr, RP: tl.constexpr, BT: tl.constexpr,
                     CHUNK: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr, DOT: tl.constexpr,
                     OPAQUE: tl.constexpr):
    """`_mix_kernel` of the updated streams y = X' (stored in y's dtype as they are made, `_post_kernel`'s sum order):
    column k of the flattened y is stream s = k // D, y[s, col] = post[s] out[col] + sum_j comb[j, s] X[j, col]
    (D a multiple of BK: a BK block lies in one stream). OPAQUE (a GPU build): each block of y passes an identity
    the compiler may not copy, so y is made once and moved into the product's operand layout, not made a second
    time in that layout beside the store's."""
    tb, c = tl.program_id(0), tl.program_id(1)
    t = tb * BT + tl.arange(0, BT)
    r = tl.arange(0, RP)
    tmask, rmask = t < T, r < R
    t64 = t.to(tl.int64)
    dtype = y_ptr.dtype.element_ty
    acc = tl.zeros([BT, RP], tl.float32)
    sq = tl.zeros([BT, BK], tl.float32)
    for k0 in range(c * CHUNK, (c + 1) * CHUNK, BK):
        s = k0 // D
        col = k0 - s * D + tl.arange(0, BK)
        o = tl.load(out_ptr + t64[:, None] * stride_ot + col[None, :], mask=tmask[:, None], other=0.0)
        y = tl.load(post_ptr + t * N + s, mask=tmask, other=0.0)[:, None] * o.to(tl.float32)
        for j in tl.static_range(N):
            xj = tl.load(x_ptr + t64[:, None] * stride_xt + j * D + col[None, :], mask=tmask[:, None], other=0.0)
            y += tl.load(comb_ptr + t * N * N + j * N + s, mask=tmask, other=0.0)[:, None] * xj.to(tl.float32)
        k = k0 + tl.arange(0, BK)
        y = y.to(dtype)
        if OPAQUE:
            y = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [y], dtype=dtype, is_pure=False,
                                          pack=32 // dtype.primitive_bitwidth)
        tl.store(y_ptr + t64[:, None] * stride_yt + k[None, :], y, mask=tmask[:, None])
        acc, sq = _mix_block(acc, sq, y, fn_ptr, r, rmask, k, K, PRECISION, DOT)
    _store_partials(part_ptr, acc, sq, c, t, tmask, r, stride_pc, stride_pt, RP)


@triton.jit
def _sigmoid(v):
    return 1.0 / (1.0 + tl.exp(-v))


@triton.jit
def _finish_kernel(x_ptr, part_ptr, base_ptr, scale_ptr, u_ptr, post_ptr, comb_ptr, w_ptr, C, D, stride_xt, stride_pc,
                   stride_pt, norm_eps, hc_eps, w_eps, ITERS: tl.constexpr, N: tl.constexpr,
                   RP: tl.constexpr, CP: tl.constexpr, HEAD: tl.constexpr, BD: tl.constexpr, NORM: tl.constexpr,
                   PDL: tl.constexpr):
    """One token: mixes from the C chunk partials (one [CP, RP] tile summed over the chunks), then pre (and, unless
    HEAD, post and the Sinkhorn comb), then u = sum_j pre[j] X[j] in fp32, stored in u's dtype (rows of D); NORM
    (BD >= D: the whole row at once): rounded to u's dtype, then the RMSNorm by w (eps w_eps) before the store.
    PDL: the next launch may start now (a decode GEMV under PDL waits for this one before it reads u)."""
    if PDL:
        gdc_launch_dependents()
    t = tl.program_id(0)
    j = tl.arange(0, N)
    c = tl.arange(0, CP)
    q = tl.arange(0, RP)
    rows = part_ptr + c * stride_pc + t * stride_pt
    m = tl.sum(tl.load(rows[:, None] + q[None, :], mask=(c < C)[:, None], other=0.0), axis=0)     # [RP] mixes
    ss = tl.sum(tl.load(rows + RP, mask=c < C, other=0.0), axis=0)
    r = tl.math.rsqrt(ss / (N * D) + norm_eps)
    mix_pre = tl.sum(tl.where(q[None, :] == j[:, None], m[None, :], 0.0), axis=1)
    pre = _sigmoid(mix_pre * r * tl.load(scale_ptr) + tl.load(base_ptr + j)) + hc_eps
    if not HEAD:
        cell = j[:, None] * N + j[None, :]
        mix_post = tl.sum(tl.where(q[None, :] == N + j[:, None], m[None, :], 0.0), axis=1)
        mix_comb = tl.sum(tl.where(q[None, None, :] == (2 * N + cell)[:, :, None], m[None, None, :], 0.0), axis=2)
        post = 2.0 * _sigmoid(mix_post * r * tl.load(scale_ptr + 1) + tl.load(base_ptr + N + j))
        logits = mix_comb * r * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * N + cell)
        e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        comb = e / tl.sum(e, axis=1)[:, None] + hc_eps                 # row softmax + eps
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)          # then a column normalisation
        for _ in range(ITERS - 1):
            comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
            comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
        tl.store(post_ptr + t * N + j, post)
        tl.store(comb_ptr + t * N * N + cell, comb)
    dtype = u_ptr.dtype.element_ty
    for d0 in range(0, D, BD):
        dd = d0 + tl.arange(0, BD)
        dmask = dd < D
        xs = tl.load(x_ptr + t.to(tl.int64) * stride_xt + j[:, None] * D + dd[None, :], mask=dmask[None, :],
                     other=0.0).to(tl.float32)
        u = tl.sum(pre[:, None] * xs, axis=0)
        if NORM:
            u = norm_rope_row(u.to(dtype).to(tl.float32), dd, dmask, w_ptr, w_ptr, w_ptr, w_eps, dtype, D, BD, 2, 0,
                              False)
        tl.store(u_ptr + t.to(tl.int64) * D + dd, u.to(dtype), mask=dmask)


@triton.jit
def _post_kernel(out_ptr, x_ptr, post_ptr, comb_ptr, y_ptr, D, stride_ot, stride_xt, stride_yt,
                 N: tl.constexpr, BD: tl.constexpr):
    """One token, BD hidden columns: y[k] = post[k] out + sum_j comb[j, k] x[j] (fp32, one rounding)."""
    t, db = tl.program_id(0), tl.program_id(1)
    j = tl.arange(0, N)
    dd = db * BD + tl.arange(0, BD)
    dmask = dd < D
    t64 = t.to(tl.int64)
    out = tl.load(out_ptr + t64 * stride_ot + dd, mask=dmask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + t64 * stride_xt + j[:, None] * D + dd[None, :], mask=dmask[None, :], other=0.0)
    x = x.to(tl.float32)
    post = tl.load(post_ptr + t * N + j)
    y = post[:, None] * out[None, :]
    for src in range(N):
        row = tl.sum(tl.where(j[:, None] == src, x, 0.0), axis=0)                  # x[src]
        y += tl.load(comb_ptr + t * N * N + src * N + j)[:, None] * row[None, :]   # comb[src, k] x[src]
    tl.store(y_ptr + t64 * stride_yt + j[:, None] * D + dd[None, :], y.to(y_ptr.dtype.element_ty),
             mask=dmask[None, :])


def _collapse(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, hc_eps: float,
              norm_eps: float, head: bool, weight: torch.Tensor | None, weight_eps: float, update=None,
              plan: HcPlan | None = None):
    """The collapse of streams x; with `update` = (out, post, comb), of the streams hc_post(out, x, post, comb),
    which the mixing launch makes and stores (returned fourth). `plan`: the mixing launch's geometry (default
    `plan_hc`'s; bench/lab/mhc.py times others)."""
    lead, (n, d) = x.shape[:-2], x.shape[-2:]
    xt = x.reshape(-1, n * d).contiguous()
    src = xt
    if update is not None:
        xt = torch.empty_like(src)
    T, R = xt.shape[0], fn.shape[0]
    plan = plan or plan_hc(T, n, d, R, x.dtype == torch.bfloat16)
    dev = x.device
    dot = tl.bfloat16 if dev.type == "cuda" else tl.float32
    part = torch.empty(plan.chunks, T, plan.rows_p2 + 1, dtype=torch.float32, device=dev)
    u = torch.empty(T, d, dtype=x.dtype, device=dev)
    post = torch.empty(T, n, dtype=torch.float32, device=dev)
    comb = torch.empty(T, n, n, dtype=torch.float32, device=dev)
    norm = weight is not None
    bd = next_pow2(d) if norm else min(COLLAPSE_BD, next_pow2(d))
    if T and update is not None:
        out, post_in, comb_in = update
        o = out.reshape(-1, d).contiguous()
        _post_mix_kernel[(plan.token_blocks, plan.chunks)](
            o, src, post_in.reshape(T, n).float().contiguous(), comb_in.reshape(T, n, n).float().contiguous(), xt,
            fn.float().contiguous(), part, T, n * d, R, d, o.stride(0), src.stride(0), xt.stride(0), part.stride(0),
            part.stride(1), N=n, RP=plan.rows_p2, BT=plan.block_tokens, CHUNK=plan.chunk, BK=MIX_BK,
            PRECISION=plan.precision, DOT=dot, OPAQUE=dev.type == "cuda", num_warps=plan.warps)
    elif T:
        _mix_kernel[(plan.token_blocks, plan.chunks)](
            xt, fn.float().contiguous(), part, T, n * d, R, xt.stride(0), part.stride(0), part.stride(1),
            RP=plan.rows_p2, BT=plan.block_tokens, CHUNK=plan.chunk, BK=MIX_BK, PRECISION=plan.precision, DOT=dot,
            num_warps=plan.warps)
    if T:
        _finish_kernel[(T,)](
            xt, part, base.float().contiguous(), scale.float().contiguous(), u, post, comb,
            weight if norm else base, plan.chunks, d, xt.stride(0), part.stride(0), part.stride(1),
            norm_eps, hc_eps, weight_eps, ITERS=iters, N=n, RP=plan.rows_p2, CP=plan.chunks_p2, HEAD=head, BD=bd,
            NORM=norm, PDL=has_pdl(dev),
            num_warps=16 if n * bd >= 32768 else 8 if n * bd >= 8192 else 4)
    return u.view(*lead, d), post.view(*lead, n), comb.view(*lead, n, n), xt.view(x.shape)


def takes(streams: torch.Tensor) -> bool:
    """Whether the kernels take streams of this shape; others go to the fallback."""
    return takes_shape(*streams.shape[-2:])


def hc_pre(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, sinkhorn_iters: int,
           hc_eps: float, norm_eps: float, weight: torch.Tensor | None = None, weight_eps: float = 0.0,
           fallback=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Streams x [..., n, d] -> (collapsed [..., d] in x.dtype, post fp32 [..., n], comb fp32 [..., n, n]); with
    `weight`, the collapse RMS-normalised by it (`ref.hc_pre`)."""
    if fallback is not None and not takes(x):
        return fallback(x, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, weight, weight_eps)
    return _collapse(x, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, False, weight, weight_eps)[:3]


def hc_post_pre(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fn: torch.Tensor,
                base: torch.Tensor, scale: torch.Tensor, sinkhorn_iters: int, hc_eps: float, norm_eps: float,
                weight: torch.Tensor | None = None, weight_eps: float = 0.0, fallback=None):
    """`hc_post` then `hc_pre` of its streams in two launches (module docstring) -> (new streams, collapsed, post,
    comb), as `ref.hc_post_pre`."""
    if fallback is not None and not (takes(streams) and streams.shape[-1] % MIX_BK == 0):
        return fallback(out, streams, post, comb, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, weight,
                        weight_eps)
    u, p, c, new = _collapse(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, False, weight, weight_eps,
                             (out, post, comb))
    return new, u, p, c


def hc_head(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
            norm_eps: float, weight: torch.Tensor | None = None, weight_eps: float = 0.0,
            fallback=None) -> torch.Tensor:
    """Final collapse of the streams [..., n, d] -> [..., d] (a `pre` only); with `weight`, RMS-normalised by it."""
    if fallback is not None and not takes(x):
        return fallback(x, fn, base, scale, hc_eps, norm_eps, weight, weight_eps)
    return _collapse(x, fn, base, scale, 0, hc_eps, norm_eps, True, weight, weight_eps)[0]


def hc_post(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
            fallback=None) -> torch.Tensor:
    """Block output [..., d] and its input streams [..., n, d] -> new streams [..., n, d] in the streams' dtype."""
    if fallback is not None and not takes(streams):
        return fallback(out, streams, post, comb)
    lead, (n, d) = streams.shape[:-2], streams.shape[-2:]
    xs = streams.reshape(-1, n * d).contiguous()
    o = out.reshape(-1, d).contiguous()
    T = xs.shape[0]
    y = torch.empty_like(xs)
    BD = min(COLLAPSE_BD, next_pow2(d))
    if T:
        _post_kernel[(T, cdiv(d, BD))](o, xs, post.reshape(T, n).float().contiguous(),
                                       comb.reshape(T, n, n).float().contiguous(), y, d, o.stride(0),
                                       xs.stride(0), y.stride(0), N=n, BD=BD)
    return y.view(*lead, n, d)
