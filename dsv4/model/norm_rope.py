"""The weighted RMSNorm module and V4's rotary embedding (interleaved pairs on the trailing channels, per-layer rope);
the math of both (`rms_norm`, `apply_rope`) is in `kernels.ref`, and the model applies them through `Ops.norm_rope`.
`StepRope` computes one forward's cos / sin once per rope and window ratio for all its layers.

Sliding-only layers use the main rope (theta = rope_theta, no scaling); CSA/HCA layers use the compress
rope (theta = compress_rope_theta with YaRN) for every rotation in the layer. YaRN here changes only the
frequencies: cos/sin are not scaled (no mscale) and the softmax scale stays head_dim^-1/2.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import ModelConfig
from ..kernels.ref import rms_norm


class RMSNorm(nn.Module):
    """Weighted RMSNorm; the weight is kept in fp32 and multiplies the fp32 normalised value, cast once."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.empty(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


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


class StepRope:
    """cos / sin of one forward's positions, computed once per (rope, window ratio) and shared by every layer.

    Layers of the same kind have equal ropes (`Rope` depends only on the config and `compress`), so the tables of
    the first layer that asks serve the others: a step computes at most four (main, compress, and the compress rope
    at the window starts of ratio 4 and 128) instead of two or three per layer. Lives for one forward call."""

    def __init__(self, positions: torch.Tensor):
        self.positions = positions
        self._tables: dict[tuple[bool, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def at(self, rope: Rope, ratio: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """`rope`'s (cos, sin) [..., rope_dim / 2] at the positions (ratio 1) or at their window starts
        floor(p / ratio) * ratio (where a compressor rotates the entry that window closes)."""
        key = (rope.compress, ratio)
        if key not in self._tables:
            p = self.positions
            self._tables[key] = rope(p if ratio == 1 else torch.div(p, ratio, rounding_mode="floor") * ratio)
        return self._tables[key]
