"""Small random V4 checkpoints for tests and the demo (`dsv4 make-tiny`).

Values are chosen so that every code path does real work: norms are near 1 but not 1, sinks, ape, mHC
base/scale and gate biases are non-zero, hash tables route to distinct experts, and the routed and
shared experts' w1/w3 are large enough that the SwiGLU clamp (gate above +limit, up outside ±limit) is
hit by a fair share of activations, while w2 is small enough that the residual stream and the logits
stay finite and O(1).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..config import ModelConfig
from .spec import (APE, ATTN, COMPRESSOR, EMBED, GATE_BIAS, HC, HEAD, INDEXER_WEIGHTS, INDEXER_WQ_B, LINEAR_ROLES,
                   MTP_PROJ, NORM, ROUTED, ROUTER, SHARED, SINK, TID2EID, TensorSpec, model_specs)

# Standard deviation of w1/w3 relative to 1/sqrt(in): with RMS-normalised inputs the gate and up
# pre-activations have std ~ W13_GAIN, so P(gate > 10) ~ 10% and P(|up| > 10) ~ 20% at W13_GAIN = 8.
W13_GAIN = 8.0
# w2 shrinks the (up to ~100) SwiGLU outputs back to O(1) contributions to the residual.
W2_GAIN = 0.02


def _normal(gen: torch.Generator, shape: tuple[int, ...], std: float, mean: float = 0.0) -> torch.Tensor:
    return torch.randn(shape, generator=gen) * std + mean


def _uniform(gen: torch.Generator, shape: tuple[int, ...], low: float, high: float) -> torch.Tensor:
    return torch.rand(shape, generator=gen) * (high - low) + low


def linear_std(spec: TensorSpec) -> float:
    """Standard deviation of a random linear weight (embedding and head included) of `spec`'s role: 1/sqrt(in)
    times the role's gain (W13_GAIN / W2_GAIN for expert weights, 2 for the head, none for the embedding)."""
    unit = 1.0 / math.sqrt(spec.shape[-1])
    if spec.role in (ROUTED, SHARED):
        return unit * (W2_GAIN if spec.module.endswith(".w2") else W13_GAIN)
    if spec.role in (ATTN, COMPRESSOR, INDEXER_WQ_B, INDEXER_WEIGHTS, MTP_PROJ, ROUTER):
        return unit
    if spec.role == EMBED:
        return 1.0
    if spec.role == HEAD:
        return 2.0 * unit
    raise ValueError(f"{spec.name}: role {spec.role!r} is not a linear")


def _random_tensor(cfg: ModelConfig, spec: TensorSpec, gen: torch.Generator) -> torch.Tensor:
    shape, role = spec.shape, spec.role
    if role in LINEAR_ROLES:
        value = _normal(gen, shape, linear_std(spec))
    elif role == NORM:
        # 1 +- [0.02, 0.2]: near 1, never 1 even after rounding to bf16 (whose step near 1 is 2^-7)
        sign = torch.randint(0, 2, shape, generator=gen) * 2 - 1
        value = 1 + sign * _uniform(gen, shape, 0.02, 0.2)
    elif role == HC:
        leaf = spec.name.rsplit("_", 1)[-1]
        if leaf == "fn":
            value = _normal(gen, shape, 0.5 / math.sqrt(shape[-1]))
        elif leaf == "base":
            value = _normal(gen, shape, 0.5)
        else:  # scale: one multiplier per pre/post/comb, positive and not 1
            value = _uniform(gen, shape, 0.5, 1.5)
    elif role == SINK:
        value = _normal(gen, shape, 1.0)
    elif role == APE:
        value = _normal(gen, shape, 0.5)
    elif role == GATE_BIAS:
        value = _normal(gen, shape, 0.2)
    elif role == TID2EID:
        # Each token routes to top-k distinct experts.
        rows, k = shape
        value = torch.stack([torch.randperm(cfg.n_routed_experts, generator=gen)[:k] for _ in range(rows)])
    else:
        raise ValueError(f"{spec.name}: no random initialiser for role {role!r}")
    return value.to(spec.dtype)


def random_canonical(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every canonical tensor of `cfg` (MTP included) in its release dtype, reproducible from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    return {spec.name: _random_tensor(cfg, spec, gen) for spec in model_specs(cfg)}


def make_tiny(dst: str | Path, seed: int = 0, fmt: str = "bf16", naming: str = "deepseek",
              cfg: ModelConfig | None = None, shard_bytes: int | None = None, progress: bool = False,
              overwrite: bool = False):
    """Write a random checkpoint of `cfg` (default `ModelConfig.tiny()`) to `dst` in `fmt` with `naming`."""
    from .canonical import in_memory_checkpoint
    from .convert import convert_checkpoint

    cfg = cfg or ModelConfig.tiny()
    source = in_memory_checkpoint(random_canonical(cfg, seed), cfg, Path(f"<random seed={seed}>"))
    return convert_checkpoint(source, dst, fmt=fmt, naming=naming, shard_bytes=shard_bytes, progress=progress,
                              overwrite=overwrite)
