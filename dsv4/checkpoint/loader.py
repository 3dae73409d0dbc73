"""`dsv4.load`: a checkpoint of any dialect and format into a `Transformer`, strictly.

1. `open_checkpoint` renames every key into canonical names and recognises each linear's storage format.
2. The formats of model modules are derived from the tensors present (a stacked group, e.g. all w1/w3 of
   a layer's experts, must share one format, fp8 scale dtype and input_scale presence) and cross-checked
   against config.json (quantization_config, expert_dtype).
3. The model is built on the meta device; then each of its persistent buffers is matched with the
   canonical tensors that fill it (one for a plain buffer, one per leading index for stacked experts).
   Every checkpoint tensor must fill exactly one piece and every piece must be filled, with the right
   shape and a dtype the buffer can take; all problems are reported together in one CheckpointError
   naming checkpoint keys and files. A checkpoint without any `mtp.*` tensor is built without MTP blocks,
   and the load logs NO_MTP_NOTE once (WARNING, logger `dsv4.checkpoint.loader`); one with some must hold
   every MTP block of config.json.
4. Buffers are materialised one at a time from the memory-mapped shards: an unstacked tensor is used as
   read (cast or moved only if needed), a stacked buffer is allocated once and each piece copied into it.

One rank of several (`shard`, a `parallel.Shard`) builds its part of the model and reads only its slices of each
tensor (`shards.region`, through safetensors' get_slice), after the same whole-model accounting as one process;
`layout_plan` plans every rank of a layout from the headers and checks that the ranks' slices tile every tensor.
"""

from __future__ import annotations

import logging
import re
from itertools import product
from pathlib import Path
from types import MappingProxyType

import torch

from ..kernels import Ops, ops_for
from ..model import LinearFormat, QLinear, Transformer, build_model
from ..model.moe import Gate
from ..parallel import Communicator, Layout, LayoutError, Shard
from . import names
from .canonical import FLOAT_DTYPES, INT_DTYPES, NO_MTP_NOTE, CanonicalTensor, Checkpoint, open_checkpoint
from .errors import CheckpointError
from .shards import LayoutPlan, check_tiling, numel, region, region_shape

logger = logging.getLogger(__name__)
MAX_LISTED = 60
# Canonical names of expert shards -> stacked model buffers (the only names that differ).
_EXPERT = re.compile(r"^(?P<ffn>(?:layers|mtp)\.\d+\.ffn)\.experts\.(?P<e>\d+)\.(?P<w>w[123])\.(?P<leaf>\w+)$")
_SHARED = re.compile(r"^(?P<ffn>(?:layers|mtp)\.\d+\.ffn)\.shared_experts\.(?P<w>w[123])\.(?P<leaf>\w+)$")
_SHARD = MappingProxyType({"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", None)})
_STACKED = re.compile(r"^(?P<ffn>(?:layers|mtp)\.\d+\.ffn)\.(?P<group>experts|shared_experts)\.(?P<w>w13|w2)$")


def model_target(canonical: str) -> tuple[str, tuple[int, ...]]:
    """Canonical tensor name -> (model buffer key, leading index into it)."""
    for pattern, group in ((_EXPERT, "experts"), (_SHARED, "shared_experts")):
        m = pattern.match(canonical)
        if m:
            stacked, half = _SHARD[m["w"]]
            index = (int(m["e"]),) if group == "experts" else ()
            index += () if half is None else (half,)
            return f"{m['ffn']}.{group}.{stacked}.{m['leaf']}", index
    return canonical, ()


def canonical_name(buffer_key: str, index: tuple[int, ...]) -> str:
    """Inverse of `model_target`: the canonical tensor filling `buffer_key[index]`."""
    module, _, leaf = buffer_key.rpartition(".")
    m = _STACKED.match(module)
    if not m:
        return buffer_key
    w = m["w"] if m["w"] == "w2" else ("w1", "w3")[index[-1]]
    expert = f".{index[0]}" if m["group"] == "experts" else ""
    return f"{m['ffn']}.{m['group']}{expert}.{w}.{leaf}"


