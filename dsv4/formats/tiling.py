"""Tile-major storage of quantized weight bytes: what the GPU kernels read, in the order they read it.

A decode GEMV reads every weight row TILE_BYTES at a time, TILE_ROWS rows together. Row-major, that is
TILE_ROWS short runs one row length apart, which an H200 serves at ~57 % of its copy bandwidth; stored tile by
tile it is one contiguous run (~70 %; bench/RESULTS.md, round five). The tiled order of a [*L, N, R] byte
array (R bytes per row) is [*L, N / TILE_ROWS, R / C, TILE_ROWS, C] with C = TILE_BYTES for the weight bytes,
and C = the scale bytes of those weight bytes for FP4 block scales (NVFP4 8, MXFP4 4), so a weight chunk and
its scales sit in the same (tile, chunk) slot. FP8's 128 x 128 block scales stay as they are.

The tensors keep their logical shape, so row slices at multiples of TILE_ROWS stay valid (a tile is the same
bytes as its TILE_ROWS rows row-major). Only the device placement tiles (`QWeight.tiled`); checkpoints, the
reference and every format function see row-major bytes.
"""

from __future__ import annotations

import torch

TILE_ROWS = 64       # rows per tile: the GEMV's BN
TILE_BYTES = 64      # weight bytes per row and chunk: one GEMV sub-step (128 FP4 or 64 FP8 values)


def scale_chunk(fmt: str) -> int:
    """Block-scale bytes per row that belong to one TILE_BYTES weight chunk (0: scales not tiled)."""
    return {"nvfp4": TILE_BYTES * 2 // 16, "mxfp4": TILE_BYTES * 2 // 32}.get(fmt, 0)


def why_untileable(fmt: str, n: int, row_bytes: int) -> str | None:
    """Why a [*, n, row_bytes] weight of this format cannot be tiled, or None if it can."""
    if fmt not in ("fp8", "mxfp4", "nvfp4"):
        return f"{fmt} weights are not tiled"
    if n % TILE_ROWS:
        return f"{n} rows is not a multiple of {TILE_ROWS}"
    if row_bytes % TILE_BYTES:
        return f"{row_bytes} bytes per row is not a multiple of {TILE_BYTES}"
    return None


def tile_bytes(t: torch.Tensor, chunk: int) -> torch.Tensor:
    """Row-major [*L, N, R] -> the same shape and dtype holding the tiled order (a new tensor)."""
    return _permute(t, chunk, to_tiles=True)


def untile_bytes(t: torch.Tensor, chunk: int) -> torch.Tensor:
    """Inverse of `tile_bytes`."""
    return _permute(t, chunk, to_tiles=False)


def tile_bytes_(t: torch.Tensor, chunk: int) -> torch.Tensor:
    """`tile_bytes` in place, one [N, R] matrix at a time: a stacked expert tensor (several GB) never needs a
    second copy of itself, only of one matrix."""
    *lead, n, r = t.shape
    for m in t.view(-1, n, r) if lead else (t,):
        m.copy_(tile_bytes(m, chunk))
    return t


def _permute(t: torch.Tensor, chunk: int, to_tiles: bool) -> torch.Tensor:
    *lead, n, r = t.shape
    if n % TILE_ROWS or r % chunk:
        raise ValueError(f"tiling: shape {tuple(t.shape)} is not whole [{TILE_ROWS}, {chunk}] tiles")
    u = t.contiguous().view(torch.uint8)    # float8 weights move as bytes
    if to_tiles:
        u = u.view(*lead, n // TILE_ROWS, TILE_ROWS, r // chunk, chunk).transpose(-3, -2)
    else:
        u = u.view(*lead, n // TILE_ROWS, r // chunk, TILE_ROWS, chunk).transpose(-3, -2)
    return u.contiguous().view(t.dtype).view(t.shape)
