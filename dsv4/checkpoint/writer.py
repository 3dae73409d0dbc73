"""What a checkpoint format stores (the plan) and how shards are written (streaming, header first).

The plan is computed from the config alone: every output tensor's key, dtype and shape, in the order
the converter produces them. It fixes the shard layout before any data exists, so each shard's
safetensors header is written first and tensor bytes are appended as they are produced: memory holds
one conversion unit (a linear, or an expert's w1+w3), never a shard or the model. The same plan gives
closed-form tensor counts and byte totals (V4-Flash `official`: 69,187 tensors, 159,609,485,896 bytes).

Storages: bf16 / fp32 / int64 (plain), fp8 (E4M3 weight + UE8M0 128x128 `scale`), mxfp4 (I8 packed weight +
UE8M0 1x32 `scale`, DeepSeek's layout), nvfp4 (U8 packed weight + E4M3 1x16 `weight_scale` + F32 scalar
`weight_scale_2` and `input_scale`, ModelOpt's layout).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch

from ..config import ModelConfig
from ..formats import FP8_BLOCK, MXFP4_BLOCK, NVFP4_BLOCK
from . import names
from .errors import CheckpointError
from .reader import DTYPES, ELEMENT_BITS, INDEX_NAME
from .spec import (APE, ATTN, COMPRESSOR, EMBED, GATE_BIAS, HC, HEAD, INDEXER_WEIGHTS, INDEXER_WQ_B, MTP_PROJ,
                   NORM, ROUTED, ROUTER, SHARED, SINK, TID2EID, TensorSpec, model_specs)

FORMATS = ("bf16", "official", "nvfp4-experts", "nvfp4")
NAMINGS = ("deepseek", "hf")
DEFAULT_SHARD_BYTES = 4 * 1024**3

_OFFICIAL = MappingProxyType({
    NORM: "bf16", HC: "fp32", SINK: "fp32", APE: "fp32", GATE_BIAS: "fp32", TID2EID: "int64", EMBED: "bf16",
    ATTN: "fp8", INDEXER_WQ_B: "fp8", SHARED: "fp8", MTP_PROJ: "fp8", ROUTED: "mxfp4",
    COMPRESSOR: "bf16", INDEXER_WEIGHTS: "bf16", ROUTER: "bf16", HEAD: "bf16"})
# Storage of each tensor role per output format (docs/architecture.md "Checkpoints").
FORMAT_PLANS = MappingProxyType({
    "bf16": MappingProxyType({**_OFFICIAL, **dict.fromkeys((ATTN, INDEXER_WQ_B, SHARED, MTP_PROJ, ROUTED), "bf16")}),
    "official": _OFFICIAL,
    # NVIDIA's builds (ModelOpt examples/deepseek/deepseek_v4/quantize_to_nvfp4.py): only the routed experts of
    # the main layers change; the MTP block stays official (MTP_FORMAT).
    "nvfp4-experts": MappingProxyType({**_OFFICIAL, ROUTED: "nvfp4"}),
    "nvfp4": MappingProxyType({**_OFFICIAL, **dict.fromkeys((ATTN, INDEXER_WQ_B, INDEXER_WEIGHTS, SHARED, ROUTED,
                                                             MTP_PROJ), "nvfp4")}),
})
# The format whose plan the MTP block (`mtp.*`) follows where it is not the output format's own: ModelOpt's V4
# recipe leaves the MTP block in the source format (its exclude_modules list `mtp.*`).
MTP_FORMAT = MappingProxyType({"nvfp4-experts": "official"})
# Plain storages: one tensor under the canonical name.
PLAIN_STORAGE_DTYPES = MappingProxyType({"bf16": "BF16", "fp32": "F32", "int64": "I64"})
# Quantized linear storages: leaf -> safetensors dtype, in writing order.
LINEAR_STORAGE_LEAVES = MappingProxyType({
    "fp8": MappingProxyType({"weight": "F8_E4M3", "scale": "F8_E8M0"}),
    "mxfp4": MappingProxyType({"weight": "I8", "scale": "F8_E8M0"}),
    "nvfp4": MappingProxyType({"weight": "U8", "weight_scale": "F8_E4M3", "weight_scale_2": "F32",
                               "input_scale": "F32"}),
})
# DeepSeek's release config (V4-Flash / V4-Pro config.json), with the experts' storage as a top-level key.
FP8_QUANTIZATION_CONFIG = MappingProxyType({"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                            "scale_fmt": "ue8m0", "weight_block_size": (FP8_BLOCK, FP8_BLOCK)})


def output_dialect(fmt: str, naming: str) -> str:
    """`--naming hf` writes what transformers saves for bf16, per-expert HF module names when quantized."""
    if naming == "deepseek":
        return "deepseek"
    if naming == "hf":
        return "hf-saved" if fmt == "bf16" else "hf-experts"
    raise ValueError(f"unknown naming {naming!r}; expected one of {NAMINGS}")


@dataclass(frozen=True)
class PlannedTensor:
    key: str            # key in the output checkpoint
    canonical: str      # canonical name
    dtype: str          # safetensors dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * ELEMENT_BITS[self.dtype] // 8


@dataclass(frozen=True)
class Unit:
    """Tensors produced together: one plain tensor, one linear, or an expert's w1 and w3 (shared scale_2)."""
    specs: tuple[TensorSpec, ...]
    storage: str
    tensors: tuple[PlannedTensor, ...]