# ------------------------------------------------------------------------------------------ formats
def _linear_format(ckpt: Checkpoint, module: str) -> LinearFormat:
    fmt, t = ckpt.formats[module], ckpt.tensors
    if fmt == "fp8":
        return LinearFormat(fmt, scale_dtype=t[f"{module}.scale"].dtype)
    return LinearFormat(fmt, input_scale=fmt == "nvfp4" and f"{module}.input_scale" in t)


def model_formats(ckpt: Checkpoint, problems: list[str]) -> dict[str, LinearFormat]:
    """Format of every model linear, from the checkpoint's canonical modules; stacked groups must agree."""
    groups: dict[str, dict[LinearFormat, list[str]]] = {}
    for module in ckpt.formats:
        target = model_target(f"{module}.weight")[0].rpartition(".")[0]
        groups.setdefault(target, {}).setdefault(_linear_format(ckpt, module), []).append(module)
    out = {}
    for target, by_format in groups.items():
        if len(by_format) > 1:
            parts = []
            for fmt, members in by_format.items():
                t = ckpt.tensors[f"{members[0]}.weight"] if f"{members[0]}.weight" in ckpt.tensors else None
                where = f" (e.g. {t.source!r} in {t.file})" if t else ""
                parts.append(f"{_describe(fmt)}: {len(members)} shard(s){where}")
            problems.append(f"stacked {target} mixes storage formats, which one buffer cannot hold: "
                            + "; ".join(parts))
            continue
        out[target] = next(iter(by_format))
    return out


def _describe(fmt: LinearFormat) -> str:
    if fmt.fmt == "fp8":
        return f"fp8 with {fmt.scale_dtype} scales"
    if fmt.fmt == "nvfp4":
        return "nvfp4 " + ("with" if fmt.input_scale else "without") + " input_scale"
    return fmt.fmt


def check_config(ckpt: Checkpoint, formats: dict[str, LinearFormat], problems: list[str]) -> None:
    """The storage found must be what config.json declares (quantization_config, expert_dtype).

    FP8 blocks must be declared by `quant_method: "fp8"`, as DeepSeek's release and ModelOpt's DeepSeek-V4 recipe
    (which marks its NVFP4 experts with `moe_quant_algo`) declare them. Under any other quant_method, ModelOpt's
    "modelopt" included, the modules a manifest excludes are unquantized by declaration, so FP8 blocks contradict
    the config: refused, naming a stored FP8 tensor and the config key.
    """
    cfg, qc = ckpt.config, ckpt.config.quantization_config or {}
    stored: dict[str, str] = {}   # storage format -> the first linear stored in it
    for module, fmt in sorted(ckpt.formats.items()):
        stored.setdefault(fmt, module)
    if "fp8" in stored:
        weight, scale = (ckpt.tensors[f"{stored['fp8']}.{leaf}"] for leaf in ("weight", "scale"))
        if qc.get("quant_method") != "fp8":
            problems.append(f"config.json: quantization_config.quant_method is {qc.get('quant_method')!r}, not "
                            f"'fp8', but {_where(weight)} is stored as FP8 blocks with scales {scale.source!r}; "
                            "FP8 blocks are read only where config.json declares quant_method 'fp8' (as DeepSeek's "
                            "release and ModelOpt's DeepSeek-V4 recipe, with moe_quant_algo 'NVFP4', do)")
        elif list(qc.get("weight_block_size", [128, 128])) != [128, 128]:
            problems.append(f"config.json: quantization_config.weight_block_size {qc['weight_block_size']} but "
                            f"the FP8 scales {_where(scale)} are on a 128x128 grid")
    if {"mxfp4", "nvfp4"} & set(stored) and not qc and not (ckpt.path / "hf_quant_config.json").exists():
        weight = ckpt.tensors[f"{stored.get('mxfp4') or stored['nvfp4']}.weight"]
        problems.append(f"config.json has no quantization_config (and there is no hf_quant_config.json) but "
                        f"{_where(weight)} is stored in 4 bits")
    experts = {f.fmt for m, f in formats.items() if m.endswith(".ffn.experts.w13") or m.endswith(".ffn.experts.w2")}
    allowed = {"fp4": {"mxfp4", "nvfp4"}, "fp8": {"fp8"}, None: {"dense", "nvfp4"}}[cfg.expert_dtype]
    if experts - allowed:
        problems.append(f"config.json: expert_dtype is {cfg.expert_dtype!r} but routed experts are stored as "
                        f"{sorted(experts - allowed)}")


