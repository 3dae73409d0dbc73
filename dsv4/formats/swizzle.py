"""The 128x4 swizzled scale-factor layout of Blackwell block-scaled GEMMs (CUTLASS, cuBLAS, FlashInfer).

Row-major block scales [M, S] (S = K/16 for NVFP4, K/32 for MXFP4) are padded with zeros to
[ceil(M/128)*128, ceil(S/4)*4] and cut into atoms of 128 rows x 4 scale columns (512 bytes). Atoms are
stored K-tile fastest, then M-tile; inside an atom row r and column c sit at byte (r%32)*16 + (r//32)*4 + c:

    offset(m, s) = ((m // 128) * ceil(S/4) + s // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + s % 4

Checkpoints store the plain row-major layout; swizzling happens only for kernels that want it.
"""

from __future__ import annotations

import torch

_ROWS, _COLS = 128, 4


def _byte_view(sf: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(sf, torch.Tensor) or sf.element_size() != 1 or sf.dim() < 2:
        got = f"{sf.dtype} {tuple(sf.shape)}" if isinstance(sf, torch.Tensor) else type(sf).__name__
        raise TypeError(f"{what}: expected one-byte scales (e4m3 / e8m0 / uint8) of shape [..., M, S], got {got}")
    return sf.contiguous().view(torch.uint8)


def swizzle_128x4(sf: torch.Tensor) -> torch.Tensor:
    """Row-major [*L, M, S] -> [*L, Mp, Sp] (Mp, Sp padded to 128, 4) whose memory is the swizzled layout."""
    b = _byte_view(sf, "swizzle_128x4")
    *lead, m, s = b.shape
    mt, st = -(-m // _ROWS), -(-s // _COLS)
    padded = torch.nn.functional.pad(b, (0, st * _COLS - s, 0, mt * _ROWS - m))
    # row = mt*128 + (r//32)*32 + r%32; the atom stores [r%32][r//32][c], so r%32 must move outermost.
    atoms = padded.reshape(*lead, mt, 4, 32, st, _COLS).movedim(-2, -4)  # [*L, mt, st, 4, 32, 4]
    atoms = atoms.transpose(-3, -2)                                     # [*L, mt, st, 32, 4, 4]
    return atoms.reshape(*lead, mt * _ROWS, st * _COLS).view(sf.dtype)


def unswizzle_128x4(swizzled: torch.Tensor, m: int, s: int) -> torch.Tensor:
    """Inverse of `swizzle_128x4`: [*L, Mp, Sp] swizzled -> row-major [*L, m, s] (padding dropped)."""
    b = _byte_view(swizzled, "unswizzle_128x4")
    *lead, mp, sp = b.shape
    mt, st = -(-m // _ROWS), -(-s // _COLS)
    if m < 1 or s < 1 or (mp, sp) != (mt * _ROWS, st * _COLS):
        raise ValueError(f"unswizzle_128x4: a swizzled tensor of shape {(mp, sp)} cannot hold {m}x{s} scales "
                         f"(expected {(mt * _ROWS, st * _COLS)})")
    atoms = b.reshape(*lead, mt, st, 32, 4, _COLS).transpose(-3, -2)   # [*L, mt, st, 4, 32, 4]
    rows = atoms.movedim(-4, -2).reshape(*lead, mp, sp)                # [*L, mt, 4, 32, st, 4]
    return rows[..., :m, :s].contiguous().view(swizzled.dtype)
