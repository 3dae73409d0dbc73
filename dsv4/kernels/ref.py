"""Pure-PyTorch reference of every kernel: the specification the Triton kernels are tested against.

Each function has the same signature as its Triton twin. Reference math dequantizes weights exactly
(fp32) and computes in fp32, then casts the result to the activation dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..formats import QWeight, stage_activation, w4a4_matmul_ref
from .steps import StepTokens


def linear(x: torch.Tensor, w: QWeight) -> torch.Tensor:
    """y = x @ W^T for one (unstacked) weight of any format: x [..., K] -> [..., N] in x.dtype."""
    if w.leading:
        raise ValueError(f"linear takes one weight, got stacked leading dims {w.leading}")
    if w.fmt == "dense" and w.weight.dtype == x.dtype:
        return F.linear(x, w.weight)
    return F.linear(x.float(), w.dequantize(torch.float32)).to(x.dtype)


def grouped_linear(x: torch.Tensor, w: QWeight, groups: int) -> torch.Tensor:
    """Block-diagonal projection (wo_a): x [..., g, Kg] with W [g*R, Kg] viewed as [g, R, Kg] -> [..., g, R].

    One bmm over the groups (transformers' DeepseekV4GroupedLinear's summation order), in fp32 on the exact
    weights, cast to x.dtype; a dense weight in x.dtype is used as is.
    """
    check_grouped(x, w, groups)
    c = x.shape[-1]
    same = w.fmt == "dense" and w.weight.dtype == x.dtype
    wt = (w.weight if same else w.dequantize(torch.float32)).view(groups, -1, c).transpose(1, 2)  # [g, Kg, R]
    xg = x.reshape(-1, groups, c).transpose(0, 1)                                                 # [g, T, Kg]
    y = torch.bmm(xg if same else xg.float(), wt)                                                 # [g, T, R]
    return y.transpose(0, 1).reshape(*x.shape[:-1], -1).to(x.dtype)


def check_grouped(x: torch.Tensor, w: QWeight, groups: int) -> None:
    if w.leading or x.dim() < 2 or x.shape[-2] != groups or w.in_features != x.shape[-1] or w.out_features % groups:
        raise ValueError(f"grouped_linear: x {tuple(x.shape)} must be [..., {groups}, Kg] and the weight "
                         f"[{groups} * R, Kg] with no leading dims; got weight {tuple(w.leading)} "
                         f"[{w.out_features}, {w.in_features}]")


def linear_w4a4(x: torch.Tensor, w: QWeight) -> torch.Tensor:
    """NVFP4 W4A4 emulation (Blackwell numerics): FP4 activations with alpha = input_scale * weight_scale_2."""
    if w.fmt != "nvfp4" or w.input_scale is None:
        raise ValueError("W4A4 emulation needs an NVFP4 weight with an input_scale")
    shape = x.shape
    w = w.untiled()
    x_fp4, x_sf, _ = stage_activation(x.reshape(-1, shape[-1]), w.input_scale)
    alpha = w.input_scale.float() * w.scale_2.float()
    y = w4a4_matmul_ref(x_fp4, x_sf, w.weight, w.scale, alpha, torch.float32)
    return y.reshape(*shape[:-1], -1).to(x.dtype)


def _stacked_dequant(w: QWeight, index: tuple) -> torch.Tensor:
    """Dequantize one leading index of a stacked QWeight (fp32 [N, K])."""
    return w.index(*index).dequantize()


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """V4's clamped SwiGLU: silu(min(gate, limit)) * clamp(up, -limit, limit), in fp32."""
    gate, up = gate.float().clamp(max=limit), up.float().clamp(-limit, limit)
    return F.silu(gate) * up


def mlp(x: torch.Tensor, w13: QWeight, w2: QWeight, limit: float) -> torch.Tensor:
    """Shared expert: w13 leading (2,) (gate, up), w2 unstacked. x [T, K] -> [T, D] in x.dtype."""
    gate = F.linear(x.float(), _stacked_dequant(w13, (0,)))
    up = F.linear(x.float(), _stacked_dequant(w13, (1,)))
    return linear(swiglu(gate, up, limit).to(x.dtype), w2)


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The router's dense projection: x [..., d] and weight [E, d] in fp32 -> fp32 logits [..., E] (DeepSeek's
    reference computes them so; bf16 x and weight values give exact products and fp32 sums)."""
    return F.linear(x.float(), weight.float())


def route(
    logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, scaling: float,
    tid2eid: torch.Tensor | None = None, input_ids: torch.Tensor | None = None, held: range | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router: logits [T, E] -> (weights fp32 [T, k], expert ids int64 [T, k]).

    scores = sqrt(softplus(logits)); ids = topk(scores + bias) (bias selects only) or tid2eid[input_ids] on
    hash layers; weights = scores[ids] normalised to sum 1, times the routed scaling factor.

    `held` (expert parallel): the ids local to that range of experts, the picks outside it with weight 0
    (`held_picks`).

    Biased top-k ids come in selection order: descending score, and on exactly equal scores the lower expert id
    first (a stable sort). `torch.topk`, which transformers uses, leaves ties unspecified (all-equal scores over 24
    experts, k = 4: ids 15, 17, 16, 18 on the CPU), so the routing kernel and this reference pin the same rule.
    """
    scores = torch.sqrt(F.softplus(logits.float()))
    if tid2eid is not None:
        ids = tid2eid[input_ids.reshape(-1)].long()
    else:
        ids = torch.sort(scores + bias.float(), dim=-1, descending=True, stable=True).indices[:, :top_k].contiguous()
    w = scores.gather(1, ids)
    w = w / (w.sum(-1, keepdim=True) + 1e-20) * scaling
    return (w, ids) if held is None else held_picks(w, ids, held)


