"""NVFP4: E2M1 elements, an E4M3 scale per 16 elements along K, and an FP32 per-tensor scale.

Weights (ModelOpt layout, bit-identical to nvidia-modelopt 0.47 `NVFP4QTensor.quantize`):
    weight_scale_2 = amax(W) / (6 * 448)                               fp32 scalar
    weight_scale   = e4m3(clamp(blockamax / (6 * weight_scale_2), 2^-9, 448)), an all-zero block stores 1.0
    weight         = pack(e2m1(W / (weight_scale * weight_scale_2)))   uint8 [N, K/2]
    W             ~= e2m1 * weight_scale * weight_scale_2
Activations (W4A4, FlashInfer/TRT-LLM `cvt_warp_fp16_to_fp4` with IEEE division in place of rcp.approx):
    global = 1 / input_scale;  sf = e4m3_satfinite(global * (blockamax * fp32(1/6)))
    x_fp4  = e2m1_rne_sat(x * (1 / (sf * (1 / global))))   (0 where sf == 0)
GEMM: D = alpha * sum_k (e2m1(a) * sf_a)(e2m1(w) * sf_w) with alpha = input_scale * weight_scale_2, applied
once to the fp32 accumulator, never folded into the E4M3 scales (that would round alpha through E4M3).
"""

from __future__ import annotations

import torch

from ._checks import positive_scalar, require_dtype, require_finite, require_float, require_k_multiple
from .e2m1 import E2M1_MAX, dequantize_e2m1_blocks, encode_e2m1, pack_e2m1
from .scales import E4M3_MAX, to_e4m3_saturating

NVFP4_BLOCK = 16
_E4M3 = (torch.float8_e4m3fn,)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK)


def _check_quant_input(x: torch.Tensor, what: str) -> torch.Tensor:
    require_float(x, what)
    require_k_multiple(x, NVFP4_BLOCK, what)
    require_finite(x, what)
    return x.float()


def nvfp4_global_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """`weight_scale_2` (or a static `input_scale`) for a tensor whose absolute maximum is `amax`."""
    amax = torch.as_tensor(amax).float()
    if not bool((torch.isfinite(amax) & (amax > 0)).all()):
        raise ValueError(f"nvfp4_global_scale: amax must be positive and finite, got {amax.flatten()[:4].tolist()}")
    scale = amax / (E2M1_MAX * E4M3_MAX)
    if not bool((scale >= torch.finfo(torch.float32).tiny).all()):
        raise ValueError(f"nvfp4_global_scale: amax {amax.flatten()[:4].tolist()} is too small: amax / 2688 "
                         "falls below the smallest normal float32 and the global scale would lose its precision")
    return scale