# ------------------------------------------------------------------------------------------ accounting
def _pieces(module: torch.nn.Module) -> list[tuple[int, ...]]:
    """Leading indices of a buffer: one per stacked shard of a QLinear, [()] for everything else."""
    lead = module.leading if isinstance(module, QLinear) else ()
    return list(product(*(range(d) for d in lead)))


_QUANT_LEAVES = ("scale", "weight_scale", "weight_scale_2", "input_scale")


def _accepts(module: torch.nn.Module, leaf: str, stored: torch.dtype, target: torch.dtype) -> bool:
    """Quantized storage must match exactly; float tensors (norms, dense weights...) may be cast; ints widened."""
    if stored == target:
        return True
    if isinstance(module, QLinear) and (leaf in _QUANT_LEAVES or (leaf == "weight" and module.format.fmt != "dense")):
        return False
    if target in FLOAT_DTYPES:
        return stored in FLOAT_DTYPES
    return target == torch.int64 and stored in INT_DTYPES


def _where(ct: CanonicalTensor) -> str:
    alias = f" (canonical {ct.name})" if ct.name != ct.source else ""
    return f"{ct.source!r} in {ct.file}{alias}"


def _expected_key(ckpt: Checkpoint, canonical: str) -> str:
    try:
        key = names.dialect_key(canonical, ckpt.dialect)
    except ValueError:
        return repr(canonical)
    return repr(key) if key == canonical else f"{key!r} (canonical {canonical})"


def plan_fill(model: Transformer, ckpt: Checkpoint, problems: list[str], shard: Shard | None = None) -> dict[str, list]:
    """buffer key -> [(index, CanonicalTensor, region)] for every persistent buffer; problems collected, not raised.

    One process (shard None): every tensor read whole (region None), and a tensor that fills nothing is a problem.
    One rank's part (`shard`): each piece is the rank's region of its tensor (`shards.region`); a stacked expert
    buffer's index i holds expert `shard.experts[i]`; tensors of other ranks are not this plan's business
    (`layout_plan` checks the whole layout)."""
    plan: dict[str, list] = {}
    used: set[str] = set()
    missing: list[str] = []
    for path, module in model.named_modules():
        for leaf, buf in module._buffers.items():
            if leaf in module._non_persistent_buffers_set:
                continue
            key = f"{path}.{leaf}" if path else leaf
            plan[key] = []
            for index in _pieces(module):
                name = canonical_name(key, _global_index(key, index, shard))
                ct = ckpt.tensors.get(name)
                if ct is None:
                    missing.append(name)
                    continue
                used.add(name)
                want = tuple(buf.shape[len(index):])
                try:
                    where = None if shard is None else region(name, ct.shape, _format_of(ckpt, name),
                                                              shard.split(name))
                except LayoutError as e:
                    problems.append(str(e))
                    continue
                if region_shape(ct.shape, where) != want or not _accepts(module, leaf, ct.dtype, buf.dtype):
                    part = "" if where is None else f" (this rank's part {list(region_shape(ct.shape, where))})"
                    problems.append(f"mismatched: {_where(ct)} is {ct.dtype} {list(ct.shape)}{part}; the model "
                                    f"needs {buf.dtype} {list(want)}")
                    continue
                plan[key].append((index, ct, where))
    if missing:
        problems.extend(_missing_summary(ckpt, missing))
    if shard is None:
        for name in sorted(set(ckpt.tensors) - used):
            problems.append(f"unexpected: {_where(ckpt.tensors[name])} fills nothing in the model")
    return plan


def _global_index(key: str, index: tuple[int, ...], shard: Shard | None) -> tuple[int, ...]:
    """A stacked buffer's leading index -> the canonical one (expert parallel: local expert i is shard.experts[i])."""
    if shard is None or not index or ".ffn.experts." not in key:
        return index
    return (shard.experts[index[0]], *index[1:])


def _format_of(ckpt: Checkpoint, name: str) -> str | None:
    """The stored format of the linear canonical tensor `name` belongs to; None for a plain tensor."""
    return ckpt.formats.get(name.rpartition(".")[0])


