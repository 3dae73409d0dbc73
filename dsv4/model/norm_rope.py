"""RMS normalisations and V4's rotary embedding (interleaved pairs on the trailing channels, per-layer rope).

Sliding-only layers use the main rope (theta = rope_theta, no scaling); CSA/HCA layers use the compress
rope (theta = compress_rope_theta with YaRN) for every rotation in the layer. YaRN here changes only the
frequencies: cos/sin are not scaled (no mscale) and the softmax scale stays head_dim^-1/2.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import ModelConfig
from ..kernels.ref import rms  # noqa: F401  (the model's unweighted RMS; also mHC's)


class RMSNorm(nn.Module):
    """Weighted RMSNorm; the weight is kept in fp32 and multiplies the fp32 normalised value, cast once."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.empty(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


def rope_inv_freq(cfg: ModelConfig, compress: bool) -> torch.Tensor:
    """One angular frequency per rotated pair, fp32 [qk_rope_head_dim / 2]."""
    dim = cfg.qk_rope_head_dim
    base = cfg.compress_rope_theta if compress else cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    inv_freq = 1.0 / pos_freqs
    y = cfg.rope_scaling
    if not compress or y is None:
        return inv_freq

    def correction_dim(rotations: float) -> float:
        return dim * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(y.beta_fast)), 0)
    high = min(math.ceil(correction_dim(y.beta_slow)), dim - 1)
    span = (high - low) or 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / span).clamp(0, 1)
    # Pairs below `low` keep their frequency, pairs above `high` are divided by the factor. Written as
    # transformers writes it (via the extrapolation weight 1 - ramp) so the fp32 values agree to the bit.
    keep = 1 - ramp
    return 1.0 / (y.factor * pos_freqs) * (1 - keep) + inv_freq * keep


class Rope(nn.Module):
    """The rope of one layer. `inv_freq` is derived from the config (a non-persistent buffer, not a weight)."""

    def __init__(self, cfg: ModelConfig, compress: bool):
        super().__init__()
        self.compress = compress
        self.register_buffer("inv_freq", rope_inv_freq(cfg, compress), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] -> (cos, sin) fp32 [..., rope_dim / 2]."""
        freqs = positions[..., None].float() * self.inv_freq
        return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing 2*cos.shape[-1] channels of x as interleaved pairs (2i, 2i+1); -angle if `inverse`.

    cos/sin must broadcast against x[..., :half] (e.g. [B, S, 1, half] for x [B, S, H, D]). The rotation is
    computed in fp32 and cast back; the leading (nope) channels are untouched.
    """
    rd = 2 * cos.shape[-1]
    if inverse:
        sin = -sin
    r = x[..., -rd:].float()
    a, b = r[..., 0::2], r[..., 1::2]
    rotated = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    return torch.cat((x[..., :-rd], rotated.to(x.dtype)), dim=-1)
