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
stacked together never share one weight_scale_2. `tiled`: the weight bytes (and FP4 block scales) are stored
tile-major (`formats.tiling`), shapes unchanged, and FP4 words are XOR-coded for the GPU decoders
(`formats.wordcode`); `dequantize` and `untiled` give back plain row-major bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import torch

from .fp8 import FP8_BLOCK, dequantize_fp8_block
from .mxfp4 import MXFP4_BLOCK, dequantize_mxfp4
from .nvfp4 import NVFP4_BLOCK, dequantize_nvfp4
from .scales import UE8M0_DTYPE
from .tiling import TILE_BYTES, TILE_ROWS, scale_chunk, tile_bytes, tile_bytes_, untile_bytes, why_untileable
from .wordcode import code_fp4_

FORMATS = ("dense", "fp8", "mxfp4", "nvfp4")
FP4_FORMATS = ("mxfp4", "nvfp4")   # packed two codes per byte, block scales per 16 / 32
_E4M3 = torch.float8_e4m3fn
_WEIGHT_DTYPES = MappingProxyType({"fp8": (_E4M3,), "mxfp4": (torch.uint8,), "nvfp4": (torch.uint8,)})
_SCALE_DTYPES = MappingProxyType({"fp8": (UE8M0_DTYPE, torch.float32), "mxfp4": (UE8M0_DTYPE,), "nvfp4": (_E4M3,)})
_K_BLOCK = MappingProxyType({"mxfp4": MXFP4_BLOCK, "nvfp4": NVFP4_BLOCK})