def _missing_summary(ckpt: Checkpoint, missing: list[str]) -> list[str]:
    out = []
    layers_present = {int(n.split(".")[1]) for n in ckpt.tensors if n.startswith("layers.")}
    absent = sorted({int(n.split(".")[1]) for n in missing if n.startswith("layers.")} - layers_present)
    if absent:
        out.append(f"config.json: num_hidden_layers is {ckpt.config.num_hidden_layers} but the checkpoint has no "
                   f"tensor at all for layers {absent}")
    mtp = ckpt.mtp_incomplete()
    out += [mtp] if mtp else []
    out += [f"missing: {_expected_key(ckpt, name)}" for name in missing]
    return out


def _raise(ckpt: Checkpoint, problems: list[str]) -> None:
    if not problems:
        return
    shown = problems[:MAX_LISTED]
    more = f"\n  ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
    raise CheckpointError(f"cannot load {ckpt.path} ({ckpt.dialect} dialect): {len(problems)} problem(s)\n  "
                          + "\n  ".join(shown) + more)


# ------------------------------------------------------------------------------------------ filling
def fill(model: Transformer, plan: dict[str, list], device: torch.device, progress: bool = False) -> None:
    """Materialise every buffer of `model` from the planned checkpoint pieces (each read once, only its region)."""
    modules = dict(model.named_modules())
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=planned_bytes(plan), unit="B", unit_scale=True, unit_divisor=1024, desc="loading")
    for key, pieces in plan.items():
        path, _, leaf = key.rpartition(".")
        module = modules[path]
        meta = module._buffers[leaf]
        if len(pieces) == 1 and pieces[0][0] == ():
            value = pieces[0][1].load_region(pieces[0][2]).to(device=device, dtype=meta.dtype)
        else:
            value = torch.empty(meta.shape, dtype=meta.dtype, device=device)
            for index, ct, where in pieces:
                value[index].copy_(ct.load_region(where))
        module._buffers[leaf] = value
        if bar is not None:
            bar.update(planned_bytes({key: pieces}))
    if bar is not None:
        bar.close()
    for module in modules.values():
        for leaf in module._non_persistent_buffers_set:
            module._buffers[leaf] = module._buffers[leaf].to(device)


def planned_bytes(plan: dict[str, list]) -> int:
    """Bytes the plan reads (each piece's region)."""
    return sum(numel(region_shape(ct.shape, where)) * ct.dtype.itemsize
               for pieces in plan.values() for _, ct, where in pieces)


def check_values(model: Transformer, plan: dict[str, list]) -> None:
    """Values the forward would misuse silently: hash tables must name existing experts."""
    problems = []
    for path, module in model.named_modules():
        if isinstance(module, Gate) and module.hash:
            t = module.tid2eid
            bad = (t < 0) | (t >= module.out_features)
            if bool(bad.any()):
                ct = plan[f"{path}.tid2eid"][0][1]
                row, col = (int(i) for i in bad.nonzero()[0])
                problems.append(f"{_where(ct)}: expert id {int(t[row, col])} at [{row}, {col}] is outside "
                                f"[0, n_routed_experts={module.out_features}) ({int(bad.sum())} such entries)")
    if problems:
        raise CheckpointError("checkpoint refused:\n  " + "\n  ".join(problems))


def layout_plan(ckpt: Checkpoint, layout: Layout) -> LayoutPlan:
    """Every rank of `layout` planned from the headers (no tensor data read): the whole-model accounting of one
    process, each rank's slices (refused where a slice cuts a quantization block), and the check that the ranks'
    slices of each tensor tile it exactly once. Returns bytes and layers per rank and the problems."""
    problems: list[str] = []
    formats = model_formats(ckpt, problems)
    cfg = ckpt.config
    try:
        layout.check(cfg)
    except LayoutError as e:
        return LayoutPlan(layout, [], [], [str(e)])
    shards = layout.shards(cfg)
    out = LayoutPlan(layout, [], [s.layers for s in shards], problems)
    if problems:
        return out
    check_config(ckpt, formats, problems)
    plan_fill(build_model(cfg, formats, mtp=ckpt.has_mtp()), ckpt, problems)
    for shard in shards:
        plan = plan_fill(build_model(cfg, formats, mtp=ckpt.has_mtp(), shard=shard), ckpt, problems, shard)
        out.bytes_per_rank.append(planned_bytes(plan))
        for pieces in plan.values():
            for _, ct, where in pieces:
                out.reads.setdefault(ct.name, {}).setdefault(where and _hashable(where), []).append(shard.rank)
    for name, ct in ckpt.tensors.items():
        if name not in out.reads:
            continue        # the whole-model accounting above names it (unexpected)
        check_tiling(name, ct.shape, [r and _unhashable(r) for r in out.reads[name]], problems)
    out.problems = _collapsed(problems)
    return out


