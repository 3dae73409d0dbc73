"""QWeight: a linear layer's weight in its stored format, plus the scales that format needs.

Layouts (L = optional leading dims: () for one linear, (E,) for stacked w2 experts, (E, 2) for stacked
w1/w3 experts where index 0 is w1 = gate and 1 is w3 = up, (2,) for the shared expert's w1/w3):

| fmt     | weight                        | scale                                   | scale_2 / input_scale |
|---------|-------------------------------|-----------------------------------------|-----------------------|
| "dense" | [*L, N, K] compute dtype      | -                                       | -                     |
| "fp8"   | [*L, N, K] float8_e4m3fn      | [*L, ceil(N/128), ceil(K/128)] e8m0|f32 | -                     |
| "mxfp4" | [*L, N, K/2] uint8 (2 codes)  | [*L, N, K/32] float8_e8m0fnu            | -                     |
| "nvfp4" | [*L, N, K/2] uint8 (2 codes)  | [*L, N, K/16] float8_e4m3fn             | [*L] float32 each     |

Packed FP4 bytes hold element 2j in the low nibble. Each leading index keeps its own scales: two shards
stacked together never share one weight_scale_2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .fp8 import FP8_BLOCK, dequantize_fp8_block
from .mxfp4 import MXFP4_BLOCK, dequantize_mxfp4
from .nvfp4 import NVFP4_BLOCK, dequantize_nvfp4
from .scales import UE8M0_DTYPE

FORMATS = ("dense", "fp8", "mxfp4", "nvfp4")


@dataclass(frozen=True)
class QWeight:
    fmt: str
    weight: torch.Tensor
    scale: torch.Tensor | None = None
    scale_2: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown weight format {self.fmt!r}; expected one of {FORMATS}")

    @property
    def out_features(self) -> int:
        return self.weight.shape[-2]

    @property
    def in_features(self) -> int:
        packed = self.fmt in ("mxfp4", "nvfp4")
        return self.weight.shape[-1] * (2 if packed else 1)

    @property
    def leading(self) -> tuple[int, ...]:
        return tuple(self.weight.shape[:-2])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Exact dequantization to [*L, N, K] (exact in fp32; rounded once if `dtype` is narrower)."""
        if self.fmt == "dense":
            return self.weight.to(dtype)
        if self.fmt == "fp8":
            return dequantize_fp8_block(self.weight, self.scale, dtype, FP8_BLOCK)
        if self.fmt == "mxfp4":
            return dequantize_mxfp4(self.weight, self.scale, dtype)
        return dequantize_nvfp4(self.weight, self.scale, self.scale_2, dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scale, self.scale_2, self.input_scale)
                   if t is not None)

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes every tensor must have for this format, from the weight's logical N and K."""
        L, n, k = self.leading, self.out_features, self.in_features
        if self.fmt == "fp8":
            return {"scale": (*L, -(-n // FP8_BLOCK), -(-k // FP8_BLOCK))}
        if self.fmt == "mxfp4":
            return {"scale": (*L, n, k // MXFP4_BLOCK)}
        if self.fmt == "nvfp4":
            return {"scale": (*L, n, k // NVFP4_BLOCK), "scale_2": L, "input_scale": L}
        return {}

    def validate(self, what: str = "weight") -> None:
        """Raise naming `what` if dtypes or shapes disagree with the format's layout."""
        w = self.weight
        want_dtype = {"fp8": torch.float8_e4m3fn, "mxfp4": torch.uint8, "nvfp4": torch.uint8}.get(self.fmt)
        if want_dtype is not None and w.dtype != want_dtype:
            raise ValueError(f"{what}: {self.fmt} weight must be {want_dtype}, got {w.dtype}")
        scale_dtypes = {"fp8": (UE8M0_DTYPE, torch.float32), "mxfp4": (UE8M0_DTYPE,),
                        "nvfp4": (torch.float8_e4m3fn,)}.get(self.fmt, ())
        if scale_dtypes and (self.scale is None or self.scale.dtype not in scale_dtypes):
            got = None if self.scale is None else self.scale.dtype
            raise ValueError(f"{what}: {self.fmt} scale must be one of {scale_dtypes}, got {got}")
        for name, shape in self.expected_shapes().items():
            t = getattr(self, name)
            if name == "input_scale" and t is None:
                continue  # W4A16 checkpoints ship no input_scale; only the W4A4 emulation needs it
            if t is None or tuple(t.shape) != tuple(shape):
                raise ValueError(f"{what}: {self.fmt} {name} must have shape {tuple(shape)}, "
                                 f"got {None if t is None else tuple(t.shape)}")