@dataclass(frozen=True)
class QWeight:
    """Validated at construction (dtypes and shapes; values are checked when dequantized)."""

    fmt: str
    weight: torch.Tensor
    scale: torch.Tensor | None = None
    scale_2: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None
    tiled: bool = False

    def __post_init__(self) -> None:
        self.validate()

    @property
    def out_features(self) -> int:
        return self.weight.shape[-2]

    @property
    def in_features(self) -> int:
        packed = self.fmt in FP4_FORMATS
        return self.weight.shape[-1] * (2 if packed else 1)

    @property
    def leading(self) -> tuple[int, ...]:
        return tuple(self.weight.shape[:-2])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Exact dequantization to [*L, N, K] (exact in fp32; rounded once if `dtype` is narrower)."""
        if self.tiled:
            return self.untiled().dequantize(dtype)
        if self.fmt == "dense":
            return self.weight.to(dtype)
        if self.fmt == "fp8":
            return dequantize_fp8_block(self.weight, self.scale, dtype, FP8_BLOCK)
        if self.fmt == "mxfp4":
            return dequantize_mxfp4(self.weight, self.scale, dtype)
        return dequantize_nvfp4(self.weight, self.scale, self.scale_2, dtype)

    def tile(self, in_place: bool = False) -> "QWeight":
        """The same weight stored tile-major (`formats.tiling`): new tensors, or (in_place) this weight's own
        tensors rewritten one matrix at a time, so a multi-GB stacked tensor never needs a second copy. Raises
        naming why if it can't be tiled."""
        if self.tiled:
            return self
        why = why_untileable(self.fmt, self.out_features, self.weight.shape[-1])
        if why:
            raise ValueError(f"cannot tile a {self.fmt} weight {tuple(self.weight.shape)}: {why}")
        move = tile_bytes_ if in_place else tile_bytes
        chunk = scale_chunk(self.fmt)
        weight = self._recoded(move(self.weight, TILE_BYTES), in_place, uncode=False)
        return QWeight(self.fmt, weight, move(self.scale, chunk) if chunk else self.scale,
                       self.scale_2, self.input_scale, tiled=True)

    def untiled(self) -> "QWeight":
        """The same weight stored row-major (self if it already is)."""
        if not self.tiled:
            return self
        chunk = scale_chunk(self.fmt)
        weight = self._recoded(untile_bytes(self.weight, TILE_BYTES), False, uncode=True)
        return QWeight(self.fmt, weight, untile_bytes(self.scale, chunk) if chunk else self.scale, self.scale_2,
                       self.input_scale)

    def _recoded(self, moved: torch.Tensor, in_place: bool, uncode: bool) -> torch.Tensor:
        """Weight bytes just (un)tiled -> FP4 words (un)coded (`formats.wordcode`; other formats unchanged). Unless
        `in_place`, self's bytes are never written: one tile per matrix (un)tiles to a view of itself."""
        if self.fmt not in FP4_FORMATS:
            return moved
        if not in_place and moved.data_ptr() == self.weight.data_ptr():
            moved = moved.clone()
        return code_fp4_(moved, uncode=uncode)

    def index(self, *index: int) -> "QWeight":
        """The unstacked weight at one leading index (views, no copy; tiling is per matrix, so it stays)."""
        pick = lambda t: None if t is None else t[index]  # noqa: E731
        return QWeight(self.fmt, self.weight[index], pick(self.scale), pick(self.scale_2), pick(self.input_scale),
                       tiled=self.tiled)

    def rows(self, start: int, stop: int) -> "QWeight":
        """Output rows [start, stop) of one unstacked FP4 weight (views where the layout allows: row-major, or
        tiled at whole tiles; else a row-major copy)."""
        if self.leading or self.fmt not in FP4_FORMATS:
            raise ValueError(f"rows() takes one unstacked FP4 weight, got {self.fmt} {tuple(self.weight.shape)}")
        if self.tiled and (start % TILE_ROWS or stop % TILE_ROWS):
            return self.untiled().rows(start, stop)
        return QWeight(self.fmt, self.weight[start:stop], self.scale[start:stop], self.scale_2, self.input_scale,
                       tiled=self.tiled)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scale, self.scale_2, self.input_scale)
                   if t is not None)

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes every companion tensor must have for this format, from the weight's logical N and K."""
        L, n, k = self.leading, self.out_features, self.in_features
        if self.fmt == "fp8":
            return {"scale": (*L, -(-n // FP8_BLOCK), -(-k // FP8_BLOCK))}
        if self.fmt == "mxfp4":
            return {"scale": (*L, n, k // MXFP4_BLOCK)}
        if self.fmt == "nvfp4":
            return {"scale": (*L, n, k // NVFP4_BLOCK), "scale_2": L, "input_scale": L}
        return {}

    def validate(self, what: str = "weight") -> None:
        """Raise naming `what` if the format, dtypes or shapes disagree with the layout table above."""
        if self.fmt not in FORMATS:
            raise ValueError(f"{what}: unknown weight format {self.fmt!r}; expected one of {FORMATS}")
        w = self.weight
        if not isinstance(w, torch.Tensor) or w.dim() < 2:
            raise ValueError(f"{what}: weight must be a tensor [*L, N, K], got "
                             f"{tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}")
        want = _WEIGHT_DTYPES.get(self.fmt)
        if (w.dtype not in want) if want else not w.is_floating_point():
            raise ValueError(f"{what}: {self.fmt} weight must be {want or 'floating point'}, got {w.dtype}")
        if self.in_features % _K_BLOCK.get(self.fmt, 1):
            raise ValueError(f"{what}: {self.fmt} K={self.in_features} is not a multiple of {_K_BLOCK[self.fmt]}")
        want = _SCALE_DTYPES.get(self.fmt)
        if want and (self.scale is None or self.scale.dtype not in want):
            got = None if self.scale is None else self.scale.dtype
            raise ValueError(f"{what}: {self.fmt} scale must be one of {want}, got {got}")
        shapes = self.expected_shapes()
        for name in ("scale", "scale_2", "input_scale"):
            t = getattr(self, name)
            if name not in shapes:
                if t is not None:
                    raise ValueError(f"{what}: a {self.fmt} weight has no {name}, got a tensor {tuple(t.shape)}")
                continue
            if name == "input_scale" and t is None:
                continue  # W4A16 checkpoints ship no input_scale; only the W4A4 emulation needs it
            if t is None or tuple(t.shape) != tuple(shapes[name]):
                raise ValueError(f"{what}: {self.fmt} {name} must have shape {tuple(shapes[name])}, "
                                 f"got {None if t is None else tuple(t.shape)}")
            if name != "scale" and t.dtype != torch.float32:
                raise ValueError(f"{what}: {self.fmt} {name} must be float32, got {t.dtype}")
        if self.tiled:
            why = why_untileable(self.fmt, self.out_features, w.shape[-1])
            rows_contiguous = w.stride(-1) == 1 and w.stride(-2) == w.shape[-1]
            if why or not rows_contiguous or (scale_chunk(self.fmt) and not self.scale.is_contiguous()):
                raise ValueError(f"{what}: a tiled {self.fmt} weight {tuple(w.shape)} must be whole contiguous "
                                 f"tiles: {why or 'strided rows'}")
