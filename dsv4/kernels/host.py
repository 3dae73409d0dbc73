"""Host-side helpers every kernel launcher shares: interpreter detection, the device as the plans see it, the
state an `Ops` table keeps between calls (`Scratch`), the stored scales as the kernels read them, and the strides
of stacked (MoE) weights."""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from ..formats import QWeight
from .policy import Device


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


def readable(w: QWeight, device: torch.device) -> bool:
    """Whether the kernels can address this weight's tensors: on `device`, rows of unit stride, and the scales its
    format needs."""
    if w.weight.device != device or w.weight.stride(-1) != 1:
        return False
    if w.fmt != "dense" and (w.scale is None or w.scale.stride(-1) != 1):
        return False
    return w.fmt != "nvfp4" or w.scale_2 is not None


def device_info(device: torch.device) -> Device:
    """The device as `policy` plans for it."""
    return Device(sms=num_sms(device), gpu=device.type == "cuda" and not interpreting(), interpreted=interpreting())


class Scratch:
    """What one `Ops` table keeps between calls: split-K semaphores (zeroed once per device, re-armed by the kernels
    themselves, so a split-K product is one launch) and a memo of everything derived from a call's shape alone
    (plans, launch geometries, the resident CTAs of compiled kernels). One stream at a time."""

    def __init__(self):
        self._counters: dict[torch.device, torch.Tensor] = {}
        self._memo: dict = {}

    def cached(self, key, compute):
        """compute(), once per key."""
        value = self._memo.get(key)
        if value is None:
            value = self._memo[key] = compute()
        return value

    def counters(self, device: torch.device, n: int) -> torch.Tensor:
        buf = self._counters.get(device)
        if buf is None or buf.numel() < n:
            buf = torch.zeros(max(n, 8192), dtype=torch.int32, device=device)
            self._counters[device] = buf
        return buf


def cached(scratch: Scratch | None, key, compute):
    """`scratch.cached(key, compute)`, or compute() without a scratch."""
    return compute() if scratch is None else scratch.cached(key, compute)


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


class Operand(NamedTuple):
    """A (possibly stacked) weight as the kernels read it: bytes, block scales, NVFP4 scale_2, and their strides
    between experts (e), gate and up (g) and rows (n); a tensor a format lacks is the bytes again, strides 0."""
    w: object
    s: object
    s2: object
    stride_we: int
    stride_wg: int
    stride_wn: int
    stride_se: int
    stride_sg: int
    stride_sn: int
    stride_s2e: int
    stride_s2g: int


def operand(w: QWeight, gated: bool) -> Operand:
    """The kernels' `Operand` of a (possibly stacked) weight; `gated`: a (2,)-stacked shared gate / up."""
    wt = w.weight.view(torch.uint8) if w.fmt != "dense" else w.weight
    scale, _, s2 = scale_views(w)
    (we, wg), (se, sg), (s2e, s2g) = (lead_strides(t, w.leading, gated) for t in (wt, scale, s2))
    return Operand(wt, wt if scale is None else scale, wt if s2 is None else s2, we, wg, wt.stride(-2), se, sg,
                   0 if scale is None else scale.stride(-2), s2e, s2g)
