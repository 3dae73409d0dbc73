"""NVFP4 W4A4 emulation on Hopper: quantize activations exactly as Blackwell does (`stage_activation`),
then one GEMM over dequantized FP4 operands with alpha = input_scale * weight_scale_2 applied once to the
fp32 accumulator.

`_stage_kernel` is bit-identical to `dsv4.formats.stage_activation`: the E4M3 block scale is rounded to
nearest-even by an fp32 magic-number add (no reliance on a conversion instruction's rounding), divisions
are IEEE (`div_rn`), and the E2M1 code uses the same tie thresholds as `encode_e2m1`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import QWeight
from . import gemm


@triton.jit
def _round_e4m3(v):
    """Non-negative fp32 <= 448 -> the nearest E4M3 value (ties to even), as fp32."""
    bits = v.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # quantum 2^(e-3), subnormals below 2^-6
    big = ((e + 20 + 127) << 23).to(tl.float32, bitcast=True)  # 2^23 quanta: fp32 addition rounds to one
    return (v + big) - big


@triton.jit
def _e2m1_code(y):
    a = tl.abs(y)
    code = ((a > 0.25).to(tl.uint8) + (a >= 0.75).to(tl.uint8) + (a > 1.25).to(tl.uint8)
            + (a >= 1.75).to(tl.uint8) + (a > 2.5).to(tl.uint8) + (a >= 3.5).to(tl.uint8)
            + (a > 5.0).to(tl.uint8))
    return code | ((y < 0).to(tl.uint8) << 3)


@triton.jit(do_not_specialize=["M"])
def _stage_kernel(x_ptr, q_ptr, sf_ptr, in_scale_ptr, glob_ptr, M, G, stride_xm, stride_qm, stride_sm,
                  BR: tl.constexpr, BG: tl.constexpr):
    """x [M, 16G] -> packed codes [M, 8G] and e4m3 block scales [M, G]; rows BR x groups BG per program."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    grp = tl.program_id(1) * BG + tl.arange(0, BG)
    mask2 = (rows < M)[:, None] & (grp < G)[None, :]
    r64 = rows.to(tl.int64)
    glob = tl.math.div_rn(1.0, tl.load(in_scale_ptr).to(tl.float32))
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(glob_ptr, glob)
    offs = grp[:, None] * 16 + tl.arange(0, 16)[None, :]
    x = tl.load(x_ptr + r64[:, None, None] * stride_xm + offs[None, :, :], mask=mask2[:, :, None],
                other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=2)
    sf = _round_e4m3(tl.minimum(tl.math.div_rn(amax * glob, 6.0), 448.0))
    out_scale = tl.where(sf > 0, tl.math.div_rn(tl.zeros_like(sf) + glob, tl.where(sf > 0, sf, 1.0)), 0.0)
    code = _e2m1_code(x * out_scale[:, :, None]).reshape(BR, BG, 8, 2)
    even, odd = tl.split(code)
    packed = even | (odd << 4)
    offs_q = grp[:, None] * 8 + tl.arange(0, 8)[None, :]
    tl.store(q_ptr + r64[:, None, None] * stride_qm + offs_q[None, :, :], packed, mask=mask2[:, :, None])
    sf_bits = sf.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    tl.store(sf_ptr + r64[:, None] * stride_sm + grp[None, :], sf_bits, mask=mask2)


def stage_activation(x: torch.Tensor, input_scale: torch.Tensor | float):
    """Same contract as `dsv4.formats.stage_activation`: [..., K] -> (x_fp4 uint8 [..., K/2],
    x_sf float8_e4m3fn [..., K/16], global = 1/input_scale fp32 [])."""
    K = x.shape[-1]
    if K % 16:
        raise ValueError(f"stage_activation: K={K} is not a multiple of the NVFP4 block (16)")
    input_scale = torch.as_tensor(input_scale, dtype=torch.float32, device=x.device).reshape(1)
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, G = x2.shape[0], K // 16
    q = torch.empty(M, K // 2, dtype=torch.uint8, device=x.device)
    sf = torch.empty(M, G, dtype=torch.uint8, device=x.device)
    glob = torch.empty((), dtype=torch.float32, device=x.device)
    BG = min(32, triton.next_power_of_2(G))
    BR = max(1, 256 // BG // 2)
    _stage_kernel[(max(1, triton.cdiv(M, BR)), triton.cdiv(G, BG))](
        x2, q, sf, input_scale, glob, M, G, x2.stride(0), q.stride(0), sf.stride(0), BR=BR, BG=BG, num_warps=4)
    lead = x.shape[:-1]
    return q.reshape(*lead, K // 2), sf.view(torch.float8_e4m3fn).reshape(*lead, G), glob


def linear_w4a4(x: torch.Tensor, w: QWeight, *, fallback=None, config: gemm.Config | None = None,
                scratch: gemm.Scratch | None = None):
    """Same contract as `ref.linear_w4a4`."""
    if w.fmt != "nvfp4" or w.input_scale is None:
        raise ValueError("W4A4 emulation needs an NVFP4 weight with an input_scale")
    if w.leading:
        raise ValueError(f"linear_w4a4 takes one weight, got stacked leading dims {w.leading}")
    K, N = w.in_features, w.out_features
    M = x.numel() // max(1, x.shape[-1])
    cfg = None
    if gemm.supported(x, w) and K % 32 == 0:
        cfg = config or gemm.pick_config(M, N, K, "nvfp4", x.device, a_fp4=True)
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