def _collapsed(problems: list[str]) -> list[str]:
    """Each problem once, and of problems that differ only in numbers (layer, expert, slice) the first, with a count
    of the others."""
    first: dict[str, str] = {}
    count: dict[str, int] = {}
    for p in problems:
        key = re.sub(r"\d+", "#", p)
        first.setdefault(key, p)
        count[key] = count.get(key, 0) + (p != first[key] or count.get(key, 0) == 0)
    return [first[k] + (f" (and {count[k] - 1} more like it)" if count[k] > 1 else "") for k in first]


def _hashable(where: tuple) -> tuple:
    return tuple((s.start, s.stop) for s in where)


def _unhashable(key: tuple) -> tuple:
    return tuple(slice(a, b) for a, b in key)


# ------------------------------------------------------------------------------------------ entry points
def load_checkpoint(ckpt: Checkpoint, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                    ops: Ops | None = None, progress: bool = False, tile_weights: bool | None = None,
                    shard: Shard | None = None, comm: Communicator | None = None) -> Transformer:
    device = torch.device(device)
    ops = ops or ops_for(device)
    problems: list[str] = []
    formats = model_formats(ckpt, problems)
    can_build = not problems       # a stacked group in two formats leaves the model's layout undefined
    check_config(ckpt, formats, problems)
    model = plan = None
    if can_build:
        # Without any mtp.* tensor the model is built without MTP blocks; with some, every block is required.
        model = build_model(ckpt.config, formats, dtype, ops, mtp=ckpt.has_mtp())
        plan = plan_fill(model, ckpt, problems)
        if shard is not None and not problems:     # the same accounting as one process, then this rank's part
            model = build_model(ckpt.config, formats, dtype, ops, mtp=ckpt.has_mtp(), shard=shard, comm=comm)
            plan = plan_fill(model, ckpt, problems, shard)
    _raise(ckpt, problems)
    fill(model, plan, device, progress)
    check_values(model, plan)
    if tile_weights is None:   # only the GPU kernels gain from it; the reference would untile at every call
        tile_weights = device.type == "cuda" and ops.reads_tiled
    if tile_weights:
        model.prepare_for_kernels_()
    if ckpt.lacks_mtp:
        logger.warning("%s: %s", ckpt.path, NO_MTP_NOTE)
    return model


def load(path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
         ops: Ops | None = None, progress: bool = False, tile_weights: bool | None = None,
         shard: Shard | None = None, comm: Communicator | None = None) -> Transformer:
    """Load a DeepSeek-V4 checkpoint folder (any dialect, any format) as a ready model.

    `model.logits(input_ids)` maps LongTensor [B, S] to logits [B, S, vocab] (causal prefill from position 0).
    dtype is the compute dtype (dense weights, activations); quantized weights stay as stored and are
    dequantized exactly. ops: the kernel table the model computes with, the caller's choice (`kernels.ops_for`;
    `Ops.triton(w4a4=True)` emulates NVFP4 W4A4 GEMMs, Blackwell numerics, for NVFP4 layers that carry an
    input_scale); None = `ops_for(device)`, the device's exact default. progress=True shows a progress bar (bytes
    read) on stderr. tile_weights: lay the weights out for the GPU kernels (`Transformer.prepare_for_kernels_`:
    quantized weights tile-major, `formats.tiling`; each attention's dense projections of x as one product); None =
    on CUDA where the table's kernels read them.
    shard / comm: load one rank's part of the model (`parallel.Shard`) reading only its slices, its collectives
    through `comm` (the runtime's workers do this; docs/parallel.md).
    """
    return load_checkpoint(open_checkpoint(path), device, dtype, ops, progress, tile_weights, shard, comm)
