"""NVFP4: E2M1 elements, an E4M3 scale per 16 elements along K, and an FP32 per-tensor scale.

Weights (ModelOpt layout, bit-identical to nvidia-modelopt 0.47 `NVFP4QTensor.quantize`):
    weight_scale_2 = amax(W) / (6 * 448)                               fp32 scalar
    weight_scale   = e4m3(clamp(blockamax / (6 * weight_scale_2), 2^-9, 448)), an all-zero block stores 1.0
    weight         = pack(e2m1(W / (weight_scale * weight_scale_2)))   uint8 [N, K/2]
    W             ~= e2m1 * weight_scale * weight_scale_2
Activations (W4A4, what Blackwell kernels do at run time):
    global = 1 / input_scale;  sf = e4m3(blockamax * global / 6) saturating at 448
    x_fp4  = e2m1_rne_sat(x * global / sf)
GEMM: D = alpha * sum_k (e2m1(a) * sf_a)(e2m1(w) * sf_w) with alpha = input_scale * weight_scale_2, applied
once to the fp32 accumulator, never folded into the E4M3 scales (that would round alpha through E4M3).
"""

from __future__ import annotations

import torch

from .e2m1 import E2M1_MAX, dequantize_e2m1_blocks, encode_e2m1, pack_e2m1
from .scales import E4M3_MAX, to_e4m3_saturating

NVFP4_BLOCK = 16


def _check_k(x: torch.Tensor, what: str) -> None:
    if x.shape[-1] % NVFP4_BLOCK:
        raise ValueError(f"{what}: K={x.shape[-1]} is not a multiple of the NVFP4 block ({NVFP4_BLOCK})")


def _blocks(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK)


def nvfp4_global_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """`weight_scale_2` (or a static `input_scale`) for a tensor whose absolute maximum is `amax`."""
    return torch.as_tensor(amax).float() / (E2M1_MAX * E4M3_MAX)


def quantize_nvfp4(
    w: torch.Tensor, weight_scale_2: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[..., N, K] float -> (weight uint8 [..., N, K/2], weight_scale e4m3 [..., N, K/16], weight_scale_2 fp32 [])."""
    _check_k(w, "quantize_nvfp4")
    w = w.float()
    if not bool(torch.isfinite(w).all()):
        raise ValueError("quantize_nvfp4: input has NaN or Inf")
    if weight_scale_2 is None:
        weight_scale_2 = nvfp4_global_scale(w.abs().amax())
    weight_scale_2 = torch.as_tensor(weight_scale_2, dtype=torch.float32, device=w.device).reshape(())
    blockamax = _blocks(w).abs().amax(-1)
    per_block = blockamax / (E2M1_MAX * weight_scale_2)
    per_block = torch.where(per_block == 0, torch.ones_like(per_block), per_block)
    weight_scale = per_block.clamp(min=2.0 ** -9, max=E4M3_MAX).to(torch.float8_e4m3fn)
    scaled = _blocks(w) / (weight_scale.float() * weight_scale_2).unsqueeze(-1)
    codes = encode_e2m1(scaled.reshape(w.shape))
    return pack_e2m1(codes), weight_scale, weight_scale_2


def dequantize_nvfp4(
    weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Packed [..., N, K/2] + e4m3 [..., N, K/16] + fp32 scalar (or one per leading index) -> [..., N, K]."""
    if weight_scale.dtype != torch.float8_e4m3fn:
        raise TypeError(f"NVFP4 weight_scale must be float8_e4m3fn, got {weight_scale.dtype}")
    w = dequantize_e2m1_blocks(weight, weight_scale, NVFP4_BLOCK)
    ws2 = weight_scale_2.float()
    return (w * ws2.reshape(*ws2.shape, *([1] * (w.dim() - ws2.dim())))).to(dtype)


def stage_activation(
    x: torch.Tensor, input_scale: torch.Tensor | float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize activations for a W4A4 GEMM: [..., K] -> (x_fp4 uint8 [..., K/2], x_sf e4m3 [..., K/16], global).

    `global = 1 / input_scale` is returned as the third value; the GEMM's alpha is `input_scale * weight_scale_2`.
    Values past the calibrated range saturate (block scale at 448, elements at ±6).
    """
    _check_k(x, "stage_activation")
    input_scale = torch.as_tensor(input_scale, dtype=torch.float32, device=x.device).reshape(())
    global_scale = 1.0 / input_scale
    xb = _blocks(x.float())
    sf = to_e4m3_saturating(xb.abs().amax(-1) * global_scale / E2M1_MAX)
    sf32 = sf.float()
    out_scale = torch.where(sf32 > 0, global_scale / sf32, torch.zeros_like(sf32))
    codes = encode_e2m1((xb * out_scale.unsqueeze(-1)).reshape(x.shape))
    return pack_e2m1(codes), sf, global_scale


def w4a4_matmul_ref(
    x_fp4: torch.Tensor, x_sf: torch.Tensor, w_fp4: torch.Tensor, w_sf: torch.Tensor,
    alpha: torch.Tensor | float, out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Blackwell NVFP4 GEMM semantics: [M, K/2] x [N, K/2] -> alpha * (A_deq @ W_deq^T) in fp32, cast at the end."""
    a = dequantize_e2m1_blocks(x_fp4, x_sf, NVFP4_BLOCK)
    b = dequantize_e2m1_blocks(w_fp4, w_sf, NVFP4_BLOCK)
    alpha = torch.as_tensor(alpha, dtype=torch.float32, device=a.device)
    return (alpha * (a @ b.transpose(-1, -2))).to(out_dtype)
