"""QLinear: a linear layer whose weight stays in its stored format and computes through the `Ops` table.

Buffers are named after the checkpoint leaves, so `state_dict()` keys read like canonical keys:

| fmt   | buffers (L = leading dims of a stacked layer, N = out, K = in)                                    |
|-------|-----------------------------------------------------------------------------------------------------|
| dense | weight [*L, N, K] compute dtype                                                                     |
| fp8   | weight [*L, N, K] float8_e4m3fn, scale [*L, ceil(N/128), ceil(K/128)] float8_e8m0fnu or float32     |
| mxfp4 | weight [*L, N, K/2] uint8, scale [*L, N, K/32] float8_e8m0fnu                                       |
| nvfp4 | weight [*L, N, K/2] uint8, weight_scale [*L, N, K/16] float8_e4m3fn, weight_scale_2 [*L] float32,   |
|       | input_scale [*L] float32 (only when the checkpoint has one)                                         |

Every leading index keeps its own scales: stacked w1/w3 shards never share a weight_scale_2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..formats import FP8_BLOCK, MXFP4_BLOCK, NVFP4_BLOCK, UE8M0_DTYPE, QWeight, why_untileable
from ..kernels import Ops
from ..parallel import Communicator, Shard


@dataclass(frozen=True)
class LinearFormat:
    """How one linear layer is stored; the loader derives it from the checkpoint's tensors."""

    fmt: str = "dense"                        # dense | fp8 | mxfp4 | nvfp4
    scale_dtype: torch.dtype = UE8M0_DTYPE    # fp8 block scales: float8_e8m0fnu (releases) or float32 (-Base)
    input_scale: bool = False                 # nvfp4: the checkpoint carries a static activation scale

    def buffers(self, leading: tuple[int, ...], n: int, k: int, dtype: torch.dtype) -> dict:
        """Buffer name -> (shape, dtype) of this format for a [*leading, n, k] logical weight."""
        L = tuple(leading)
        if self.fmt == "dense":
            return {"weight": ((*L, n, k), dtype)}
        if self.fmt == "fp8":
            tiles = (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK))
            return {"weight": ((*L, n, k), torch.float8_e4m3fn), "scale": ((*L, *tiles), self.scale_dtype)}
        if self.fmt == "mxfp4":
            return {"weight": ((*L, n, k // 2), torch.uint8), "scale": ((*L, n, k // MXFP4_BLOCK), UE8M0_DTYPE)}
        if self.fmt == "nvfp4":
            out = {"weight": ((*L, n, k // 2), torch.uint8),
                   "weight_scale": ((*L, n, k // NVFP4_BLOCK), torch.float8_e4m3fn),
                   "weight_scale_2": (L, torch.float32)}
            if self.input_scale:
                out["input_scale"] = (L, torch.float32)
            return out
        raise ValueError(f"unknown linear format {self.fmt!r}")


DENSE = LinearFormat()


class Builder:
    """What every module of one model is built with: linear formats by module path, compute dtype, ops, and on
    several ranks this rank's `Shard` of the model and the `Communicator` of its tensor-parallel group (None on one
    rank, and comm None wherever tp = 1: no collective runs).

    `sub("attn")` is the view a child module gets, so each module names only its own children; paths absent
    from `formats` are dense.
    """

    def __init__(self, formats: dict[str, LinearFormat] | None, dtype: torch.dtype, ops: Ops, prefix: str = "",
                 shard: Shard | None = None, comm: Communicator | None = None):
        self.formats, self.dtype, self.ops, self.prefix = formats or {}, dtype, ops, prefix
        self.shard, self.comm = shard, comm

    def sub(self, name: str) -> "Builder":
        return Builder(self.formats, self.dtype, self.ops, f"{self.prefix}{name}.", self.shard, self.comm)

    def format(self, name: str) -> LinearFormat:
        return self.formats.get(self.prefix + name, DENSE)

    def linear(self, name: str, in_features: int, out_features: int, leading: tuple[int, ...] = ()) -> "QLinear":
        return QLinear(in_features, out_features, self.format(name), self.dtype, self.ops, leading)


class QLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, fmt: LinearFormat, dtype: torch.dtype, ops: Ops,
                 leading: tuple[int, ...] = ()):
        super().__init__()
        self.in_features, self.out_features, self.leading = in_features, out_features, tuple(leading)
        self.format, self.ops = fmt, ops
        self.tiled = False   # buffers hold tile-major bytes (`tile_`): set only by the device placement
        for name, (shape, dt) in fmt.buffers(self.leading, out_features, in_features, dtype).items():
            self.register_buffer(name, torch.empty(shape, dtype=dt))

    def qweight(self) -> QWeight:
        block_scale = self.weight_scale if self.format.fmt == "nvfp4" else getattr(self, "scale", None)
        return QWeight(self.format.fmt, self.weight, block_scale, getattr(self, "weight_scale_2", None),
                       getattr(self, "input_scale", None), tiled=self.tiled)

    def piece(self, *index: int) -> QWeight:
        """The unstacked QWeight at one leading index (views, no copy)."""
        return self.qweight().index(*index)

    def tile_(self) -> bool:
        """Store the weight bytes (and FP4 block scales) tile-major for the GPU kernels (`formats.tiling`), in
        place, if the format and shape allow; returns whether they are. The buffers then no longer hold
        checkpoint order: only the device placement calls this."""
        if not self.tiled and not why_untileable(self.format.fmt, self.out_features, self.weight.shape[-1]):
            self.qweight().tile(in_place=True)   # rewrites this layer's own buffers
            self.tiled = True
        return self.tiled

    @property
    def w4a4(self) -> bool:
        """Whether this layer's products run the W4A4 emulation (its Ops table's choice, `kernels.emulation`)."""
        return self.ops.emulates(self.qweight())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.qweight())

    def logical_numel(self) -> int:
        return math.prod((*self.leading, self.out_features, self.in_features))

    def extra_repr(self) -> str:
        lead = f"leading={self.leading}, " if self.leading else ""
        return f"{lead}in={self.in_features}, out={self.out_features}, fmt={self.format.fmt}"


def grouped_linear(x: torch.Tensor, layer: QLinear, groups: int) -> torch.Tensor:
    """Block-diagonal projection (wo_a): x [..., g, c] with W [g*r, c] viewed as [g, r, c] -> [..., g, r].

    Runs `Ops.grouped_linear` (one bmm over the groups in the reference, as transformers' DeepseekV4GroupedLinear
    does; one GEMV launch over all groups at decode on GPU).
    """
    return layer.ops.grouped_linear(x, layer.qweight(), groups)
