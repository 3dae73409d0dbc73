"""`dsv4 convert`: read any supported checkpoint, write it in one of the output formats, streaming.

The source is read through canonical names (`open_checkpoint`), the output follows the plan of
`writer.plan` unit by unit (a linear, or an expert's w1 and w3), so memory holds one unit at a time.
Every linear takes one of these paths, and the report counts them:
    copied       same storage as the source: bytes copied unchanged (also plain tensors of the same dtype)
    cast         a plain tensor or dense linear converted to another float dtype (e.g. fp32 -> bf16)
    dequantized  a quantized source written as bf16 (exact dequantization, then one rounding to bf16)
    quantized    a dense source quantized
    requantized  a quantized source dequantized exactly and quantized into another format
    reblocked    MXFP4 -> NVFP4 without touching a nibble (`formats.mxfp4_to_nvfp4`, k_max shared by w1/w3)
    reblock-refused  MXFP4 -> NVFP4 whose block exponents span more than E4M3 holds: requantized instead
NVFP4 input scales are 1.0 (calibration-free) unless the source already has them.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..formats import (mxfp4_k_max, mxfp4_to_nvfp4, nvfp4_global_scale, quantize_fp8_block, quantize_mxfp4,
                       quantize_nvfp4)
from ..formats.scales import UE8M0_DTYPE
from .canonical import NO_MTP_NOTE, Checkpoint, open_checkpoint
from .errors import CheckpointError
from .reader import DTYPES, INDEX_NAME
from .writer import (DEFAULT_SHARD_BYTES, PLAIN_STORAGE_DTYPES, ShardWriter, Unit, assign_shards, config_json,
                     hf_quant_config, output_dialect, plan, plan_totals, shard_name, write_index)

OUTPUT_FILES = ("config.json", INDEX_NAME, "hf_quant_config.json")


@dataclass
class ConvertReport:
    dst: Path
    fmt: str
    naming: str
    dialect: str
    source_dialect: str
    shards: int = 0
    tensors: int = 0
    bytes: int = 0
    paths: Counter = field(default_factory=Counter)   # "<storage> <path>" -> number of tensors (linears count once)
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        lines = [f"wrote {self.dst}: format {self.fmt}, dialect {self.dialect} (from {self.source_dialect}), "
                 f"{self.tensors} tensors, {self.bytes:,} bytes in {self.shards} shard(s)"]
        lines += [f"  {n:6d}  {what}" for what, n in sorted(self.paths.items())]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def convert_checkpoint(source: Checkpoint | str | Path, dst: str | Path, fmt: str, naming: str = "deepseek",
                       shard_bytes: int | None = None, progress: bool = False, overwrite: bool = False) -> ConvertReport:
    src = source if isinstance(source, Checkpoint) else open_checkpoint(source)
    dst = Path(dst)
    cfg = src.config
    include_mtp = _check_complete(src)
    units = plan(cfg, fmt, naming, include_mtp=include_mtp)
    shards = assign_shards(units, shard_bytes or DEFAULT_SHARD_BYTES)
    shard_files = [shard_name(i, len(shards)) for i in range(len(shards))]
    report = ConvertReport(dst, fmt, naming, output_dialect(fmt, naming), src.dialect, len(shards),
                           *plan_totals(units))
    if src.lacks_mtp:
        report.notes.append(f"{NO_MTP_NOTE} (the source holds no mtp.* tensor, nor does the output)")
    _prepare(dst, src.path, overwrite)

    written: list[Path] = []
    writer: ShardWriter | None = None
    shard_of = {t.key: i for i, shard in enumerate(shards) for t in shard}
    bar = _progress_bar(report.bytes, f"convert -> {fmt}", progress)
    try:
        for unit in units:
            produced = produce_unit(src, unit, report.paths)
            for t in unit.tensors:
                i = shard_of[t.key]
                if writer is None or writer.path.name != shard_files[i]:
                    if writer is not None:
                        writer.close()
                    writer = ShardWriter(dst / shard_files[i], shards[i])
                    written.append(writer.path)
                writer.write(t.key, produced[t.canonical])
                if bar is not None:
                    bar.update(t.nbytes)
        if writer is not None:
            writer.close()
    except BaseException:
        if writer is not None:
            writer.abort()
        for path in written:
            path.unlink(missing_ok=True)
        raise
    finally:
        if bar is not None:
            bar.close()
    write_index(dst, shards, shard_files)
    quant = hf_quant_config(fmt, naming, units, _dsv4_version())
    if quant is not None:
        (dst / "hf_quant_config.json").write_text(json.dumps(quant, indent=2) + "\n")
    (dst / "config.json").write_text(json.dumps(config_json(cfg, fmt, naming, quant), indent=2) + "\n")
    return report


def _dsv4_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dsv4")
    except PackageNotFoundError:
        return "source"


def _check_complete(src: Checkpoint) -> bool:
    """Refuse a source missing tensors (an MTP block held in part included); returns whether it has MTP blocks."""
    problems = src.incomplete()
    if problems:
        raise CheckpointError(f"{src.path}: " + "; ".join(problems))
    return src.has_mtp()


def _prepare(dst: Path, src_path: Path, overwrite: bool) -> None:
    if dst.exists() and dst.resolve() == Path(src_path).resolve():
        raise CheckpointError(f"{dst}: the destination is the source checkpoint")
    dst.mkdir(parents=True, exist_ok=True)
    existing = [p for p in dst.iterdir() if p.name in OUTPUT_FILES or p.suffix == ".safetensors"]
    if existing and not overwrite:
        raise CheckpointError(f"{dst}: already holds a checkpoint ({existing[0].name}, ...); "
                              "choose an empty folder or pass --overwrite")
    for p in existing:
        p.unlink()


def _progress_bar(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc)


# ------------------------------------------------------------------------------------------ producing
def produce_unit(src: Checkpoint, unit: Unit, paths: Counter) -> dict[str, torch.Tensor]:
    """The unit's output tensors by canonical name, exactly as planned (dtype and shape)."""
    storage = unit.storage
    if storage in PLAIN_STORAGE_DTYPES:
        dtype = DTYPES[PLAIN_STORAGE_DTYPES[storage]]
        plain = {}
        for spec in unit.specs:
            if spec.module in src.formats and src.formats[spec.module] != "dense":
                paths[f"{storage} dequantized"] += 1
                plain[spec.name] = src.qweight(spec.module).dequantize(torch.float32).to(dtype)
                continue
            value = src.tensors[spec.name].load()
            paths[f"{storage} {'copied' if value.dtype == dtype else 'cast'}"] += 1
            plain[spec.name] = value.to(dtype)
        return plain
    out: dict[str, torch.Tensor] = {}
    modules = [s.module for s in unit.specs]
    if storage == "nvfp4":
        for module, leaves in zip(modules, _to_nvfp4(src, modules, paths)):
            out.update({f"{module}.{leaf}": t for leaf, t in leaves.items()})
        return out
    for module in modules:
        fmt = src.formats[module]
        q = src.qweight(module)
        if storage == "fp8":
            if fmt == "fp8" and q.scale.dtype == UE8M0_DTYPE:
                weight, scale, path = q.weight, q.scale, "copied"
            else:
                weight, scale = quantize_fp8_block(q.dequantize(torch.float32), UE8M0_DTYPE)
                path = "quantized" if fmt == "dense" else "requantized"
        elif storage == "mxfp4":
            if fmt == "mxfp4":
                weight, scale, path = q.weight, q.scale, "copied"
            else:
                weight, scale = quantize_mxfp4(q.dequantize(torch.float32))
                path = "quantized" if fmt == "dense" else "requantized"
            weight = weight.view(torch.int8)  # DeepSeek stores packed FP4 as I8
        else:
            raise ValueError(f"unknown storage {storage!r}")
        paths[f"{storage} {path}"] += 1
        out[f"{module}.weight"], out[f"{module}.scale"] = weight, scale
    return out