def quantize_nvfp4(
    w: torch.Tensor, weight_scale_2: torch.Tensor | float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[..., N, K] float -> (weight uint8 [..., N, K/2], weight_scale e4m3 [..., N, K/16], weight_scale_2 fp32 []).

    Pass `weight_scale_2` to share one global scale between tensors (ModelOpt's w1/w3 rule); a block that
    then needs a scale above 448 saturates (scale 448, elements ±6), exactly as ModelOpt does.
    """
    w = _check_quant_input(w, "quantize_nvfp4")
    if weight_scale_2 is None:
        if not bool(w.abs().amax() > 0):
            raise ValueError("quantize_nvfp4: an all-zero tensor has no NVFP4 global scale; pass weight_scale_2")
        weight_scale_2 = nvfp4_global_scale(w.abs().amax())
    weight_scale_2 = positive_scalar(weight_scale_2, w.device, "quantize_nvfp4: weight_scale_2")
    per_block = _blocks(w).abs().amax(-1) / (E2M1_MAX * weight_scale_2)
    per_block = torch.where(per_block == 0, torch.ones_like(per_block), per_block)
    weight_scale = per_block.clamp(min=2.0 ** -9, max=E4M3_MAX).to(torch.float8_e4m3fn)
    scaled = _blocks(w) / (weight_scale.float() * weight_scale_2).unsqueeze(-1)
    return pack_e2m1(encode_e2m1(scaled.reshape(w.shape))), weight_scale, weight_scale_2


def dequantize_nvfp4(
    weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Packed [*L, N, K/2] + e4m3 [*L, N, K/16] + fp32 [] or [*L] -> [*L, N, K].

    Computed as (e2m1 * weight_scale) * weight_scale_2: the first product is exact, so the fp32 result is
    the correctly rounded value of the three-way product.
    """
    require_dtype(weight_scale, _E4M3, "dequantize_nvfp4: weight_scale")
    ws2 = torch.as_tensor(weight_scale_2).float()
    leading = tuple(weight.shape[:-2])
    if tuple(ws2.shape) not in ((), leading):
        raise ValueError(f"dequantize_nvfp4: weight_scale_2 has shape {tuple(ws2.shape)}; weight "
                         f"{tuple(weight.shape)} needs () or {leading}")
    if not bool((torch.isfinite(ws2) & (ws2 > 0)).all()):
        raise ValueError("dequantize_nvfp4: weight_scale_2 must be positive and finite")
    w = dequantize_e2m1_blocks(weight, weight_scale, NVFP4_BLOCK)
    return (w * ws2.reshape(*ws2.shape, 1, 1).to(w.device)).to(dtype)


def stage_activation(
    x: torch.Tensor, input_scale: torch.Tensor | float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize activations for a W4A4 GEMM: [..., K] -> (x_fp4 uint8 [..., K/2], x_sf e4m3 [..., K/16], global).

    `global = 1 / input_scale` is returned as the third value; the GEMM's alpha is `input_scale * weight_scale_2`.
    Values past the calibrated range saturate (block scale at 448, elements at ±6). A block whose scale
    underflows E4M3 to 0 stores zeros (FlashInfer's `SFValue != 0` guard).
    """
    xf = _check_quant_input(x, "stage_activation")
    global_scale = 1.0 / positive_scalar(input_scale, x.device, "stage_activation: input_scale")
    one_sixth = torch.tensor(1.0 / E2M1_MAX, dtype=torch.float32, device=x.device)
    xb = _blocks(xf)
    sf = to_e4m3_saturating(global_scale * (xb.abs().amax(-1) * one_sixth))
    sf32 = sf.float()
    out_scale = torch.where(sf32 > 0, 1.0 / (sf32 * (1.0 / global_scale)), torch.zeros_like(sf32))
    codes = encode_e2m1((xb * out_scale.unsqueeze(-1)).reshape(x.shape))
    return pack_e2m1(codes), sf, global_scale


def w4a4_matmul_ref(
    x_fp4: torch.Tensor, x_sf: torch.Tensor, w_fp4: torch.Tensor, w_sf: torch.Tensor,
    alpha: torch.Tensor | float, out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Blackwell NVFP4 GEMM semantics: [..., M, K/2] x [N, K/2] -> alpha * (A_deq @ W_deq^T), fp32 accumulate."""
    require_dtype(x_sf, _E4M3, "w4a4_matmul_ref: x_sf")
    require_dtype(w_sf, _E4M3, "w4a4_matmul_ref: w_sf")
    if w_fp4.dim() != 2 or x_fp4.dim() < 1 or x_fp4.shape[-1] != w_fp4.shape[-1]:
        raise ValueError(f"w4a4_matmul_ref: activation {tuple(x_fp4.shape)} and weight {tuple(w_fp4.shape)} "
                         "must be [..., K/2] and [N, K/2] with the same K")
    a = dequantize_e2m1_blocks(x_fp4, x_sf, NVFP4_BLOCK)
    b = dequantize_e2m1_blocks(w_fp4, w_sf, NVFP4_BLOCK)
    alpha = positive_scalar(alpha, a.device, "w4a4_matmul_ref: alpha")
    return (alpha * (a @ b.T)).to(out_dtype)
