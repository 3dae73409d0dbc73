"""NVFP4 W4A4 emulation on Hopper: quantize activations exactly as Blackwell does (`stage_activation`),
then one GEMM over dequantized FP4 operands with alpha = input_scale * weight_scale_2 applied once to the
fp32 accumulator.

`_stage_kernel` is bit-identical to `dsv4.formats.stage_activation`, which follows FlashInfer's / TensorRT-LLM's
`cvt_warp_fp16_to_fp4` (IEEE-division variant) operation for operation: global = 1 / input_scale,
scale = e4m3(global * (amax * (1/6))), out = 1 / (scale * (1 / global)), code = e2m1(x * out). fp32 rounding is not
associative, so the kernel keeps that order and those divisions (`div_rn`; `amax * global / 6` or `global /
scale` differ in the last bit for some inputs and then, rarely, in a scale byte or a code). The E4M3 scale is
rounded to nearest-even by an fp32 magic-number add (no reliance on a conversion instruction's rounding), and the
E2M1 code by a magic-number add too (`_e2m1_code`): the same ties as `encode_e2m1`'s thresholds.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..formats import QWeight
from . import gemm
from .host import Scratch, cached, device_info, readable
from .policy import Format, TileConfig, tile_config, tiles_take


@triton.jit
def _round_e4m3(v):
    """Non-negative fp32 <= 448 -> the nearest E4M3 value (ties to even), as fp32."""
    bits = v.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # quantum 2^(e-3), subnormals below 2^-6
    big = ((e + 20 + 127) << 23).to(tl.float32, bitcast=True)  # 2^23 quanta: fp32 addition rounds to one
    return (v + big) - big


@triton.jit
def _e2m1_code(y):
    """fp32 -> E2M1 code (int32 0..15): round to nearest, ties to the even code, saturating at 6, sign bit kept
    (`encode_e2m1`). The magnitude is rounded by a magic-number add per binade of the E2M1 grid: below 2 the grid
    step is 0.5 (binade e = 127 after clamping), in [2, 4) 1 (128), from 4 on 2 (129); with big = step * 2^23,
    fp32 addition rounds a + big to a multiple of the step (ties to even) and its low mantissa bits are that
    multiple n, so the code is n + 2 (e - 127) (n = 0..4 codes 0 ... 2.0; the next binades start at codes 4 and
    6). No denormals, no conversion instruction, and fewer instructions than 7 comparisons and their sums."""
    a = tl.minimum(tl.abs(y), 6.0)
    e = tl.minimum(tl.maximum(a.to(tl.int32, bitcast=True) >> 23, 127), 129)
    big = ((e + 22) << 23).to(tl.float32, bitcast=True)
    n = (a + big).to(tl.int32, bitcast=True) & 0x7
    return (n + 2 * (e - 127)) | ((y < 0).to(tl.int32) << 3)


@triton.jit(do_not_specialize=["M"])
def _stage_kernel(x_ptr, q_ptr, sf_ptr, in_scale_ptr, glob_ptr, M, stride_xm, stride_qm, stride_sm,
                  RB: tl.constexpr, BG: tl.constexpr):
    """x [M, 16G] -> codes [M, 8G] (stored as int32 words: 8 codes each, code i at bits 4i, which is the packed
    byte order `pack_e2m1` gives on a little-endian machine) and e4m3 block scales [M, G]. A program takes RB rows
    x BG groups as a [RB * BG, 2, 8] tile (group, word, code), so that a thread holds whole words."""
    idx = tl.arange(0, RB * BG)
    row = tl.program_id(0) * RB + idx // BG
    grp = tl.program_id(1) * BG + idx % BG
    ok = row < M   # (G is a multiple of BG)
    row = row.to(tl.int64)
    one = tl.full([], 1.0, tl.float32)
    glob = tl.math.div_rn(one, tl.load(in_scale_ptr).to(tl.float32))
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(glob_ptr, glob)
    inv_glob = tl.math.div_rn(one, glob)
    one_sixth = tl.math.div_rn(one, one * 6.0)
    word = tl.arange(0, 2)[None, :, None]
    nib = tl.arange(0, 8)[None, None, :]
    offs = (row * stride_xm + grp * 16)[:, None, None] + word * 8 + nib
    x = tl.load(x_ptr + offs, mask=ok[:, None, None], other=0.0).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(x), axis=2), axis=1)
    sf = _round_e4m3(tl.minimum(glob * (amax * one_sixth), 448.0))
    out_scale = tl.where(sf > 0, tl.math.div_rn(one + tl.zeros_like(sf), tl.where(sf > 0, sf, 1.0) * inv_glob), 0.0)
    code = _e2m1_code(x * out_scale[:, None, None])
    packed = tl.sum(code << (nib * 4), axis=2)   # disjoint bit fields: the sum is their OR
    q_offs = (row * stride_qm + grp * 2)[:, None] + tl.arange(0, 2)[None, :]
    tl.store(q_ptr + q_offs, packed, mask=ok[:, None])
    sf_bits = sf.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    tl.store(sf_ptr + row * stride_sm + grp, sf_bits, mask=ok)


def stage_activation(x: torch.Tensor, input_scale: torch.Tensor | float, *, block: int = 128, num_warps: int = 2):
    """Same contract as `dsv4.formats.stage_activation`: [..., K] -> (x_fp4 uint8 [..., K/2],
    x_sf float8_e4m3fn [..., K/16], global = 1/input_scale fp32 []). `block` (groups of 16 per program) and
    `num_warps` only change the launch, never the bits (tuned on H200: docs/tuning.md#stage-activation)."""
    K = x.shape[-1]
    if K % 16:
        raise ValueError(f"stage_activation: K={K} is not a multiple of the NVFP4 block (16)")
    if block < 1 or block & (block - 1):
        raise ValueError(f"stage_activation: block={block} groups per program is not a power of two")
    input_scale = torch.as_tensor(input_scale, dtype=torch.float32, device=x.device).reshape(1)
    lead = x.shape[:-1]
    M, G = math.prod(lead), K // 16
    x2 = x.reshape(M, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    q = torch.empty(M, K // 8, dtype=torch.int32, device=x.device)   # 8 codes per word; K/2 bytes per row
    sf = torch.empty(M, G, dtype=torch.uint8, device=x.device)
    glob = torch.empty((), dtype=torch.float32, device=x.device)
    if G == 0:   # nothing to quantize: only the global scale (IEEE division, as the kernel's div_rn)
        glob.copy_(1.0 / input_scale[0])
        return q.view(torch.uint8).reshape(*lead, 0), sf.view(torch.float8_e4m3fn).reshape(*lead, 0), glob
    BG = min(64, G & -G, block)   # groups per row and program: a power of two that divides G (no masked lanes)
    RB = max(1, min(block // BG, triton.next_power_of_2(M)))
    _stage_kernel[(max(1, triton.cdiv(M, RB)), G // BG)](
        x2, q, sf, input_scale, glob, M, x2.stride(0), q.stride(0), sf.stride(0), RB=RB, BG=BG,
        num_warps=num_warps)
    return q.view(torch.uint8).reshape(*lead, K // 2), sf.view(torch.float8_e4m3fn).reshape(*lead, G), glob


def linear_w4a4(x: torch.Tensor, w: QWeight, *, fallback=None, scratch: Scratch | None = None):
    """Same contract as `ref.linear_w4a4`: the activations staged in NVFP4, then the fused tiles over FP4 x and W."""
    if w.fmt != "nvfp4" or w.input_scale is None:
        raise ValueError("W4A4 emulation needs an NVFP4 weight with an input_scale")
    if w.leading:
        raise ValueError(f"linear_w4a4 takes one weight, got stacked leading dims {w.leading}")
    K, N = w.in_features, w.out_features
    M = x.numel() // max(1, x.shape[-1])
    cfg = None
    if x.shape[-1] == K and K % 32 == 0 and readable(w, x.device):
        cfg = cached(scratch, ("w4a4", x.dtype, M, N, K, x.device), lambda: _tiles(x, M, N, K))
    if cfg is None:
        return fallback(x, w)
    x_fp4, x_sf, _ = stage_activation(x, w.input_scale)
    x_fp4 = x_fp4.reshape(-1, K // 2)
    x_sf = x_sf.reshape(-1, K // 16).view(torch.uint8)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M:  # both operands are exact in bf16, so the dot runs in bf16 whatever x.dtype is
        a = w.input_scale.reshape(1) if w.input_scale.dim() == 0 else w.input_scale
        gemm.launch(x_fp4, w, y, cfg, M=M, x_sf=x_sf, input_scale=a, scratch=scratch)
    return y.reshape(*x.shape[:-1], N)


def _tiles(x: torch.Tensor, M: int, N: int, K: int) -> TileConfig | None:
    device = device_info(x.device)
    if not tiles_take(Format("nvfp4", x.dtype), K, device):
        return None
    return tile_config(M, N, K, "nvfp4", device.sms, a_fp4=True)
