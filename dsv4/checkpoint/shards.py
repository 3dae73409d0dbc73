"""Each rank's slices of the checkpoint's tensors, and the accounting of a whole parallel layout.

`parallel.Shard.split(name)` says which elements of a canonical tensor's logical axis a rank holds (attention heads,
o_groups, an expert's intermediate dimension, vocabulary rows). A stored leaf holds that axis in its own units:

| leaf (format)              | stored shape       | elements of the logical axis per stored index: rows, columns |
|----------------------------|--------------------|--------------------------------------------------------------|
| weight (dense, fp8)        | [N, K]             | 1, 1                                                         |
| weight (mxfp4, nvfp4)      | [N, K/2] bytes     | 1, 2                                                         |
| scale (fp8)                | [N/128, K/128]     | 128, 128 (the last block may be short)                       |
| scale (mxfp4)              | [N, K/32]          | 1, 32                                                        |
| weight_scale (nvfp4)       | [N, K/16]          | 1, 16                                                        |
| weight_scale_2, input_scale| []                 | whole (one per tensor)                                       |
| plain tensors (embed, sink)| [n, ...]           | 1                                                            |

so a slice must begin and end on a stored index (an FP8 block, an FP4 scale block); one that does not is refused,
naming the tensor, its format and the block. `region` gives the stored index ranges, which the loader reads through
safetensors' `get_slice` (memory-mapped: only those bytes). `layout_plan` plans every rank of a layout from the
headers alone and checks that the slices the ranks read of each tensor tile it exactly once (every tensor read by
some rank; a replicated tensor read whole by each of its ranks), and sums each rank's weight bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType

from ..formats import FP8_BLOCK, MXFP4_BLOCK, NVFP4_BLOCK
from ..parallel import Layout, LayoutError, Split

# (format, leaf) -> logical elements per stored index along (rows, columns); absent leaves are scalars (whole).
_UNITS = MappingProxyType({
    ("dense", "weight"): (1, 1), ("fp8", "weight"): (1, 1), ("mxfp4", "weight"): (1, 2), ("nvfp4", "weight"): (1, 2),
    ("fp8", "scale"): (FP8_BLOCK, FP8_BLOCK), ("mxfp4", "scale"): (1, MXFP4_BLOCK),
    ("nvfp4", "weight_scale"): (1, NVFP4_BLOCK),
})


def region(name: str, shape: tuple[int, ...], fmt: str | None, split: Split | None) -> tuple | None:
    """The stored index region of canonical tensor `name` (stored `shape`; `fmt` its linear's format, None for a
    plain tensor) holding `split`; None: the whole tensor."""
    if split is None:
        return None
    leaf = name.rpartition(".")[2]
    units = (1, 1) if fmt is None else _UNITS.get((fmt, leaf))
    if units is None or len(shape) <= split.axis:          # a per-tensor scalar: every rank reads it whole
        return None
    per = units[split.axis]
    start, stop = split.start // per, -(-split.stop // per)
    if split.start % per or (split.stop % per and split.stop != split.size):
        what = f"{fmt} {leaf}" if fmt else "tensor"
        raise LayoutError(f"{name}: a {what} stores {per} elements of axis {split.axis} per index, so this rank's "
                          f"slice [{split.start}, {split.stop}) of that axis cuts through one; use a smaller "
                          "tensor_parallel_size" + (" or enable_expert_parallel" if ".experts." in name else ""))
    return (slice(None),) * split.axis + (slice(start, stop),)


def region_shape(shape: tuple[int, ...], where: tuple | None) -> tuple[int, ...]:
    if where is None:
        return tuple(shape)
    out = list(shape)
    for axis, s in enumerate(where):
        if s.start is not None:
            out[axis] = s.stop - s.start
    return tuple(out)


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass
class LayoutPlan:
    """What every rank of `layout` reads: bytes per rank and the problems found (empty when the layout loads)."""

    layout: Layout
    bytes_per_rank: list[int]
    layers_per_rank: list[range]
    problems: list[str] = field(default_factory=list)
    # canonical name -> {stored region or None (whole): ranks reading it}
    reads: dict[str, dict] = field(default_factory=dict, repr=False)

    @property
    def ok(self) -> bool:
        return not self.problems


def check_tiling(name: str, shape: tuple[int, ...], regions: list, problems: list[str]) -> None:
    """The distinct regions read of one tensor must tile it exactly once: the whole tensor, or disjoint slices of
    one axis covering it."""
    if regions == [None]:
        return
    axes = {len(r) - 1 for r in regions if r is not None}
    if None in regions or len(axes) != 1:
        problems.append(f"{name}: read both whole and in slices, or sliced along several axes, by different ranks")
        return
    axis = axes.pop()
    spans = sorted((r[axis].start, r[axis].stop) for r in regions)
    at = 0
    for start, stop in spans:
        if start != at:
            gap = "overlap" if start < at else "leave a gap"
            problems.append(f"{name}: the ranks' slices of axis {axis} {gap} at index {min(start, at)}")
            return
        at = stop
    if at != shape[axis]:
        problems.append(f"{name}: the ranks' slices of axis {axis} end at {at}, the tensor at {shape[axis]}")

