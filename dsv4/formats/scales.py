"""Scale encodings: UE8M0 (a power of two, 2^(byte-127); byte 255 is NaN) and saturating E4M3 block scales."""

from __future__ import annotations

import torch

from ._checks import require_dtype, require_float

E4M3_MAX = 448.0
UE8M0_DTYPE = torch.float8_e8m0fnu


def ue8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 scales stored as float8_e8m0fnu or raw uint8 bytes -> float32 powers of two."""
    require_dtype(scale, (UE8M0_DTYPE, torch.uint8), "ue8m0_to_float")
    raw = scale.view(torch.uint8)
    if bool((raw == 255).any()):
        raise ValueError("ue8m0_to_float: scale byte 0xFF is UE8M0's NaN")
    return raw.view(UE8M0_DTYPE).float()


def float_to_ue8m0(pow2: torch.Tensor) -> torch.Tensor:
    """Exact powers of two in [2^-127, 2^127] -> float8_e8m0fnu. Refuses anything else (no rounding here)."""
    require_float(pow2, "float_to_ue8m0")
    pow2 = pow2.float()
    mant, exp = torch.frexp(pow2)  # pow2 = 0.5 * 2^exp exactly when it is a power of two
    ok = (mant == 0.5) & torch.isfinite(pow2) & (exp >= -126) & (exp <= 128)
    if not bool(ok.all()):
        raise ValueError("float_to_ue8m0: UE8M0 holds only powers of two from 2^-127 to 2^127, got "
                         f"{pow2[~ok].flatten()[:4].tolist()}")
    return pow2.to(UE8M0_DTYPE)


def pow2_ceil(x: torch.Tensor, floor: float = 2.0 ** -126) -> torch.Tensor:
    """Smallest power of two >= max(x, floor), as float32 (DeepSeek's UE8M0 scale rule)."""
    require_float(x, "pow2_ceil")
    mant, exp = torch.frexp(x.float().clamp(min=floor))  # x = mant * 2^exp, mant in [0.5, 1)
    exp = torch.where(mant == 0.5, exp - 1, exp)
    return torch.ldexp(torch.ones_like(mant), exp)


def to_e4m3_saturating(x: torch.Tensor) -> torch.Tensor:
    """float -> float8_e4m3fn, round-to-nearest-even, saturating at ±448 like CUDA's satfinite (Inf -> 448)."""
    require_float(x, "to_e4m3_saturating")
    if bool(torch.isnan(x).any()):
        raise ValueError("to_e4m3_saturating: input has NaN")
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
