"""Host-side helpers every kernel launcher shares: interpreter detection, the SM count, programmatic dependent
launch, the stored scales as the kernels read them, and the strides of stacked (MoE) weights."""

from __future__ import annotations

import os

import torch

from ..formats import QWeight


def interpreting() -> bool:
    """Whether Triton runs its CPU interpreter (TRITON_INTERPRET=1: the tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 4 stands in elsewhere (the interpreter)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def has_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch (`griddepcontrol`): a CUDA GPU of sm_90 or later, not interpreted."""
    return device.type == "cuda" and not interpreting() and torch.cuda.get_device_capability(device)[0] >= 9


def scale_views(w: QWeight):
    """(scale, scale is fp32, NVFP4 scale_2 or None): stored scale tensors as the kernels read them, UE8M0 and
    E4M3 bytes as uint8, fp32 as is (None for unscaled weights)."""
    scale = w.scale
    scale_f32 = scale is not None and scale.dtype == torch.float32
    if scale is not None and not scale_f32:
        scale = scale.view(torch.uint8)
    return scale, scale_f32, (w.scale_2 if w.fmt == "nvfp4" else None)


def lead_strides(t: torch.Tensor | None, lead: tuple, gated: bool) -> tuple[int, int]:
    """(expert stride, gate/up stride) of a tensor stacked with leading dims `lead`: (E, 2) for MoE gate/up,
    (E,) for MoE down, (2,) for the shared gate/up (gated), () otherwise; 0 where a dim is absent (or `t` is
    None or has fewer dims, e.g. a per-tensor scale_2)."""
    if t is None or t.dim() < len(lead) or not lead:
        return 0, 0
    st = t.stride()
    if len(lead) == 2:
        return st[0], st[1]
    return (0, st[0]) if gated else (st[0], 0)
