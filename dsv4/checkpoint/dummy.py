"""Random weights at a config's real dimensions, drawn directly on the device in a checkpoint format's storage
(vLLM's `load_format="dummy"`): V4-Flash or V4-Pro benchmarked without their checkpoints on disk.

Each linear takes the storage its role has in `fmt` (`writer.FORMAT_PLANS`: "bf16"; "official", DeepSeek's FP8
128x128 blocks with MXFP4 routed experts; "nvfp4-experts", NVIDIA's builds; "nvfp4"). Values have the standard
deviation `tiny.linear_std` gives the role (the routed and shared experts' w1/w3 large enough that the SwiGLU
clamp fires, w2 small enough that the residual stays O(1)), drawn in the stored encoding:
  dense  normal(0, std) in the compute dtype
  fp8    e4m3(normal(0, std / s)), every 128x128 block scale s = 2^round(log2 std) (UE8M0)
  mxfp4  uniformly random E2M1 codes (std E2M1_STD), every scale 2^round(log2(std / E2M1_STD)) (UE8M0)
  nvfp4  uniformly random E2M1 codes, E4M3 block scales 1, weight_scale_2 = std / E2M1_STD, input_scale 1
so the dequantized std is within a factor sqrt(2) of the role's (exact for dense and NVFP4). Plain tensors
(norms, mHC, sinks, ape) are `tiny`'s values, the gate biases a tenth of `tiny`'s (`GATE_BIAS_SCALE`: a batch's
tokens spread over the experts as random routing spreads them); hash tables route each token to distinct experts.
Nothing is read from disk; the MTP block is left out. Each module draws from its own generators, seeded by (seed, its
path): the values do not depend on which other modules a rank builds.
"""

from __future__ import annotations

import math
import zlib
from types import MappingProxyType

import torch

from ..config import ModelConfig
from ..formats import UE8M0_DTYPE, E2M1_VALUES
from ..kernels import Ops
from ..model import LinearFormat, QLinear, Transformer, build_model
from ..parallel import Communicator, Layout, Shard
from .loader import canonical_name, model_target
from .shards import region
from .spec import EMBED, GATE_BIAS, LINEAR_ROLES, TID2EID, TensorSpec, model_specs
from .tiny import _random_tensor, linear_std
from .writer import FORMAT_PLANS, storage_of

E2M1_STD = math.sqrt(sum(v * v for v in E2M1_VALUES) / len(E2M1_VALUES))   # of a uniformly random code
# The gate biases are tiny's times this. A trained model's selection bias balances the experts' load; tiny's (std
# 0.2, near the spread of the sqrt-softplus scores) favours a few experts for every token, so a benchmark's batch
# would read fewer expert bytes than a real model's step (bench/results/round-51.md). At a tenth, a batch reaches
# about as many distinct experts as random routing does (tests/test_dummy.py).
GATE_BIAS_SCALE = 0.1
_STORAGE_FORMATS = MappingProxyType({"fp8": LinearFormat("fp8", scale_dtype=UE8M0_DTYPE),
                                     "mxfp4": LinearFormat("mxfp4"), "nvfp4": LinearFormat("nvfp4", input_scale=True)})


def dummy_formats(cfg: ModelConfig, fmt: str) -> dict[str, LinearFormat]:
    """Model linear path -> its storage in checkpoint format `fmt` (absent: dense)."""
    if fmt not in FORMAT_PLANS:
        raise ValueError(f"unknown dummy weight format {fmt!r}; expected one of {sorted(FORMAT_PLANS)}")
    out = {}
    for spec in model_specs(cfg, include_mtp=False):
        storage = storage_of(spec, fmt) if spec.role in LINEAR_ROLES and spec.role != EMBED else None
        if storage in _STORAGE_FORMATS:
            out[model_target(spec.name)[0].rpartition(".")[0]] = _STORAGE_FORMATS[storage]
    return out


def _pow2(x: float) -> float:
    return 2.0 ** round(math.log2(x))


def _fill_linear(module: QLinear, spec: TensorSpec, gen: torch.Generator) -> None:
    """Draw every buffer of `module` (all its stacked pieces at once) in its storage, in place."""
    std, fmt, dev = linear_std(spec), module.format.fmt, module.weight.device
    if fmt == "dense":
        module.weight.copy_(torch.randn(module.weight.shape, generator=gen, device=dev).mul_(std))
    elif fmt == "fp8":
        scale = _pow2(std)
        module.weight.copy_(torch.randn(module.weight.shape, generator=gen, device=dev).mul_(std / scale))
        module.scale.copy_(torch.full(module.scale.shape, scale, device=dev))
    else:
        torch.randint(0, 256, module.weight.shape, generator=gen, out=module.weight)   # in place: no second copy
        if fmt == "mxfp4":
            module.scale.copy_(torch.full(module.scale.shape, _pow2(std / E2M1_STD), device=dev))
        else:
            module.weight_scale.fill_(1.0)
            module.weight_scale_2.fill_(std / E2M1_STD)
            module.input_scale.fill_(1.0)


