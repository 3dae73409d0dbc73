"""A checkpoint seen through canonical names: `open_checkpoint(path)` (docs/architecture.md "Checkpoint API").

Opening reads headers only. Every key is renamed through its dialect's table (names.py); stacked keys
become one canonical piece per expert; then every canonical tensor is checked against the config
(`spec.model_specs`): unknown names, duplicates, and dtypes or shapes that fit no storage format are
collected and refused in one CheckpointError that names each file and key. Missing tensors are not an
error here; `Checkpoint.missing()` lists them for the loader, inspect and convert.

The MTP block, in every dialect: a checkpoint holding no `mtp.*` tensor at all is the main model alone
(quantized and converted builds often drop the block, transformers always does) and loads without one;
a checkpoint holding any `mtp.*` tensor must hold every MTP block of config.json in full.

Storage formats of a linear module, recognised from its leaves and dtypes (K = in_features):
    dense  weight [N, K] f32/bf16/f16
    fp8    weight [N, K] float8_e4m3fn, scale [ceil(N/128), ceil(K/128)] e8m0 or f32
    mxfp4  weight [N, K/2] packed, scale [N, K/32] e8m0
    nvfp4  weight [N, K/2] packed, weight_scale [N, K/16] e4m3, weight_scale_2 [] f32, input_scale [] f32 (optional)
Packed FP4 (U8, I8 or F4 in the file) is presented as uint8 bytes; a `.scale` stored as U8 is UE8M0
bytes and is presented as float8_e8m0fnu.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..config import ConfigError, ModelConfig
from ..formats import FP8_BLOCK, MXFP4_BLOCK, NVFP4_BLOCK, QWeight
from . import names
from .errors import CheckpointError
from .reader import DTYPES, ShardReader, StoredTensor, scan
from .spec import TensorSpec, model_specs

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT_DTYPES = (torch.int64, torch.int32)
PACKED = torch.uint8
E8M0 = torch.float8_e8m0fnu
CANONICAL_LEAVES = ("weight", "scale", "weight_scale", "weight_scale_2", "input_scale")
MAX_LISTED_PROBLEMS = 40
MISSING_EXAMPLES = 8
# What inspect, the load log and convert say about a checkpoint without its MTP block (the audit's problem name).
NO_MTP = "no MTP block"
NO_MTP_NOTE = f"{NO_MTP}: speculative decoding unavailable"


@dataclass(frozen=True)
class CanonicalTensor:
    name: str                      # canonical name with leaf: "layers.3.ffn.experts.5.w1.weight_scale_2"
    source: str                    # the checkpoint key it comes from (a stacked source yields several)
    file: str                      # shard file holding `source`
    dtype: torch.dtype             # stored dtype (uint8 for packed FP4 whatever the file says: U8/I8/F4)
    shape: tuple[int, ...]         # stored shape of this canonical piece (bytes along K for packed FP4)
    load: Callable[[], torch.Tensor] = field(repr=False, compare=False)  # memory-mapped read
    # memory-mapped read of a region (a tuple of slices of `shape`) without reading the rest; None: load() sliced
    read: Callable[[tuple], torch.Tensor] | None = field(default=None, repr=False, compare=False)

    def load_region(self, region: tuple | None) -> torch.Tensor:
        """The whole tensor (region None) or `tensor[region]`, reading only that region from a file."""
        if region is None:
            return self.load()
        return self.load()[region] if self.read is None else self.read(region)

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty(0, dtype=self.dtype).element_size()


@dataclass
class Checkpoint:
    path: Path
    config: ModelConfig            # from config.json (either dialect)
    dialect: str                   # "deepseek" | "hf-stacked" | "hf-experts" | "hf-saved"
    tensors: dict[str, CanonicalTensor]   # by canonical name; two keys mapping to one name is an error
    sources: dict[str, str]        # every checkpoint key -> its file (for accounting and messages)
    formats: dict[str, str] = field(default_factory=dict)   # linear module -> dense | fp8 | mxfp4 | nvfp4
    problems: list[str] = field(default_factory=list)       # only `survey_checkpoint` returns any

    def specs(self) -> list[TensorSpec]:
        """The canonical tensors the checkpoint must hold: the main model, and every MTP block of the config
        unless the checkpoint holds no `mtp.*` tensor at all."""
        return model_specs(self.config, include_mtp=self.has_mtp())

    def missing(self) -> list[str]:
        """Tensors of `specs()` that the checkpoint lacks (a linear counts once, by `.weight`)."""
        return [s.name for s in self.specs() if s.name not in self.tensors]

    def has_mtp(self) -> bool:
        """Whether any `mtp.*` tensor is present (then every MTP block of the config is required)."""
        return any(n.startswith("mtp.") for n in self.tensors)

    @property
    def lacks_mtp(self) -> bool:
        """config.json declares MTP blocks and the checkpoint holds no `mtp.*` tensor (NO_MTP_NOTE)."""
        return self.config.num_nextn_predict_layers > 0 and not self.has_mtp()

    def incomplete(self) -> list[str]:
        """One line per part with missing tensors (the main model; MTP blocks held in part), with examples."""
        main = [n for n in self.missing() if not n.startswith("mtp.")]
        out = []
        if main:
            out.append(f"{len(main)} tensors of the model are missing, e.g. {', '.join(main[:MISSING_EXAMPLES])}")
        mtp = self.mtp_incomplete()
        return out + ([mtp] if mtp else [])

    def mtp_incomplete(self) -> str | None:
        """Why MTP blocks held in part are refused; None when they are whole or wholly absent."""
        mtp = [n for n in self.missing() if n.startswith("mtp.")]
        if not mtp:
            return None
        total = sum(1 for s in self.specs() if s.name.startswith("mtp."))
        return (f"the MTP block is incomplete: {len(mtp)} of its {total} tensors are missing, e.g. "
                f"{', '.join(mtp[:MISSING_EXAMPLES])} (a checkpoint holds every MTP block of config.json or no "
                "mtp.* tensor at all)")

    def qweight(self, module: str) -> QWeight:
        """Load linear `module` (e.g. `layers.3.attn.wq_a`) in its stored format."""
        fmt = self.formats[module]
        leaf = {k: self.tensors[f"{module}.{k}"].load() for k in CANONICAL_LEAVES if f"{module}.{k}" in self.tensors}
        if fmt == "nvfp4":
            return QWeight(fmt, leaf["weight"], leaf["weight_scale"], leaf["weight_scale_2"], leaf.get("input_scale"))
        return QWeight(fmt, leaf["weight"], leaf.get("scale"))


# --------------------------------------------------------------------------------------- opening
def open_checkpoint(path: str | Path) -> Checkpoint:
    """Header-only: reads config.json and the safetensors headers, no tensor data."""
    ckpt = survey_checkpoint(path)
    _raise(ckpt.problems, ckpt.path)
    return ckpt


def survey_checkpoint(path: str | Path) -> Checkpoint:
    """Like `open_checkpoint`, but per-tensor problems are listed in `.problems` instead of raised (inspect).

    Unreadable or truncated shards, a bad config.json and an unknown dialect still raise.
    """
    folder, stored = scan(Path(path))
    config = _read_config(folder)
    dialect = _detect(stored)
    reader = ShardReader()
    renamer = names.Renamer(dialect)
    problems: list[str] = []
    tensors: dict[str, CanonicalTensor] = {}

    def add(t: CanonicalTensor) -> None:
        if t.name in tensors:
            other = tensors[t.name]
            problems.append(f"{t.file}: {t.source!r} and {other.file}: {other.source!r} both give canonical "
                            f"tensor {t.name!r}")
        else:
            tensors[t.name] = t

    for key, st in stored.items():
        try:
            match = renamer.match(key)
        except ValueError as e:
            problems.append(f"{st.file}: {e}")
            continue
        if match is None:
            problems.append(f"{st.file}: tensor {key!r} matches no rule of dialect {dialect!r}")
            continue
        try:
            for piece in _pieces(match, st, config, reader):
                add(piece)
        except CheckpointError as e:
            problems.append(str(e))
    formats = _validate(tensors, config, problems)
    return Checkpoint(folder, config, dialect, tensors, {k: str(st.file) for k, st in stored.items()}, formats,
                      problems)


def in_memory_checkpoint(tensors: dict[str, torch.Tensor], config: ModelConfig, path: Path) -> Checkpoint:
    """Canonical tensors held in memory (make-tiny, tests) as a Checkpoint, validated like a file."""
    out = {}
    for name, t in tensors.items():
        if t.dtype == torch.int8 and name.endswith(".weight"):
            t = t.view(torch.uint8)
        out[name] = CanonicalTensor(name, name, "<memory>", t.dtype, tuple(t.shape), lambda t=t: t)
    problems: list[str] = []
    formats = _validate(out, config, problems)
    _raise(problems, path)
    return Checkpoint(Path(path), config, "deepseek", out, {n: "<memory>" for n in out}, formats)


def _read_config(folder: Path) -> ModelConfig:
    try:
        return ModelConfig.from_json(folder / "config.json")
    except ConfigError as e:
        raise CheckpointError(str(e)) from None


def _detect(stored: dict[str, StoredTensor]) -> str:
    found = names.detect_dialect(stored)
    if len(found) == 1:
        return found[0]
    if not found:
        sample = sorted(stored)[:5]
        files = sorted({str(t.file) for t in stored.values()})[:3]
        raise CheckpointError(f"unknown checkpoint dialect in {', '.join(files)}: no key looks like any of "
                              f"{', '.join(names.DIALECTS)} (first keys: {sample})")
    examples = []
    for dialect in found:
        marker = names.MARKERS[dialect]
        key = next(k for k in sorted(stored) if re.match(marker, k))
        examples.append(f"{key!r} in {stored[key].file} is {dialect}")
    raise CheckpointError("keys of several dialects in one checkpoint: " + "; ".join(examples))


def _presented(st: StoredTensor, leaf: str) -> tuple[torch.dtype, tuple[int, ...], Callable | None]:
    """dtype and shape a stored tensor is presented with, and the view that turns a load into it."""
    if leaf == "weight" and st.dtype in ("U8", "I8", "F4"):
        return PACKED, st.byte_shape, lambda t: t.view(PACKED)  # packed FP4, two codes per byte
    if leaf == "scale" and st.dtype == "U8":
        return E8M0, st.shape, lambda t: t.view(E8M0)  # UE8M0 exponent bytes
    return DTYPES[st.dtype], st.shape, None


def _pieces(match: names.Match, st: StoredTensor, config: ModelConfig, reader: ShardReader):
    rule = match.rule
    name = match.canonical() if rule.transform is None else rule.canonical  # stacked rules spell their leaf
    dtype, shape, view = _presented(st, name.rpartition(".")[2])
    file = str(st.file)

    def loader(index: tuple | None) -> Callable[[], torch.Tensor]:
        def load() -> torch.Tensor:
            value = reader.load(st, index)
            return view(value) if view else value
        return load

    def region_reader(index: tuple | None) -> Callable[[tuple], torch.Tensor]:
        return lambda region: loader(_within(index, region))()

    if rule.transform is None:
        yield CanonicalTensor(name, st.key, file, dtype, tuple(shape), loader(None), region_reader(None))
        return
    E = config.n_routed_experts
    if len(shape) != 3 or shape[0] != E:
        raise CheckpointError(f"{file}: stacked tensor {st.key!r} has shape {list(st.shape)}; expected "
                              f"[n_routed_experts={E}, rows, cols]")
    if rule.transform == names.SPLIT_EXPERTS:
        for e in range(E):
            yield CanonicalTensor(match.canonical(expert=str(e)), st.key, file, dtype, tuple(shape[1:]),
                                  loader((e,)), region_reader((e,)))
        return
    rows = shape[1]
    if rows % 2:
        raise CheckpointError(f"{file}: stacked gate/up tensor {st.key!r} has an odd row count {rows}")
    half = rows // 2
    for e in range(E):
        # w1 (gate) rows come first, then w3 (up): transformers' Concatenate(dim=1) of [w1, w3].
        for w, rows_slice in (("w1", slice(0, half)), ("w3", slice(half, rows))):
            yield CanonicalTensor(match.canonical(expert=str(e), w13=w), st.key, file, dtype,
                                  (half, *shape[2:]), loader((e, rows_slice)), region_reader((e, rows_slice)))


def _within(index: tuple | None, region: tuple) -> tuple:
    """The index into a stored tensor of `region` (slices with explicit bounds, or slice(None)) of the piece that
    `index` (ints and bounded slices, e.g. (expert, rows of w1)) cuts from it."""
    out, rest = [], list(region)
    for part in index or ():
        if isinstance(part, int) or not rest:
            out.append(part)
            continue
        r = rest.pop(0)
        start = part.start + (r.start or 0)
        out.append(slice(start, part.stop if r.stop is None else part.start + r.stop))
    return (*out, *rest)


# --------------------------------------------------------------------------------------- validation
def _where(t: CanonicalTensor) -> str:
    return f"{t.file}: {t.source!r}" + (f" (canonical {t.name!r})" if t.name != t.source else "")


def expected_linear_shapes(fmt: str, n: int, k: int) -> dict[str, tuple[int, ...]]:
    if fmt == "dense":
        return {"weight": (n, k)}
    if fmt == "fp8":
        return {"weight": (n, k), "scale": (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK))}
    if fmt == "mxfp4":
        return {"weight": (n, k // 2), "scale": (n, k // MXFP4_BLOCK)}
    if fmt == "nvfp4":
        return {"weight": (n, k // 2), "weight_scale": (n, k // NVFP4_BLOCK), "weight_scale_2": (),
                "input_scale": ()}
    raise ValueError(fmt)


def linear_format(leaves: dict[str, torch.dtype]) -> str | None:
    """The storage format a linear's leaves (leaf -> dtype) spell, or None if none fits."""
    keys, w = set(leaves), leaves.get("weight")
    if keys == {"weight"} and w in FLOAT_DTYPES:
        return "dense"
    if keys == {"weight", "scale"} and w == torch.float8_e4m3fn and leaves["scale"] in (E8M0, torch.float32):
        return "fp8"
    if keys == {"weight", "scale"} and w == PACKED and leaves["scale"] == E8M0:
        return "mxfp4"
    if ({"weight", "weight_scale", "weight_scale_2"} <= keys <= {"weight", "weight_scale", "weight_scale_2",
                                                               "input_scale"}
            and w == PACKED and leaves["weight_scale"] == torch.float8_e4m3fn
            and leaves["weight_scale_2"] == torch.float32 and leaves.get("input_scale", torch.float32) == torch.float32):
        return "nvfp4"
    return None


