"""`dsv4 inspect`: what a checkpoint is (dialect, formats, bytes, parameters) and what dsv4 refuses in it.

Header-only by default. With `audit=True` it also loads the model and runs `dsv4.checkpoint.audit.audit`
(all-zero and non-finite parameters, duplicate hash routes), which reads every tensor. With a parallel `layout` it
also plans every rank (`loader.layout_plan`, headers only): weight bytes per rank, and a refusal for a layout the
model cannot be split into or whose largest rank's weights exceed `utilization` of `device_memory`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import torch

from ..config import count_parameters
from ..kernels import Ops
from ..parallel import Layout
from .audit import audit
from .canonical import NO_MTP, NO_MTP_NOTE, Checkpoint, survey_checkpoint
from .errors import CheckpointError
from .loader import check_config, layout_plan, load_checkpoint, model_formats
from .shards import LayoutPlan
from .spec import TID2EID, model_specs

# Report groups: role -> label (linears by what they do; plain tensors by kind).
GROUP_LABELS = MappingProxyType({
    "attn_linear": "attention wq_a/wq_b/wkv/wo_a/wo_b", "indexer_wq_b": "indexer wq_b",
    "indexer_weights": "indexer weights_proj", "compressor_linear": "compressor wkv/wgate",
    "router": "router gate", "shared_expert": "shared experts", "routed_expert": "routed experts",
    "mtp_proj": "MTP e_proj/h_proj", "embed": "embedding", "head": "head", "norm": "norms", "hc": "mHC",
    "sink": "attention sinks", "ape": "compressor ape", "gate_bias": "router bias", "tid2eid": "hash tid2eid",
})


@dataclass
class GroupStats:
    tensors: int = 0
    bytes: int = 0
    params: int = 0


@dataclass
class Inspection:
    path: Path
    dialect: str = ""
    summary: str = ""
    files: int = 0
    keys: int = 0
    groups: dict[tuple[str, str, str], GroupStats] = field(default_factory=dict)  # (part, group, format)
    params_present: dict[str, int] = field(default_factory=dict)   # part -> logical parameters present
    params_config: dict[str, int] = field(default_factory=dict)    # part -> logical parameters of the config
    missing: list[str] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    audit: object = None
    plan: LayoutPlan | None = None
    device_memory: int | None = None     # bytes of one device, for the plan's verdict
    config: object = None                # the checkpoint's ModelConfig, once read
    cache_tokens: list[int] | None = None   # per rank of the plan: cached tokens that fit beside its weights (set by
                                            # the caller that sizes caches; rendered as a column)

    @property
    def ok(self) -> bool:
        return not self.refusals

    def render(self) -> str:
        lines = [f"checkpoint {self.path}"]
        if self.dialect:
            lines += [f"  dialect   {self.dialect}", f"  model     {self.summary}",
                      f"  storage   {self.keys} keys in {self.files} file(s), "
                      f"{sum(g.bytes for g in self.groups.values()):,} bytes"]
            lines.append(f"  {'part':5s} {'group':36s} {'format':8s} {'tensors':>8s} {'bytes':>16s} {'params':>16s}")
            for (part, group, fmt), g in sorted(self.groups.items()):
                lines.append(f"  {part:5s} {group:36s} {fmt:8s} {g.tensors:8d} {g.bytes:16,d} {g.params:16,d}")
            for part in self.params_config:
                lines.append(f"  parameters ({part}): {self.params_present.get(part, 0):,} present of "
                             f"{self.params_config[part]:,} in the config (tid2eid excluded)")
        lines += self._render_plan()
        lines += [f"  note: {n}" for n in self.notes]
        if self.audit is not None:
            lines.append(f"  audit: {self.audit}")
        if self.refusals:
            lines.append(f"  REFUSED ({len(self.refusals)}):")
            lines += [f"    {r}" for r in self.refusals]
        else:
            lines.append("  no problems found")
        return "\n".join(lines)


    def _render_plan(self) -> list[str]:
        plan = self.plan
        if plan is None or not plan.bytes_per_rank:
            return []
        lay = plan.layout
        tokens = self.cache_tokens
        lines = [f"  plan      {lay.describe()}: {lay.world_size} ranks",
                 f"  {'rank':>5s} {'stage':>5s} {'tp':>3s} {'layers':>8s} {'weight bytes':>16s}"
                 + (f" {'cache tokens':>14s}" if tokens else "")]
        for rank, (size, layers) in enumerate(zip(plan.bytes_per_rank, plan.layers_per_rank)):
            span = f"{layers.start}-{layers.stop - 1}"
            lines.append(f"  {rank:5d} {rank // lay.tp:5d} {rank % lay.tp:3d} {span:>8s} {size:16,d}"
                         + (f" {tokens[rank]:14,d}" if tokens else ""))
        if self.device_memory is None:
            lines.append("  device memory unknown (no GPU here): give --device-memory for a verdict")
        return lines


def inspect_checkpoint(path: str | Path, audit: bool = False, layout: Layout | None = None,
                       device_memory: int | None = None, utilization: float = 0.9) -> Inspection:
    """layout: also plan a parallel layout; device_memory: bytes of one device, of which `utilization` may hold
    weights (vLLM's gpu_memory_utilization; the rest is for activations and the cache)."""
    report = Inspection(Path(path), device_memory=device_memory)
    try:
        ckpt = survey_checkpoint(path)
    except CheckpointError as e:
        report.refusals.append(str(e))
        return report
    _describe(ckpt, report)
    if layout is not None:
        _plan(ckpt, report, layout, utilization)
    if audit:
        _run_audit(ckpt, report)
    return report


def _plan(ckpt: Checkpoint, report: Inspection, layout: Layout, utilization: float) -> None:
    report.plan = plan = layout_plan(ckpt, layout)
    known = set(report.refusals)
    report.refusals += [f"plan: {p}" for p in plan.problems if p not in known]
    if report.device_memory is None or not plan.bytes_per_rank or plan.problems:
        return
    budget = int(report.device_memory * utilization)
    worst = max(range(len(plan.bytes_per_rank)), key=plan.bytes_per_rank.__getitem__)
    if plan.bytes_per_rank[worst] > budget:
        report.refusals.append(f"plan: rank {worst} needs {plan.bytes_per_rank[worst]:,} bytes of weights, more than "
                               f"{utilization:g} of a {report.device_memory:,}-byte device ({budget:,} bytes); add "
                               "ranks (tensor or pipeline parallel)")
    else:
        report.notes.append(f"plan fits: the largest rank ({worst}) holds {plan.bytes_per_rank[worst]:,} bytes of "
                            f"weights, within {utilization:g} of a {report.device_memory:,}-byte device")


def _describe(ckpt: Checkpoint, report: Inspection) -> None:
    cfg = report.config = ckpt.config
    report.dialect = ckpt.dialect
    codes = {0: "S", 4: "C", 128: "H"}
    schedule = "".join(codes[r] for r in cfg.compress_ratios[:cfg.num_hidden_layers])
    report.summary = (f"{cfg.num_hidden_layers} layers [{schedule}] + {cfg.num_nextn_predict_layers} MTP, hidden "
                      f"{cfg.hidden_size}, {cfg.n_routed_experts} experts (top {cfg.num_experts_per_tok}), "
                      f"{cfg.num_hash_layers} hash layers, vocab {cfg.vocab_size}")
    report.files = len(set(ckpt.sources.values()))
    report.keys = len(ckpt.sources)
    report.refusals += ckpt.problems
    specs = {s.name: s for s in model_specs(cfg)}
    by_module = {s.module: s for s in specs.values() if s.is_linear}
    groups: dict = defaultdict(GroupStats)
    for name, t in ckpt.tensors.items():
        module = name.rpartition(".")[0]
        spec = specs.get(name) or by_module.get(module)
        if spec is None:
            continue  # already a refusal
        part = "mtp" if name.startswith("mtp.") else "main"
        fmt = ckpt.formats.get(spec.module, "dense") if spec.is_linear else "dense"
        if fmt == "dense":  # dense linears and plain tensors: show the dtype
            fmt = str(t.dtype).removeprefix("torch.")
        g = groups[(part, GROUP_LABELS.get(spec.role, spec.role), fmt)]
        g.tensors += 1
        g.bytes += t.nbytes
        if name == spec.name and spec.role != TID2EID:
            n = 1
            for d in spec.shape:
                n *= d
            g.params += n
            report.params_present[part] = report.params_present.get(part, 0) + n
    report.groups = dict(groups)
    report.params_config["main"] = count_parameters(cfg)
    report.params_config["mtp"] = count_parameters(cfg, include_mtp=True) - report.params_config["main"]
    report.missing = ckpt.missing()
    report.refusals += ckpt.incomplete()
    if ckpt.lacks_mtp:
        report.notes.append(NO_MTP_NOTE)
    problems: list[str] = []   # what the loader refuses in the storage formats against config.json
    check_config(ckpt, model_formats(ckpt, problems), problems)
    report.refusals += problems


def _run_audit(ckpt: Checkpoint, report: Inspection) -> None:
    """Load the model (bf16 compute dtype, quantized weights as stored) and audit every parameter."""
    try:
        findings = audit(load_checkpoint(ckpt, "cpu", torch.bfloat16, Ops.reference()))
    except CheckpointError as e:
        report.refusals.append(str(e))
        return
    bad = [f for f in findings if not f.legit]
    report.audit = f"{len(findings)} finding(s), {len(bad)} refused"
    report.notes += [str(f) for f in findings if f.legit and f.problem != NO_MTP]  # NO_MTP_NOTE is already there
    report.refusals += [str(f) for f in bad]