def storage_of(spec: TensorSpec, fmt: str) -> str:
    if fmt not in FORMAT_PLANS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")
    if spec.name.startswith("mtp."):
        fmt = MTP_FORMAT.get(fmt, fmt)
    return FORMAT_PLANS[fmt][spec.role]


def linear_shapes(storage: str, n: int, k: int) -> dict[str, tuple[int, ...]]:
    """leaf -> stored shape of a quantized [n, k] linear."""
    if storage == "fp8":
        return {"weight": (n, k), "scale": (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK))}
    if storage == "mxfp4":
        return {"weight": (n, k // 2), "scale": (n, k // MXFP4_BLOCK)}
    if storage == "nvfp4":
        return {"weight": (n, k // 2), "weight_scale": (n, k // NVFP4_BLOCK), "weight_scale_2": (), "input_scale": ()}
    raise ValueError(f"{storage!r} is not a quantized linear storage")


def _planned(spec: TensorSpec, storage: str, dialect: str) -> list[PlannedTensor]:
    if storage in PLAIN_STORAGE_DTYPES:
        return [PlannedTensor(names.dialect_key(spec.name, dialect), spec.name, PLAIN_STORAGE_DTYPES[storage],
                              spec.shape)]
    block = {"mxfp4": MXFP4_BLOCK, "nvfp4": NVFP4_BLOCK}.get(storage, 1)
    if spec.shape[1] % block:
        raise ValueError(f"{spec.name}: in_features {spec.shape[1]} is not a multiple of {block}; it cannot be "
                         f"stored as {storage}")
    out = []
    for leaf, shape in linear_shapes(storage, *spec.shape).items():
        canonical = f"{spec.module}.{leaf}"
        dtype = LINEAR_STORAGE_LEAVES[storage][leaf]
        out.append(PlannedTensor(names.dialect_key(canonical, dialect), canonical, dtype, shape))
    return out


def plan(cfg: ModelConfig, fmt: str, naming: str = "deepseek", include_mtp: bool = True) -> list[Unit]:
    """Every output tensor of `fmt` for `cfg`, grouped into production units, in writing order."""
    dialect = output_dialect(fmt, naming)
    specs = model_specs(cfg, include_mtp=include_mtp)
    by_name = {s.name: s for s in specs}
    units: list[Unit] = []
    for spec in specs:
        group = (spec,)
        if spec.role in (ROUTED, SHARED) and spec.module.endswith(".w3"):
            continue  # produced with its w1
        if spec.role in (ROUTED, SHARED) and spec.module.endswith(".w1"):
            group = (spec, by_name[spec.module[:-2] + "w3.weight"])
        storage = storage_of(spec, fmt)
        tensors = tuple(t for s in group for t in _planned(s, storage, dialect))
        units.append(Unit(group, storage, tensors))
    return units


def plan_totals(units: list[Unit]) -> tuple[int, int]:
    """(tensor count, data bytes) of a plan."""
    return sum(len(u.tensors) for u in units), sum(t.nbytes for u in units for t in u.tensors)


# ---------------------------------------------------------------------------------------------- shards
def assign_shards(units: list[Unit], shard_bytes: int) -> list[list[PlannedTensor]]:
    """Split the plan into shards of at most `shard_bytes` (a larger single tensor gets its own shard)."""
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for unit in units:
        for t in unit.tensors:
            if shards[-1] and size + t.nbytes > shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(t)
            size += t.nbytes
    return shards


def shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


class ShardWriter:
    """One safetensors file whose header is written up front; tensors are appended in plan order."""

    def __init__(self, path: Path, entries: list[PlannedTensor]):
        self.path = path
        self.entries = entries
        self._next = 0
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for t in entries:
            header_shape = list(t.shape)
            header[t.key] = {"dtype": t.dtype, "shape": header_shape, "data_offsets": [offset, offset + t.nbytes]}
            offset += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors aligns the data section to 8 bytes
        self._file = open(path, "wb")
        self._file.write(struct.pack("<Q", len(raw)))
        self._file.write(raw)

    def write(self, key: str, tensor: torch.Tensor) -> None:
        want = self.entries[self._next]
        if key != want.key:
            raise CheckpointError(f"{self.path}: writer expected {want.key!r} next, got {key!r}")
        dtype = DTYPES[want.dtype]
        if tensor.dtype != dtype or tuple(tensor.shape) != want.shape:
            raise CheckpointError(f"{self.path}: {key!r} planned as {want.dtype} {list(want.shape)}, produced "
                                  f"{tensor.dtype} {list(tensor.shape)}")
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        if data.nbytes != want.nbytes:
            raise CheckpointError(f"{self.path}: {key!r} has {data.nbytes} bytes, planned {want.nbytes}")
        self._file.write(data.data)
        self._next += 1

    @property
    def done(self) -> bool:
        return self._next == len(self.entries)

    def abort(self) -> None:
        self._file.close()

    def close(self) -> None:
        self._file.close()
        if not self.done:
            raise CheckpointError(f"{self.path}: closed after {self._next} of {len(self.entries)} tensors")


def write_index(folder: Path, shards: list[list[PlannedTensor]], names_: list[str]) -> None:
    weight_map = {t.key: name for shard, name in zip(shards, names_) for t in shard}
    total = sum(t.nbytes for shard in shards for t in shard)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------- configs
def hf_config_dict(cfg: ModelConfig) -> dict:
    """A transformers-style config.json (what `save_pretrained` writes) describing `cfg`."""
    d = cfg.to_dict()
    for k in ("compress_ratios", "num_hash_layers", "rope_scaling", "quantization_config", "expert_dtype"):
        d.pop(k, None)
    partial = cfg.qk_rope_head_dim / cfg.head_dim
    compress: dict = {"rope_type": "default", "rope_theta": cfg.compress_rope_theta, "partial_rotary_factor": partial}
    if cfg.rope_scaling is not None:
        rs = cfg.rope_scaling
        compress.update(rope_type="yarn", factor=rs.factor, beta_fast=rs.beta_fast, beta_slow=rs.beta_slow,
                        original_max_position_embeddings=rs.original_max_position_embeddings,
                        attention_factor=1.0)  # V4 applies no YaRN mscale
    d.update(
        layer_types=[cfg.layer_type(i) for i in range(cfg.num_hidden_layers)],
        mlp_layer_types=["hash_moe" if cfg.is_hash_layer(i) else "moe" for i in range(cfg.num_hidden_layers)],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        partial_rotary_factor=partial,
        rope_parameters={"main": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                                  "partial_rotary_factor": partial}, "compress": compress},
    )
    return d


def _exclude_patterns(fmt: str, dialect: str) -> list[str]:
    """Module patterns left out of NVFP4 (ModelOpt's `exclude_modules`), in the output's names."""
    if fmt == "nvfp4-experts":  # ModelOpt's V4 recipe: attention, shared experts, head and MTP stay as they are
        ds = ["*.attn.*", "*.ffn.shared_experts.*", "head", "mtp.*"]
        hf = ["*.self_attn.*", "*.mlp.shared_experts.*", "lm_head", "mtp.*"]
    else:  # nvfp4: everything but the compressor projections, routers, embedding and head
        ds = ["*.attn.compressor.wkv", "*.attn.compressor.wgate", "*.attn.indexer.compressor.wkv",
              "*.attn.indexer.compressor.wgate", "*.ffn.gate", "embed", "head"]
        hf = ["*.self_attn.compressor.kv_proj", "*.self_attn.compressor.gate_proj",
              "*.self_attn.compressor.indexer.kv_proj", "*.self_attn.compressor.indexer.gate_proj", "*.mlp.gate",
              "model.embed_tokens", "lm_head", "mtp.*.attn.compressor.wkv", "mtp.*.attn.compressor.wgate",
              "mtp.*.ffn.gate"]
    return ds if dialect == "deepseek" else hf


def nvfp4_expert_groups(units: list[Unit]) -> list[str]:
    """Output names of the routed-expert groups (`layers.L.ffn.experts`) stored in NVFP4: ModelOpt's
    `quantized_layers` keys. A routed-expert key is `<group>.<expert>.<w>.<leaf>` in every per-expert dialect."""
    return sorted({t.key.rsplit(".", 3)[0] for u in units if u.storage == "nvfp4" and u.specs[0].role == ROUTED
                   for t in u.tensors})


def _nvfp4_config_groups() -> dict:
    """config.json's `config_groups` of ModelOpt's V4 recipe: W4A4 NVFP4 with static (calibrated) input scales."""
    numerics = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": NVFP4_BLOCK}
    return {"group_0": {"input_activations": dict(numerics), "weights": dict(numerics), "targets": ["Linear"]}}


def hf_quant_config(fmt: str, naming: str, units: list[Unit], version: str) -> dict | None:
    """ModelOpt's `hf_quant_config.json` for outputs with NVFP4 tensors (nvfp4-format.md §2.1, §5).

    nvfp4-experts is the manifest ModelOpt's DeepSeek-V4 recipe writes, in the output's names: MIXED_PRECISION,
    the NVFP4 expert groups in `quantized_layers`, the rest as config.json's quantization_config declares it.
    """
    if fmt not in ("nvfp4", "nvfp4-experts"):
        return None
    producer = {"name": "dsv4", "version": f"{version} ({fmt})"}
    dialect = output_dialect(fmt, naming)
    if fmt == "nvfp4-experts":
        quant = {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None, "group_size": NVFP4_BLOCK,
                 "quantized_layers": {g: {"quant_algo": "NVFP4", "group_size": NVFP4_BLOCK}
                                      for g in nvfp4_expert_groups(units)},
                 "exclude_modules": _exclude_patterns(fmt, dialect)}
    else:
        quant = {"exclude_modules": _exclude_patterns(fmt, dialect), "group_size": NVFP4_BLOCK,
                 "kv_cache_quant_algo": None, "quant_algo": "NVFP4"}
    return {"producer": producer, "quantization": quant}


def config_json(cfg: ModelConfig, fmt: str, naming: str, quant: dict | None) -> dict:
    """config.json of the output: DeepSeek-style for `deepseek` naming, transformers-style for `hf`."""
    d = cfg.to_dict() if naming == "deepseek" else hf_config_dict(cfg)
    d.pop("quantization_config", None)
    d.pop("expert_dtype", None)
    qc: dict | None = None
    expert_dtype = None
    if fmt in ("official", "nvfp4-experts"):
        qc = dict(FP8_QUANTIZATION_CONFIG, weight_block_size=list(FP8_QUANTIZATION_CONFIG["weight_block_size"]))
        expert_dtype = "fp4"
        if fmt == "nvfp4-experts":
            # ModelOpt's V4 recipe: quant_method stays "fp8" (the FP8 blocks), moe_quant_algo marks the NVFP4
            # experts (vLLM and SGLang key on it), and hf_quant_config.json's manifest is copied in, its
            # exclude_modules spelled `ignore`.
            q = quant["quantization"]
            qc.update(moe_quant_algo="NVFP4", producer=quant["producer"], quant_algo=q["quant_algo"],
                      kv_cache_quant_algo=q["kv_cache_quant_algo"], group_size=q["group_size"],
                      config_groups=_nvfp4_config_groups(), quantized_layers=q["quantized_layers"],
                      ignore=q["exclude_modules"])
    elif fmt == "nvfp4":
        q = quant["quantization"]
        qc = {"quant_method": "modelopt", "quant_algo": q["quant_algo"], "group_size": q["group_size"],
              "kv_cache_quant_algo": None, "exclude_modules": q["exclude_modules"], "producer": quant["producer"]}
    if qc is not None:
        if naming == "deepseek" and expert_dtype:
            d["expert_dtype"] = expert_dtype  # DeepSeek's release keeps it top level
        elif expert_dtype:
            qc["expert_dtype"] = expert_dtype  # transformers 5.23 reads it from the quantization config
        d["quantization_config"] = qc
    d["torch_dtype"] = "bfloat16"
    return d
