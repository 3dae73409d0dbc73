"""Scale encodings: UE8M0 (a power of two, 2^(byte-127)) and E4M3 block scales."""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
UE8M0_DTYPE = torch.float8_e8m0fnu


def ue8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 scales stored as float8_e8m0fnu or raw uint8 bytes -> float32 powers of two."""
    if scale.dtype == torch.uint8:
        scale = scale.view(UE8M0_DTYPE)
    if scale.dtype != UE8M0_DTYPE:
        raise TypeError(f"UE8M0 scale must be float8_e8m0fnu or uint8, got {scale.dtype}")
    return scale.float()


def float_to_ue8m0(pow2: torch.Tensor) -> torch.Tensor:
    """Exact powers of two in [2^-127, 2^127] (float32) -> float8_e8m0fnu. Refuses anything else."""
    pow2 = pow2.float()
    mant, _ = torch.frexp(pow2)
    if not bool(((mant == 0.5) & torch.isfinite(pow2)).all()):
        raise ValueError("UE8M0 can only hold finite positive powers of two")
    return pow2.to(UE8M0_DTYPE)


def pow2_ceil(x: torch.Tensor, floor: float = 2.0 ** -126) -> torch.Tensor:
    """Smallest power of two >= max(x, floor), as float32 (DeepSeek's UE8M0 scale rule)."""
    mant, exp = torch.frexp(x.float().clamp(min=floor))  # x = mant * 2^exp, mant in [0.5, 1)
    exp = torch.where(mant == 0.5, exp - 1, exp)
    return torch.ldexp(torch.ones_like(mant), exp)


def to_e4m3_saturating(x: torch.Tensor) -> torch.Tensor:
    """float -> float8_e4m3fn with round-to-nearest-even, clamping to ±448 first (torch would give NaN)."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
