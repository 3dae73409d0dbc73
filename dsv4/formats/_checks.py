"""Input checks shared by the format functions: each raises naming the function and what is wrong."""

from __future__ import annotations

import torch


def require_float(x: torch.Tensor, what: str) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{what}: expected a floating-point tensor, got {got}")


def require_finite(x: torch.Tensor, what: str) -> None:
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{what}: input has NaN or Inf (refusing to quantize non-finite values)")


def require_dtype(x: torch.Tensor, dtypes: tuple[torch.dtype, ...], what: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype not in dtypes:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{what}: expected dtype in {dtypes}, got {got}")


def require_k_multiple(x: torch.Tensor, block: int, what: str) -> None:
    if x.dim() < 1 or x.shape[-1] % block:
        raise ValueError(f"{what}: K={x.shape[-1] if x.dim() else None} (last dim of {tuple(x.shape)}) "
                         f"is not a multiple of the block size {block}")


def positive_scalar(value: torch.Tensor | float, device: torch.device, what: str) -> torch.Tensor:
    """A one-element positive finite scale as a float32 0-d tensor on `device`."""
    t = torch.as_tensor(value, device=device)
    if t.numel() != 1:
        raise ValueError(f"{what}: expected one scalar, got shape {tuple(t.shape)}")
    t = t.float().reshape(())
    if not bool(torch.isfinite(t)) or not bool(t > 0):
        raise ValueError(f"{what}: must be positive and finite, got {float(t)}")
    return t