def _to_nvfp4(src: Checkpoint, modules: list[str], paths: Counter) -> list[dict[str, torch.Tensor]]:
    """NVFP4 leaves of one linear, or of an expert's w1 and w3 (which then share weight_scale_2)."""
    fmts = [src.formats[m] for m in modules]
    qs = [src.qweight(m) for m in modules]
    one = torch.ones((), dtype=torch.float32)
    if all(f == "nvfp4" for f in fmts):
        paths["nvfp4 copied"] += len(modules)
        return [{"weight": q.weight, "weight_scale": q.scale, "weight_scale_2": q.scale_2,
                 "input_scale": q.input_scale if q.input_scale is not None else one} for q in qs]
    if all(f == "mxfp4" for f in fmts):
        # One k_max for w1 and w3 (the larger of their own), so they share weight_scale_2.
        k_max = max(int(mxfp4_k_max(q.weight, q.scale)) for q in qs)
        try:
            reblocked = [mxfp4_to_nvfp4(q.weight, q.scale, k_max) for q in qs]
        except ValueError:
            paths["nvfp4 reblock-refused (requantized)"] += len(modules)
        else:
            paths["nvfp4 reblocked"] += len(modules)
            return [{"weight": w, "weight_scale": ws, "weight_scale_2": ws2, "input_scale": one}
                    for w, ws, ws2 in reblocked]
    else:
        for f in fmts:
            paths[f"nvfp4 {'quantized' if f == 'dense' else 'requantized'}"] += 1
    dense = [q.dequantize(torch.float32) for q in qs]
    # ModelOpt syncs w1/w3 amax so serving engines can fuse them with one global scale.
    shared = nvfp4_global_scale(max(w.abs().amax() for w in dense))
    out = []
    for w in dense:
        packed, ws, ws2 = quantize_nvfp4(w, shared)
        out.append({"weight": packed, "weight_scale": ws, "weight_scale_2": ws2, "input_scale": one})
    return out