def _routing_table(shape: tuple[int, ...], experts: int, gen: torch.Generator, device) -> torch.Tensor:
    """[vocab, k] distinct expert ids per token (a random permutation's first k, drawn for all rows at once)."""
    rows, k = shape
    return torch.rand(rows, experts, generator=gen, device=device).argsort(dim=1)[:, :k].contiguous()


def dummy_model(cfg: ModelConfig, fmt: str = "nvfp4-experts", device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.bfloat16, ops: Ops | None = None, seed: int = 0,
                shard: Shard | None = None, comm: Communicator | None = None) -> Transformer:
    """The model of `cfg` with random weights stored as checkpoint format `fmt` stores them, on `device`
    (reproducible from `seed` on a given device). Quantized weights stay row-major: the caller tiles them for the
    GPU kernels (`Transformer.prepare_for_kernels_`), as the loader does.

    Each module draws from generators seeded by (seed, its path), so one rank of a parallel engine (`shard`, `comm`)
    holds exactly its slices of what one process draws: it draws each of its modules whole, one at a time, and keeps
    its part (`shards.region`)."""
    device = torch.device(device)
    formats = dummy_formats(cfg, fmt)
    model = build_model(cfg, formats, dtype, ops, mtp=False, shard=shard, comm=comm)
    whole = dict(build_model(cfg, formats, dtype, ops, mtp=False).named_modules()) if shard else None
    specs = {s.name: s for s in model_specs(cfg, include_mtp=False)}
    for path, module in model.named_modules():
        source = module if shard is None else whole[path]
        _draw_module(cfg, source, path, specs, device, dtype, _module_seed(seed, path))
        if shard is not None:
            _keep_part(module, source, path, shard)
    return model


def check_dummy_layout(cfg: ModelConfig, fmt: str, layout: Layout) -> None:
    """Raise LayoutError if a rank of `layout` would cut a quantization block of `fmt`'s dummy weights (on the meta
    device: nothing is drawn)."""
    formats = dummy_formats(cfg, fmt)
    for shard in layout.shards(cfg):
        whole = dict(build_model(cfg, formats, mtp=False).named_modules())
        for path, module in build_model(cfg, formats, mtp=False, shard=shard).named_modules():
            _keep_part(module, whole[path], path, shard)


def _module_seed(seed: int, path: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(path.encode())) % (1 << 62)


def _draw_module(cfg: ModelConfig, module: torch.nn.Module, path: str, specs: dict, device: torch.device,
                 dtype: torch.dtype, seed: int) -> None:
    """Materialise `module`'s own buffers on `device` and draw them (every stacked piece at once)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    host_gen = torch.Generator().manual_seed(seed)               # tiny's plain tensors are drawn on the host
    for leaf, meta in list(module._buffers.items()):
        if leaf in module._non_persistent_buffers_set:     # derived from the config (rope frequencies)
            module._buffers[leaf] = meta.to(device)
        else:
            module._buffers[leaf] = torch.empty(meta.shape, dtype=meta.dtype, device=device)
    linear_leaves = ()
    if isinstance(module, QLinear):
        index = (0,) * len(module.leading)
        _fill_linear(module, specs[canonical_name(f"{path}.weight", index)], gen)
        linear_leaves = module.format.buffers(module.leading, module.out_features, module.in_features, dtype)
    for leaf, buf in module._buffers.items():
        if leaf in module._non_persistent_buffers_set or leaf in linear_leaves:
            continue
        spec = specs[f"{path}.{leaf}" if path else leaf]
        if spec.role == EMBED:
            buf.copy_(torch.randn(buf.shape, generator=gen, device=device).mul_(linear_std(spec)))
        elif spec.role == TID2EID:
            buf.copy_(_routing_table(spec.shape, cfg.n_routed_experts, gen, device))
        elif spec.role == GATE_BIAS:
            buf.copy_(_random_tensor(cfg, spec, host_gen).mul_(GATE_BIAS_SCALE))
        else:
            buf.copy_(_random_tensor(cfg, spec, host_gen))


def _keep_part(module: torch.nn.Module, whole: torch.nn.Module, path: str, shard: Shard) -> None:
    """Move this rank's part of `whole`'s drawn buffers into `module` (and drop the whole ones)."""
    lead = len(module.leading) if isinstance(module, QLinear) else 0
    fmt = module.format.fmt if isinstance(module, QLinear) else None
    for leaf, full in list(whole._buffers.items()):
        if leaf in whole._non_persistent_buffers_set:
            module._buffers[leaf] = full
            continue
        key = f"{path}.{leaf}" if path else leaf
        name = canonical_name(key, (0,) * lead)
        index: tuple = ()
        if lead and module.leading[0] != whole.leading[0]:         # expert parallel: this rank's experts
            index = (slice(shard.experts.start, shard.experts.stop),)
        index += (slice(None),) * (lead - len(index))
        index += region(name, tuple(full.shape[lead:]), fmt, shard.split(name)) or ()
        module._buffers[leaf] = full[index].contiguous() if any(s != slice(None) for s in index) else full
        whole._buffers[leaf] = None
