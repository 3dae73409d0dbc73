"""Post-load audit: parameters that are entirely zero or not finite, by canonical name.

No V4 parameter is legitimately all-zero: norm weights, mHC fn/base/scale, sinks, ape, gate biases and every
linear (each expert separately) hold trained values, and an all-zero one is almost always a tensor that
was never filled (transformers initialises sinks, ape, mHC base and gate biases to zero). Zero *entries*
inside a quantized weight (zero FP4 codes, a zero-amax block) are normal and not reported.
What a format does make legitimate is reported as such, with the reason:
* an NVFP4 `input_scale` of zero or inf: only the W4A4 option reads it (weight-only dequantization never
  does), so it is legitimate unless the model computes with a W4A4 Ops table (`Ops.triton(w4a4=True)`);
* no MTP block when the checkpoint holds no `mtp.*` tensor (in any dialect: quantized and converted builds
  often drop it, transformers always does): the main model is complete, speculative decoding unavailable.
Hash tables are checked for rows that route a token to the same expert twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

import torch

from ..formats import FP4_FORMATS, FP8_BLOCK, QWeight
from ..model import QLinear, Transformer
from ..model.moe import Gate
from .canonical import NO_MTP
from .loader import canonical_name

ROW_CHUNK = 8 * FP8_BLOCK   # rows dequantized at a time (bounded memory for the head / embedding)
ELEMENT_CHUNK = 1 << 22     # elements of a plain tensor checked at a time


@dataclass(frozen=True)
class Finding:
    name: str        # canonical tensor (or module) name
    problem: str     # "all zero" | "non-finite" | "duplicate experts" | NO_MTP
    detail: str
    legit: bool = False

    def __str__(self) -> str:
        return f"{'ok  ' if self.legit else 'BAD '} {self.name}: {self.problem} ({self.detail})"


def _rows(q: QWeight):
    """Dequantized fp32 row blocks of one (unstacked) weight."""
    for r in range(0, q.out_features, ROW_CHUNK):
        rows = slice(r, r + ROW_CHUNK)
        if q.fmt == "fp8":
            scale = q.scale[r // FP8_BLOCK: -(-(r + ROW_CHUNK) // FP8_BLOCK)]
        else:
            scale = None if q.scale is None else q.scale[rows]
        yield QWeight(q.fmt, q.weight[rows], scale, q.scale_2).dequantize(torch.float32)


def _value_problem(chunks) -> tuple[str, str] | None:
    any_nonzero, bad = False, 0
    for c in chunks:
        bad += int((~torch.isfinite(c)).sum())
        any_nonzero = any_nonzero or bool((c != 0).any())
    if bad:
        return "non-finite", f"{bad} NaN/Inf values"
    if not any_nonzero:
        return "all zero", "every value is 0"
    return None


def _zero_cause(q: QWeight) -> str:
    """Why a quantized weight dequantizes to zero, in terms of its storage."""
    if q.fmt == "dense":
        return "every value is 0"
    causes = []
    if q.fmt in FP4_FORMATS and not bool(((q.weight & 0x77) != 0).any()):
        causes.append("all FP4 codes are +-0")
    if q.fmt == "fp8" and not bool((q.weight.float() != 0).any()):
        causes.append("all FP8 elements are 0")
    if q.fmt in ("fp8", "nvfp4") and not bool((q.scale.float() != 0).any()):
        causes.append("every block scale is 0")
    if q.fmt == "nvfp4" and float(q.scale_2) == 0:
        causes.append("weight_scale_2 is 0")
    return "dequantizes to 0: " + (", ".join(causes) or "codes and scales cancel")


def _audit_linear(path: str, m: QLinear, w4a4: bool) -> list[Finding]:
    out = []
    for index in product(*(range(d) for d in m.leading)):
        q = m.piece(*index)
        name = canonical_name(f"{path}.weight", index)
        found = _value_problem(_rows(q))
        if found:
            problem, detail = found
            out.append(Finding(name, problem, _zero_cause(q) if problem == "all zero" else detail))
        if q.input_scale is not None:
            s = float(q.input_scale)
            if s == 0 or s != s or s in (float("inf"), float("-inf")):
                out.append(Finding(canonical_name(f"{path}.input_scale", index), "all zero" if s == 0 else
                                   "non-finite", f"input_scale {s}: read only by the W4A4 option" +
                                   (", which is on" if w4a4 else "; weight-only dequantization ignores it"),
                                   legit=not w4a4))
    return out


def _audit_tid2eid(path: str, gate: Gate) -> list[Finding]:
    ids = gate.tid2eid.sort(dim=-1).values
    dup = (ids[:, 1:] == ids[:, :-1]).any(dim=-1)
    if bool(dup.any()):
        token = int(dup.nonzero()[0])
        return [Finding(f"{path}.tid2eid", "duplicate experts", f"{int(dup.sum())} token ids route to one expert "
                        f"more than once, e.g. token {token} -> {gate.tid2eid[token].tolist()}")]
    return []


def audit(model: Transformer) -> list[Finding]:
    """Every all-zero or non-finite parameter of a loaded model (legit ones flagged and explained)."""
    findings: list[Finding] = []
    w4a4 = any(m.w4a4 for m in model.modules() if isinstance(m, QLinear))
    for path, m in model.named_modules():
        if isinstance(m, QLinear):
            findings += _audit_linear(path, m, w4a4)
            own = {}
            if isinstance(m, Gate) and m.hash:
                findings += _audit_tid2eid(path, m)
            elif isinstance(m, Gate):
                own = {"bias": m.bias}
        else:
            own = {k: t for k, t in m._buffers.items() if k not in m._non_persistent_buffers_set}
        for leaf, t in own.items():
            found = _value_problem(c.float() for c in t.reshape(-1).split(ELEMENT_CHUNK))
            if found:
                findings.append(Finding(f"{path}.{leaf}" if path else leaf, *found))
    cfg = model.config
    if len(model.mtp) < cfg.num_nextn_predict_layers:
        findings.append(Finding("mtp", NO_MTP, f"config.json declares {cfg.num_nextn_predict_layers} MTP block(s) "
                                "but the checkpoint holds no mtp.* tensor (quantized and converted builds often "
                                "drop them, transformers always does): the main model is complete, speculative "
                                "decoding unavailable", legit=True))
    return findings
