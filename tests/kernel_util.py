"""Shared pieces of the kernel tests: strict Triton ops (a reference fallback fails the test) and the error metric."""

from functools import partial

import torch

from dsv4.kernels import Ops, gemm, moe, w4a4


def refuse(*args, **kwargs):
    raise AssertionError("a supported call fell back to the reference")


def strict_ops() -> Ops:
    """The Triton ops with every reference fallback replaced by a failure: a kernel test must run the kernel."""
    scratch = gemm.Scratch()
    linear = partial(gemm.linear, fallback=refuse, scratch=scratch)
    return Ops("strict", linear, partial(w4a4.linear_w4a4, fallback=refuse, scratch=scratch),
               partial(moe.mlp, fallback=refuse, linear=linear, scratch=scratch), partial(moe.route, fallback=refuse),
               partial(moe.moe, fallback=refuse, scratch=scratch))


def rel_err(y: torch.Tensor, r: torch.Tensor) -> float:
    return ((y.double() - r.double()).norm() / r.double().norm()).item()