def held_picks(weights: torch.Tensor, ids: torch.Tensor, held: range) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert parallel's routing in fixed shapes: the experts `held` (a contiguous range of global ids) numbered
    from 0, and every pick of an expert held elsewhere given routing weight 0 and, as its id, the token's first
    held pick (local expert 0 where the token has none): it adds exactly zero and names an expert the step reads
    anyway. -> (weights fp32 [T, k], local ids int64 [T, k])."""
    local = ids - held.start
    mine = (local >= 0) & (local < len(held))
    first = local.gather(1, mine.int().argmax(1, keepdim=True))      # the first held pick (pick 0 if none is)
    stand_in = torch.where(mine.any(1, keepdim=True), first, torch.zeros_like(first))
    return torch.where(mine, weights, torch.zeros_like(weights)), torch.where(mine, local, stand_in)


def moe(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: QWeight, w2: QWeight, limit: float,
    shared: tuple[QWeight, QWeight] | None = None, after_route: bool = False,
) -> torch.Tensor:
    """Routed experts: x [T, K], ids/weights [T, k]; w13 leading (E, 2), w2 leading (E,) -> [T, D] in x.dtype.

    Each token's output is sum_j weights[t, j] * W2_e swiglu(W1_e x, W3_e x) with e = ids[t, j]; the
    routing weight multiplies after W2, as in transformers. `shared` = (w13 (2,), w2): the shared expert's
    `mlp`, added to the rounded routed output (transformers' order). `after_route`: a scheduling hint for the
    Triton kernels (`kernels.moe.moe`), without effect here.
    """
    if shared is not None:
        return moe(x, ids, weights, w13, w2, limit) + mlp(x, *shared, limit)
    out = torch.zeros(x.shape[0], w2.out_features, dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        tok, slot = torch.where(ids == e)
        xe = x[tok].float()
        h = swiglu(F.linear(xe, _stacked_dequant(w13, (e, 0))), F.linear(xe, _stacked_dequant(w13, (e, 1))), limit)
        y = F.linear(h.to(x.dtype).float(), _stacked_dequant(w2, (e,)))
        out.index_add_(0, tok, y * weights[tok, slot, None].float())
    return out.to(x.dtype)


# ------------------------------------------------------------------------------------------- norms and rope
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Weighted RMSNorm over the last axis: fp32 normalisation times the fp32 weight, cast once to x.dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing 2*cos.shape[-1] channels of x as interleaved pairs (2i, 2i+1); -angle if `inverse`.

    cos/sin must broadcast against x[..., :half] (e.g. [B, S, 1, half] for x [B, S, H, D]). The rotation is
    computed in fp32 and cast back; the leading (nope) channels are untouched.
    """
    rd = 2 * cos.shape[-1]
    if inverse:
        sin = -sin
    r = x[..., -rd:].float()
    a, b = r[..., 0::2], r[..., 1::2]
    rotated = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    return torch.cat((x[..., :-rd], rotated.to(x.dtype)), dim=-1)


def norm_rope(x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, weight: torch.Tensor | None = None,
              eps: float | None = None, inverse: bool = False, fp8_nope: int = 0) -> torch.Tensor:
    """x [..., D] normalised (eps given: `rms_norm` with `weight`, or the unweighted `rms` without one), then rotated
    (cos / sin given: [..., R] against x [..., D], or against each head of x [..., H, D]), then its first fp8_nope
    channels rounded through the fp8 cache's codes (`fp8_kv_round`); `kernels.norm_rope`."""
    if eps is not None:
        x = rms(x, eps) if weight is None else rms_norm(x, weight, eps)
    if cos is not None:
        if x.dim() == cos.dim() + 1:
            cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        x = apply_rope(x, cos, sin, inverse)
    return fp8_kv_round(x, fp8_nope) if fp8_nope else x


def norm_ropes(*calls: tuple) -> tuple[torch.Tensor, ...]:
    """`norm_rope(*call)` of each call (its arguments as a tuple); `kernels.norm_rope.norm_ropes`."""
    return tuple(norm_rope(*call) for call in calls)


# ------------------------------------------------------------------------------------------- compressor
# Every `ratio` tokens pool into one compressed entry (dsv4-architecture.md; `model.compressor` has the math in
# words). Window j holds positions j*ratio .. j*ratio + ratio - 1; CSA (overlap) entries also pool the Ca half
# (first head_dim channels) of window j-1, then the Cb half of window j.
def compress_pool(kv: torch.Tensor, score: torch.Tensor, prev: tuple[torch.Tensor, torch.Tensor] | None,
                  overlap: bool, head_dim: int) -> torch.Tensor:
    """Complete windows kv, score [B, n, ratio, width] -> un-normalised entries [B, n, head_dim]: per channel, a
    softmax over the window's slots (fp32, cast to kv's dtype) weighting the kv rows.

    overlap: `prev` is the (kv, score) Ca half [B, ratio, head_dim] of the window before the first one, or None
    (the first window of the sequence: weight 0)."""
    B, n, m, _ = kv.shape
    if n == 0:
        return kv.new_zeros(B, 0, head_dim)
    if overlap:
        hd = head_dim
        if prev is None:
            prev = (kv.new_zeros(B, 1, m, hd), score.new_full((B, 1, m, hd), float("-inf")))
        else:
            prev = (prev[0].unsqueeze(1).to(kv.dtype), prev[1].unsqueeze(1).to(score.dtype))
        kv = torch.cat((torch.cat((prev[0], kv[:, :-1, :, :hd]), dim=1), kv[..., hd:]), dim=2)
        score = torch.cat((torch.cat((prev[1], score[:, :-1, :, :hd]), dim=1), score[..., hd:]), dim=2)
    return (kv * score.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2)


def compress_finish(pooled: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> torch.Tensor:
    """RMSNorm, then the rope at each entry's window start (cos / sin [..., rope_dim / 2] against pooled's rows)."""
    return apply_rope(rms_norm(pooled, weight, eps), cos, sin)


class SecondCompressor(NamedTuple):
    """`compress`'s second compressor: its step rows, ape, state, norm weight and eps (the first's arguments of the
    same names)."""
    kv: torch.Tensor
    score: torch.Tensor
    ape: torch.Tensor
    state: object
    weight: torch.Tensor
    eps: float


def compress(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, steps: StepTokens, state, ratio: int,
             cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor, eps: float,
             max_windows: int | None = None, second: SecondCompressor | None = None) -> None:
    """One step of a compressor for every sequence of a ragged step (`kernels.compressor.compress`'s contract).

    kv [N, width] (compute dtype) and score [N, width] (the gate logits) are the step's projected rows; a row at
    position p scores score + ape[p mod ratio] in fp32 (ape [ratio, width] fp32); cos / sin [N, rope_dim / 2] the
    rope at each token's window start. `state` holds open_kv / open_score [slots, ratio,
    width] (the open window, position p at row p mod ratio), prev_kv / prev_score [slots, ratio, head_dim] (CSA:
    the Ca half of the last complete window; -inf scores = none) and entries [pages, E, head_dim] (entry j of a
    sequence at row j mod E of page pages[j // E]; fp8 codes with entry_scales, or packed fp8 rows with
    packed_nope). Per sequence: the open rows and its tokens form its windows;
    each window that closes gives one entry (pooled, normed, roped) written to its page; the Ca half of the last
    closed window and the rows of the new open window are kept. max_windows: a bound on the windows any sequence
    closes in the step (the kernel's grid; unused here). second: another compressor of the same step, ratio and
    rope (a CSA layer's indexer compressor), stepped after this one (the kernel runs both in the same launches)."""
    if second is not None:
        compress(kv, score, ape, steps, state, ratio, cos, sin, weight, eps, max_windows)
        compress(second.kv, second.score, second.ape, steps, second.state, ratio, cos, sin, second.weight,
                 second.eps, max_windows)
        return
    overlap = state.prev_kv is not None
    hd, per_page = kv.shape[-1] // (2 if overlap else 1), state.entries.shape[1]
    m = ratio
    score = score.float() + ape[steps.pos.long() % m]
    for b, (slot, start, first, n) in enumerate(steps.spans()):
        held, j0 = start % m, start // m                   # rows of the open window already in the state
        k = torch.cat((state.open_kv[slot, :held], kv[first:first + n]))
        s = torch.cat((state.open_score[slot, :held], score[first:first + n]))
        w = k.shape[0] // m
        if w:
            win_k, win_s = k[:w * m].unflatten(0, (w, m))[None], s[:w * m].unflatten(0, (w, m))[None]
            # the Ca half of the window before: none for the sequence's first window (whatever the state holds)
            prev = (state.prev_kv[slot:slot + 1], state.prev_score[slot:slot + 1]) if overlap and j0 else None
            j = torch.arange(j0, j0 + w, device=kv.device)
            close = first + (j + 1) * m - 1 - start            # the step token that closes window j
            new = compress_finish(compress_pool(win_k, win_s, prev, overlap, hd)[0], cos[close], sin[close],
                                  weight, eps)
            page = steps.pages[b].long()[j // per_page]
            if state.packed_nope:
                new = fp8_kv_pack(new, state.packed_nope)
            elif state.entry_scales is not None:
                new, state.entry_scales[page, j % per_page] = fp8_key_codes(new)
            state.entries[page, j % per_page] = new
            if overlap:                                        # the Ca half of the last window feeds the next entry
                state.prev_kv[slot] = win_k[0, -1, :, :hd]
                state.prev_score[slot] = win_s[0, -1, :, :hd]
        rest = k.shape[0] - w * m
        state.open_kv[slot, :rest] = k[w * m:]
        state.open_score[slot, :rest] = s[w * m:]


FP8_MAX = 448.0               # the largest e4m3 value


def fp8_key_codes(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [..., hd] -> (fp8 e4m3 codes of row / scale, fp32 scales [...]): the scale is the least power of two at or
    above the row's max |value| / 448 (2^-126 for a zero row), so dividing by it is exact and no code saturates."""
    x = keys.float()
    bits = (x.abs().amax(dim=-1) / FP8_MAX).view(torch.int32)
    exponent = ((bits >> 23) + ((bits & 0x7FFFFF) != 0)).clamp(min=1)          # round up to a power of two
    scales = (exponent << 23).view(torch.float32)
    return (x / scales[..., None]).to(torch.float8_e4m3fn), scales


# The attention's fp8 cache (kv_cache_dtype "fp8"): a K = V row of D channels keeps its `nope` leading channels as
# e4m3 codes in blocks of 64 channels (the last block may be shorter), each block scaled by a power of two (UE8M0),
# and its rope channels in the compute dtype, as DeepSeek's reference rounds the window's and the compressed rows
# (`act_quant(..., 64, "ue8m0", inplace=True)`: scale 2^ceil(log2(max(amax, 1e-4) / 448)), codes clamped to +-448).
# A packed row is `kv_row_bytes` bytes: nope codes, the rope values as bf16, one exponent byte per block, zero padding
# to a multiple of 8 (V4: 448 + 128 + 7 + 1 = 584, FlashMLA's "MODEL1" row).
KV_BLOCK = 64


def kv_row_bytes(head_dim: int, nope: int) -> int:
    """Bytes of one packed fp8 K = V row (`fp8_kv_pack`)."""
    return -(-(nope + 2 * (head_dim - nope) + -(-nope // KV_BLOCK)) // 8) * 8


def _kv_exponents(x: torch.Tensor, nope: int) -> torch.Tensor:
    """The biased exponents e (scale 2^(e - 127)) of x's nope blocks, int32 [..., blocks]."""
    blocks = -(-nope // KV_BLOCK)
    amax = F.pad(x[..., :nope].float().abs(), (0, blocks * KV_BLOCK - nope)).unflatten(-1, (blocks, KV_BLOCK))
    bits = (amax.amax(-1).clamp(min=1e-4) * (1.0 / FP8_MAX)).view(torch.int32)
    return (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(torch.int32)              # round up to a power of two


def _kv_scales(exponents: torch.Tensor, nope: int) -> torch.Tensor:
    """Each nope channel's scale fp32 [..., nope] from its block's biased exponent."""
    return (exponents << 23).view(torch.float32).repeat_interleave(KV_BLOCK, -1)[..., :nope]


def _kv_codes(x: torch.Tensor, exponents: torch.Tensor, nope: int) -> torch.Tensor:
    scales = _kv_scales(exponents, nope)
    return (x[..., :nope].float() / scales).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scales


def fp8_kv_round(x: torch.Tensor, nope: int) -> torch.Tensor:
    """x [..., D] with its nope channels rounded through the fp8 cache's codes and back, its rope channels through
    bf16: the values a packed row holds, in x's dtype (exactly: an e4m3 code times a power of two fits bf16)."""
    codes, scales = _kv_codes(x, _kv_exponents(x, nope), nope)
    return torch.cat(((codes.float() * scales).to(x.dtype), x[..., nope:].to(torch.bfloat16).to(x.dtype)), dim=-1)


def fp8_kv_pack(x: torch.Tensor, nope: int) -> torch.Tensor:
    """Rows x [..., D] -> packed fp8 rows uint8 [..., kv_row_bytes(D, nope)] (see KV_BLOCK)."""
    exponents = _kv_exponents(x, nope)
    codes, _ = _kv_codes(x, exponents, nope)
    rope = x[..., nope:].to(torch.bfloat16).contiguous().view(torch.uint8)
    row = torch.cat((codes.view(torch.uint8), rope, exponents.to(torch.uint8)), dim=-1)
    return F.pad(row, (0, kv_row_bytes(x.shape[-1], nope) - row.shape[-1]))


def fp8_kv_unpack(rows: torch.Tensor, head_dim: int, nope: int, dtype: torch.dtype) -> torch.Tensor:
    """Packed fp8 rows uint8 [..., kv_row_bytes] -> their values [..., head_dim] in `dtype`."""
    rope_end = nope + 2 * (head_dim - nope)
    exponents = rows[..., rope_end:rope_end + -(-nope // KV_BLOCK)].to(torch.int32)
    values = rows[..., :nope].contiguous().view(torch.float8_e4m3fn).float() * _kv_scales(exponents, nope)
    rope = rows[..., nope:rope_end].contiguous().view(torch.bfloat16)
    return torch.cat((values.to(dtype), rope.to(dtype)), dim=-1)


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """Lightning-indexer scores fp32 [B, S, T]: sum_h weights[..., h] * relu(q[..., h, :] . key) * scale, for q
    [B, S, H, hd] (rotated), weights fp32 [B, S, H], keys [B, T, hd]."""
    s = torch.matmul(q.float(), keys.transpose(-1, -2).float().unsqueeze(1))      # [B, S, H, T]
    s = F.relu(s) * scale
    return (s * weights.unsqueeze(-1)).sum(dim=2)


def index_select(scores: torch.Tensor, positions: torch.Tensor, topk: int, ratio: int) -> torch.Tensor:
    """Top-k entry ids [B, S, min(topk, T)] (int64) of scores [B, S, T] among each query's visible entries; -1
    where a pick is not visible."""
    limit = visible_entries(positions, ratio).unsqueeze(-1)                          # [B, S, 1]
    ids = torch.arange(scores.shape[-1], device=scores.device)
    scores = scores.masked_fill(ids >= limit, float("-inf"))
    picks = scores.topk(min(topk, scores.shape[-1]), dim=-1).indices
    return picks.masked_fill(picks >= limit, -1)


def index_picks(q: torch.Tensor, weights: torch.Tensor, entries: torch.Tensor, steps: StepTokens, topk: int,
                ratio: int, scale: float, max_keys: int | None = None, weight_scale: float = 1.0,
                entry_scales: torch.Tensor | None = None) -> torch.Tensor:
    """The indexer's picks for every token of a ragged step (`kernels.indexer.index_picks`'s contract): q [N, H, hd]
    (rotated), weights [N, H] (the head weights are weights in fp32 times weight_scale); each token scored against
    every key its sequence has emitted (entries [pages, E, hd] through its page table; with entry_scales [pages, E]
    the keys are the fp8 codes times their scales) -> [N, topk] int64, -1 past each token's picks. max_keys: a bound
    on the keys of any sequence (the kernel sizes its score rows by it; unused here)."""
    per_page = entries.shape[1]
    weights = weights.float() * weight_scale
    picks = torch.full((q.shape[0], topk), -1, dtype=torch.long, device=q.device)
    for b, (_, start, first, n) in enumerate(steps.spans()):
        tok = slice(first, first + n)
        count = (start + n) // ratio
        used = steps.pages[b, :-(-count // per_page)].long()
        keys = entries[used].flatten(0, 1)[None, :count]
        if entry_scales is not None:
            keys = keys.float() * entry_scales[used].flatten(0, 1)[None, :count, None]
        found = index_select(index_scores(q[None, tok], weights[None, tok], keys, scale),
                             steps.pos[tok].long()[None], topk, ratio)[0]
        picks[tok, :found.shape[-1]] = found
    return picks


# ------------------------------------------------------------------------------------------- attention
def visible_entries(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """Number of compressed entries query position t may read: floor((t+1) / ratio). [B, S] -> [B, S]."""
    return torch.div(positions + 1, ratio, rounding_mode="floor")


def window_bias(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Additive mask [B, S, T]: key at position p is visible to query t iff t - window < p <= t (p >= 0)."""
    q, k = q_pos.unsqueeze(-1), k_pos.unsqueeze(-2)
    ok = (k <= q) & (k > q - window) & (k >= 0)
    return torch.zeros(ok.shape, dtype=torch.float32, device=ok.device).masked_fill(~ok, float("-inf"))


def ring_positions(start: int, window: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Position held by each ring row once `start` tokens are cached: the latest p < start with p = row
    (mod window), or -1 if there is none yet. -> int64 [window]."""
    rows = torch.arange(window, device=device)
    held = start - 1 - torch.remainder(start - 1 - rows, window)
    return torch.where(held >= 0, held, -1)


def causal_entry_bias(q_pos: torch.Tensor, n_entries: int, ratio: int) -> torch.Tensor:
    """HCA: entry j is visible to query t iff (j+1)*ratio <= t+1. -> [B, S, n_entries]."""
    ids = torch.arange(n_entries, device=q_pos.device)
    hidden = ids >= visible_entries(q_pos, ratio).unsqueeze(-1)
    return torch.zeros(hidden.shape, dtype=torch.float32, device=q_pos.device).masked_fill(hidden, float("-inf"))


def picked_entry_bias(picks: torch.Tensor, n_entries: int) -> torch.Tensor:
    """CSA: only the indexer's valid picks [B, S, k] (-1 = invalid) are visible. -> [B, S, n_entries]."""
    B, S, _ = picks.shape
    bias = torch.full((B, S, n_entries + 1), float("-inf"), device=picks.device)
    bias.scatter_(-1, torch.where(picks >= 0, picks, n_entries), 0.0)   # invalid picks land in a dropped column
    return bias[..., :n_entries]


def attend(q: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor, sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, S, H, D], shared K=V kv [B, T, D], additive bias [B, S, T], sinks [H] -> o [B, S, H, D].

    The sink is one more logit per head (not scaled) whose probability is dropped.
    """
    B, S, H, _ = q.shape
    logits = torch.matmul(q.transpose(1, 2), kv.transpose(-1, -2).unsqueeze(1)) * scale     # [B, H, S, T]
    logits = logits + bias.unsqueeze(1).to(logits.dtype)
    logits = torch.cat((logits, sinks.view(1, H, 1, 1).expand(B, H, S, 1).to(logits.dtype)), dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(kv.dtype)
    return torch.matmul(probs, kv.unsqueeze(1)).transpose(1, 2)


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, ring: torch.Tensor, entries: torch.Tensor | None,
                     picks: torch.Tensor | None, steps: StepTokens, ratio: int, sinks: torch.Tensor,
                     scale: float, max_entries: int | None = None, update_ring: bool = False,
                     entry_nope: int = 0, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                     q_eps: float | None = None) -> torch.Tensor:
    """Cached attention of a ragged step (`kernels.attention.sparse_attention`'s contract): per sequence, its ring,
    its step rows and its entries (HCA: all visible ones; CSA: the picks [N, K], -1 = none) through its page table,
    with `window_bias` / `causal_entry_bias` / `picked_entry_bias` masks, one `attend`. -> o [N, H, D]. max_entries:
    a bound on the entries any token sees (the kernel's key split; unused here). update_ring: then the step's rows
    into the rings as `write_ring` does (the kernel writes them in the same launch, which is right only for a decode
    step: one token per sequence). entry_nope > 0: entries are packed fp8 rows (`fp8_kv_unpack` with that many fp8
    channels). rope = (cos, sin) [N, R] and q_eps: q comes un-normalised and un-rotated; it is first `norm_rope`d
    (q_eps: the unweighted RMS of each head) and the output is rotated back (`norm_rope(inverse=True)`)."""
    if rope is not None or q_eps is not None:
        q = norm_rope(q, *(rope or (None, None)), eps=q_eps)
    W, out = ring.shape[1], []
    for b, (slot, start, first, n) in enumerate(steps.spans()):
        tok = slice(first, first + n)
        pos = steps.pos[tok].long()
        keys = torch.cat((ring[slot], kv[tok]))
        key_pos = torch.cat((ring_positions(start, W, pos.device), pos))
        bias = window_bias(pos[None], key_pos[None], W)
        if ratio and entries is not None:
            count = (start + n) // ratio
            pages = steps.pages[b, :-(-count // entries.shape[1])].long()
            seq_entries = entries[pages].flatten(0, 1)[:count]
            if entry_nope:
                seq_entries = fp8_kv_unpack(seq_entries, q.shape[-1], entry_nope, kv.dtype)
            if ratio == 4:
                entry_bias = picked_entry_bias(picks[tok].long()[None], count)
            else:
                entry_bias = causal_entry_bias(pos[None], count, ratio)
            keys, bias = torch.cat((keys, seq_entries)), torch.cat((bias, entry_bias), dim=-1)
        out.append(attend(q[None, tok], keys[None], bias, sinks, scale)[0])
    if update_ring:
        write_ring(ring, kv, steps)
    o = torch.cat(out) if out else torch.empty_like(q)
    return norm_rope(o, *rope, inverse=True) if rope is not None else o


def write_ring(ring: torch.Tensor, kv: torch.Tensor, steps: StepTokens) -> None:
    """Each sequence's last W rows of this step into its slot's ring (row = position mod W), in place."""
    W = ring.shape[1]
    seq = steps.seq.long()
    counts = torch.bincount(seq, minlength=steps.slot.shape[0])
    keep = steps.pos >= (steps.start + counts)[seq] - W
    ring[steps.slot.long()[seq[keep]], (steps.pos[keep] % W).long()] = kv[keep]


# ------------------------------------------------------------------------------------------- mHC
# Manifold-constrained hyper-connections: hc_mult residual streams, collapsed before and expanded after each block.
#
# Per token, with streams X [n, d] (n = hc_mult):
#     m    = fn @ rms(flatten(X))                 one RMS over all n*d values; fn [(2+n)*n, n*d], fp32
#     pre  = sigmoid(m[:n] * scale[0] + base[:n]) + eps
#     post = 2 * sigmoid(m[n:2n] * scale[1] + base[n:2n])              (no eps)
#     comb = sinkhorn(m[2n:].view(n, n) * scale[2] + base[2n:])        comb[j, k]: source stream j -> k
#     u    = sum_j pre[j] X[j]                    on the un-normalised streams
#     X'   = post (x) F(u) + comb^T X             i.e. X'[k] = post[k] F(u) + sum_j comb[j, k] X[j]


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Unweighted RMS normalisation over the last axis (q per head, mHC input): statistics in fp32."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[..., n, n] -> doubly stochastic: row softmax + eps, a column normalisation, then iters-1 (row, column)."""
    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def _mixes(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    flat = rms(x.flatten(-2).float(), norm_eps)
    return F.linear(flat, fn.float())


def hc_pre(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, sinkhorn_iters: int,
           hc_eps: float, norm_eps: float, weight: torch.Tensor | None = None,
           weight_eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Streams x [B, S, n, d] -> (collapsed [B, S, d] in x.dtype, post fp32 [B, S, n], comb fp32 [B, S, n, n]).
    With `weight` (the block's attn_norm / ffn_norm) the collapsed rows come out `rms_norm`ed by it, eps weight_eps."""
    n = x.shape[-2]
    pre_w, post_w, comb_w = _mixes(x, fn, norm_eps).split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = sinkhorn(comb_w.unflatten(-1, (n, n)) * scale[2] + comb_b.view(n, n), sinkhorn_iters, hc_eps)
    collapsed = (pre.unsqueeze(-1) * x).sum(dim=-2).to(x.dtype)
    return (collapsed if weight is None else rms_norm(collapsed, weight, weight_eps)), post, comb


def hc_post(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Block output [B, S, d] and the block's input streams [B, S, n, d] -> new streams [B, S, n, d].

    comb is applied transposed (the first axis is the source stream). post and comb are cast to the stream
    dtype before mixing, as transformers does.
    """
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


def hc_post_pre(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fn: torch.Tensor,
                base: torch.Tensor, scale: torch.Tensor, sinkhorn_iters: int, hc_eps: float, norm_eps: float,
                weight: torch.Tensor | None = None, weight_eps: float = 0.0):
    """One sub-block's residual update and the next one's collapse: the new streams `hc_post(out, streams, post,
    comb)`, then `hc_pre` of them -> (new streams, collapsed, post, comb)."""
    new = hc_post(out, streams, post, comb)
    return (new, *hc_pre(new, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, weight, weight_eps))


def hc_head(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
            norm_eps: float, weight: torch.Tensor | None = None, weight_eps: float = 0.0) -> torch.Tensor:
    """Final collapse of the streams [B, S, n, d] -> [B, S, d]: a `pre` only (no post, no comb, no Sinkhorn); with
    `weight` (the final norm's) `rms_norm`ed by it, eps weight_eps."""
    pre = torch.sigmoid(_mixes(x, fn, norm_eps) * scale.float() + base.float()) + hc_eps
    collapsed = (pre.unsqueeze(-1) * x).sum(dim=-2).to(x.dtype)
    return collapsed if weight is None else rms_norm(collapsed, weight, weight_eps)


# ------------------------------------------------------------------ token sampling (kernels/sampling.py)
SAMPLE_MASS_BITS = 40        # a token's mass: the integer ceil(exp(x - max x) * 2^SAMPLE_MASS_BITS)
SAMPLE_CANDIDATES = 4        # draws over what min-p and top-k allow before a top-p row draws from its kept set
SPLITMIX64 = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)   # splitmix64's increment and mixers
_U32 = 0xFFFFFFFF


def _as_int64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


GOLDEN_GAMMA, _MIX_1, _MIX_2 = map(_as_int64, SPLITMIX64)


def row_keys(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """int64 per (seed, counter) pair, the key of a row's draws: splitmix64's output for the counter-th step of the
    stream that starts at mix(seed)."""
    return _mix64(_mix64(seeds) + counters * GOLDEN_GAMMA)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's mixer on int64 (products wrap modulo 2^64; >> made logical)."""
    z = (z ^ ((z >> 30) & ((1 << 34) - 1))) * _MIX_1
    z = (z ^ ((z >> 27) & ((1 << 37) - 1))) * _MIX_2
    return z ^ ((z >> 31) & ((1 << 33) - 1))


def draw_words(row_keys: torch.Tensor, n: int) -> torch.Tensor:
    """int64 [B, n]: a row's random 64-bit words (bit patterns), word r = mix(row key + (r + 1) * golden gamma), the
    splitmix64 stream that continues from the row key."""
    r = torch.arange(1, n + 1, dtype=torch.int64, device=row_keys.device)
    return _mix64(row_keys[:, None] + r[None] * GOLDEN_GAMMA)


def mulhi64(word: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """floor(word * total / 2^64) for 64-bit words (int64 bit patterns) and 0 <= total < 2^62: a uniform integer in
    [0, total) for a uniform word, each value drawn by floor or ceil of 2^64 / total words. By 32-bit halves; the
    products of two halves wrap to int64 and keep their bits."""
    w0, w1 = word & _U32, (word >> 32) & _U32
    t0, t1 = total & _U32, total >> 32
    low = w0 * t0
    mid_a = w1 * t0
    mid_b = w0 * t1
    carry = ((low >> 32) & _U32) + (mid_a & _U32) + (mid_b & _U32)
    return w1 * t1 + ((mid_a >> 32) & _U32) + (mid_b >> 32) + (carry >> 32)


def sample_masses(logits: torch.Tensor, inv_temperature: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """int64 [B, V]: the kept tokens' masses ceil(exp(x - max x) 2^SAMPLE_MASS_BITS), x = logits * inv_temperature; 0
    for the others and for -inf logits (a row of only -inf weighs nothing)."""
    x = logits * inv_temperature[:, None]
    e = torch.exp(x - x.amax(dim=-1, keepdim=True))
    return torch.where(kept & (x > float("-inf")), torch.ceil(e * 2.0**SAMPLE_MASS_BITS), 0.0).long()


def draw_by_mass(masses: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """int64 [B, n]: for each word, the token whose mass holds mulhi64(word, T) on the row's masses laid end to end in
    token order (T their sum): the first token whose running sum exceeds it, which is token i with probability
    masses_i / T; V where T is 0."""
    running = masses.cumsum(dim=-1)
    u = mulhi64(words, running[:, -1:].expand_as(words))
    return torch.searchsorted(running, u, right=True)


def sample_kept(logits: torch.Tensor, inv_temperature: torch.Tensor, min_p: torch.Tensor | None,
                top_k: torch.Tensor | None, drop_share: torch.Tensor | None) -> torch.Tensor:
    """bool [B, V]: the tokens a row may draw (kernels/sampling.py's rules) with x = logits * inv_temperature: min-p
    (exp(x - max x) >= min_p), top-k (x >= the top_k-th largest x, ties kept), then top-p (masses m = ceil(exp(x -
    max x) 2^SAMPLE_MASS_BITS) on what is left, T their sum: a token stays iff the tokens with a larger x weigh less
    than T - floor(T * drop_share); rows with drop_share 0 skip it). Found by sorting each row."""
    x = logits * inv_temperature[:, None]
    e = torch.exp(x - x.amax(dim=-1, keepdim=True))
    keep = torch.ones_like(x, dtype=torch.bool)
    if min_p is not None:
        keep &= e >= min_p[:, None]
    if top_k is not None:
        k = top_k.clamp(max=x.shape[-1])
        kth = x.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        keep &= x >= kth
    if drop_share is None:
        return keep
    m = torch.where(keep, torch.ceil(e * 2.0**SAMPLE_MASS_BITS), 0.0).long()
    total = m.sum(dim=-1)
    budget = torch.floor(total.double() * drop_share).long()
    xs, order = torch.where(keep, x, float("-inf")).sort(dim=-1)       # ascending
    upto = m.gather(1, order).cumsum(dim=-1)                             # mass of the tokens up to each, sorted
    last = torch.searchsorted(xs, torch.where(keep, x, float("-inf")), right=True) - 1
    above = total[:, None] - upto.gather(1, last)                        # mass of the tokens with a larger x
    return keep & ((above < (total - budget)[:, None]) | (drop_share == 0)[:, None])   # top_p = 1: no top-p


def sample_tokens(logits: torch.Tensor, inv_temperature: torch.Tensor, greedy: torch.Tensor,
                  min_p: torch.Tensor | None, top_k: torch.Tensor | None, drop_share: torch.Tensor | None,
                  seeds: torch.Tensor, counters: torch.Tensor, candidates: int = SAMPLE_CANDIDATES) -> torch.Tensor:
    """One token per row of fp32 logits [B, V] -> int64 [B]: greedy rows argmax(logits) (ties to the lowest id); the
    others draw by mass (`draw_by_mass`) with the words of `draw_words(row_keys(seeds, counters))`. Word r < candidates
    draws over the tokens min-p and top-k allow, and the first of these draws that `sample_kept` keeps is the token (a
    rejection sampler: exact for the kept set); where none is kept, word `candidates` draws over the kept tokens. A
    row of only -inf draws token 0. Per row: inv_temperature fp32, greedy bool, min_p fp32, top_k int64 (>= V: off),
    drop_share fp64 (1 - top_p), seeds and counters int64; a filter's tensor may be None when no row uses it."""
    V = logits.shape[-1]
    allowed = sample_kept(logits, inv_temperature, min_p, top_k, None)
    kept = sample_kept(logits, inv_temperature, min_p, top_k, drop_share)
    words = draw_words(row_keys(seeds, counters), candidates + 1)
    masses = sample_masses(logits, inv_temperature, allowed)
    drawn = draw_by_mass(masses, words[:, :candidates])
    ok = kept.gather(1, drawn.clamp(max=V - 1)) & (drawn < V)
    first = torch.where(ok, torch.arange(candidates, device=ok.device), candidates).amin(dim=-1, keepdim=True)
    token = drawn.gather(1, first.clamp(max=candidates - 1))[:, 0]
    last = draw_by_mass(torch.where(kept, masses, 0), words[:, candidates:])[:, 0]   # the kept set is allowed
    token = torch.where(first[:, 0] < candidates, token, last)
    token = torch.where(token < V, token, 0)
    return torch.where(greedy, logits.argmax(dim=-1), token)