def _validate(tensors: dict[str, CanonicalTensor], config: ModelConfig, problems: list[str]) -> dict[str, str]:
    """Check every canonical tensor against the config; returns the format of every linear module present."""
    plain: dict[str, TensorSpec] = {}
    linear: dict[str, TensorSpec] = {}
    for spec in model_specs(config):
        if spec.is_linear:
            linear[spec.module] = spec
        else:
            plain[spec.name] = spec
    groups: dict[str, dict[str, CanonicalTensor]] = {}
    for name, t in tensors.items():
        if name in plain:
            spec = plain[name]
            ok_dtypes = INT_DTYPES if spec.dtype in INT_DTYPES else FLOAT_DTYPES
            if t.dtype not in ok_dtypes:
                problems.append(f"{_where(t)}: dtype {t.dtype} but config expects a "
                                f"{'integer' if ok_dtypes is INT_DTYPES else 'floating'} {spec.role} tensor")
            elif t.shape != spec.shape:
                problems.append(f"{_where(t)}: shape {list(t.shape)} but config expects {list(spec.shape)}")
            continue
        module, _, leaf = name.rpartition(".")
        if module in linear and leaf in CANONICAL_LEAVES:
            groups.setdefault(module, {})[leaf] = t
            continue
        problems.append(f"{_where(t)}: no tensor of this name in a V4 model with this config.json "
                        f"({config.num_hidden_layers} layers, {config.n_routed_experts} experts, "
                        f"compress_ratios {list(config.compress_ratios)})")
    formats = {}
    for module, leaves in groups.items():
        spec = linear[module]
        fmt = linear_format({leaf: t.dtype for leaf, t in leaves.items()})
        first = leaves.get("weight") or next(iter(leaves.values()))
        if fmt is None:
            desc = ", ".join(f"{leaf} {t.dtype}" for leaf, t in sorted(leaves.items()))
            problems.append(f"{_where(first)}: linear {module!r} has leaves ({desc}), which is none of the "
                            "formats dense / fp8 / mxfp4 / nvfp4")
            continue
        n, k = spec.shape
        for leaf, want in expected_linear_shapes(fmt, n, k).items():
            t = leaves.get(leaf)
            if t is not None and t.shape != want:
                problems.append(f"{_where(t)}: shape {list(t.shape)} but a {fmt} {leaf} of a [{n}, {k}] linear "
                                f"has shape {list(want)}")
        formats[module] = fmt
    return formats


def _raise(problems: list[str], where: Path) -> None:
    if not problems:
        return
    shown = problems[:MAX_LISTED_PROBLEMS]
    more = len(problems) - len(shown)
    text = f"checkpoint {where} refused ({len(problems)} problem{'s' if len(problems) > 1 else ''}):\n  " + \
        "\n  ".join(shown) + (f"\n  ... and {more} more" if more else "")
    raise CheckpointError(text)
