"""MXFP4 as DeepSeek ships its routed experts: E2M1 elements with one UE8M0 scale (2^(byte-127)) per 32 along K.

Packed bytes are stored as I8 in DeepSeek's safetensors (low nibble = even element, like NVFP4).
"""

from __future__ import annotations

import torch

from ._checks import require_dtype, require_finite, require_float, require_k_multiple
from .e2m1 import E2M1_MAX, as_packed_u8, dequantize_e2m1_blocks, encode_e2m1, pack_e2m1
from .scales import UE8M0_DTYPE, float_to_ue8m0, pow2_ceil, ue8m0_to_float

MXFP4_BLOCK = 32
# E4M3 holds 2^e exactly for e in [-9, 8] (2^-9 is its smallest subnormal), so NVFP4 block scales can
# carry block exponents k_j relative to k_max - 8 over a window of 18 binades.
_E4M3_POW2_MIN, _E4M3_POW2_MAX = -9, 8


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] float -> (weight uint8 [..., N, K/2], scale float8_e8m0fnu [..., N, K/32]).

    scale = 2^ceil(log2(blockamax / 6)) (DeepSeek's rule; an all-zero block gets 2^-127, byte 0), so every
    element fits in ±6 before rounding to nearest even.
    """
    require_float(w, "quantize_mxfp4")
    require_k_multiple(w, MXFP4_BLOCK, "quantize_mxfp4")
    require_finite(w, "quantize_mxfp4")
    w = w.float()
    blocks = w.reshape(*w.shape[:-1], -1, MXFP4_BLOCK)
    scale = pow2_ceil(blocks.abs().amax(-1) / E2M1_MAX, floor=2.0 ** -127)
    codes = encode_e2m1((blocks / scale.unsqueeze(-1)).reshape(w.shape))
    return pack_e2m1(codes), float_to_ue8m0(scale)


def dequantize_mxfp4(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed [..., N, K/2] + UE8M0 (float8_e8m0fnu or raw uint8) [..., N, K/32] -> [..., N, K], exact in fp32."""
    return dequantize_e2m1_blocks(weight, ue8m0_to_float(scale), MXFP4_BLOCK).to(dtype)


def _exponents(weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block exponents k_j (int32 [..., N, K/32]) and which blocks hold a nonzero nibble."""
    require_dtype(scale, (UE8M0_DTYPE, torch.uint8), "mxfp4 scale")
    packed = as_packed_u8(weight)
    if packed.dim() < 2:
        raise ValueError(f"mxfp4: packed weight must be [..., N, K/2], got shape {tuple(packed.shape)}")
    want = (*packed.shape[:-1], packed.shape[-1] * 2 // MXFP4_BLOCK)
    if packed.shape[-1] * 2 % MXFP4_BLOCK or tuple(scale.shape) != want:
        raise ValueError(f"mxfp4: scale shape {tuple(scale.shape)} does not fit packed weight "
                         f"{tuple(packed.shape)} (expected {want})")
    ue8m0_to_float(scale)  # refuses the NaN byte
    exps = scale.view(torch.uint8).to(torch.int32) - 127
    # A block of ±0 nibbles (codes 0 and 8) is zero under any scale, so its exponent constrains nothing.
    nonzero = ((packed & 0x77) != 0).reshape(*want, MXFP4_BLOCK // 2).any(-1)
    return exps, nonzero


def mxfp4_k_max(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Largest block exponent per leading index (int32 [*L]) over blocks holding a nonzero value (0 if none).

    Share it between tensors that need one NVFP4 global scale, e.g. `max(mxfp4_k_max(w1), mxfp4_k_max(w3))`.
    """
    return _k_max(*_exponents(weight, scale))


def _k_max(exps: torch.Tensor, nonzero: torch.Tensor) -> torch.Tensor:
    lowest = torch.iinfo(torch.int32).min
    k_max = torch.where(nonzero, exps, lowest).flatten(-2).amax(-1)
    return torch.where(k_max == lowest, 0, k_max)


def mxfp4_to_nvfp4(
    weight: torch.Tensor, scale: torch.Tensor, k_max: int | torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Re-block MXFP4 [*L, N, K/2] as NVFP4 without changing a single nibble, or refuse.

    With k_j the exponents of the 32-blocks and k_max their maximum per leading index (or a larger one,
    an int or a tensor broadcastable to [*L], shared with a sibling tensor such as w1/w3):
    weight_scale_2 [*L] = 2^(k_max-8) and each 16-block's E4M3 scale = 2^(k_j-k_max+8). The result
    dequantizes to the same fp32 values iff k_max - 17 <= k_j <= k_max for every block holding a nonzero
    value; otherwise this raises instead of rounding.
    """
    exps, nonzero = _exponents(weight, scale)
    leading = tuple(exps.shape[:-2])
    top = _k_max(exps, nonzero)
    if k_max is not None:
        shared = torch.as_tensor(k_max, device=top.device)
        if shared.is_floating_point() or shared.is_complex():
            raise TypeError(f"mxfp4_to_nvfp4: k_max must be an integer exponent, got {shared.dtype}")
        try:
            shared = torch.broadcast_to(shared.to(torch.int32), leading)
        except RuntimeError:
            raise ValueError(f"mxfp4_to_nvfp4: k_max of shape {tuple(shared.shape)} does not broadcast to the "
                             f"leading dims {leading}") from None
        if bool((shared.abs() > 127).any()):
            raise ValueError(f"mxfp4_to_nvfp4: k_max {shared.flatten()[:4].tolist()} is not a UE8M0 exponent")
        top = shared
    rel = exps - (top - _E4M3_POW2_MAX).reshape(*leading, 1, 1)
    lossy = nonzero & ((rel < _E4M3_POW2_MIN) | (rel > _E4M3_POW2_MAX))
    if bool(lossy.any()):
        raise ValueError(f"mxfp4_to_nvfp4: {int(lossy.sum())} of {lossy.numel()} blocks have an exponent above "
                         f"k_max or more than {_E4M3_POW2_MAX - _E4M3_POW2_MIN} binades below it; E4M3 block "
                         "scales cannot represent them exactly (refusing a lossy conversion)")
    rel = rel.clamp(_E4M3_POW2_MIN, _E4M3_POW2_MAX)  # only all-zero blocks are clamped
    weight_scale = torch.exp2(rel.float()).repeat_interleave(2, dim=-1).to(torch.float8_e4m3fn)
    weight_scale_2 = torch.exp2((top - _E4M3_POW2_MAX).double()).float()
    return as_packed_u8(weight).clone(), weight_scale, weight_scale_2
