"""Shared pieces of the kernel tests: strict Triton ops (a reference fallback fails the test) and the error metric."""

import torch

from dsv4.kernels import Ops, refuse_fallback as refuse  # noqa: F401  (for tests that call a kernel directly)


def strict_ops() -> Ops:
    """The Triton ops with every reference fallback replaced by a failure: a kernel test must run the kernel."""
    return Ops.triton(strict=True)


def rel_err(y: torch.Tensor, r: torch.Tensor) -> float:
    return ((y.double() - r.double()).norm() / r.double().norm()).item()
