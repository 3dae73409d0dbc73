"""Checkpoint dialects: one table of renames per dialect into dsv4's canonical (DeepSeek) names.

A rule is data: a key template, a canonical template and an optional transform tag. Templates are
literal text with `{placeholder}`s from PLACEHOLDERS; a rule's regex is its key template anchored at
both ends, each placeholder a named group. The same two templates also give the reverse direction
(canonical name -> key) used by the writer. Rules are unordered: each checkpoint key must match exactly
one rule of its dialect, and two matches are an error that names both rules.

Dialects (docs/architecture.md "Checkpoints"):
* `deepseek`   - DeepSeek's release and NVIDIA's NVFP4 builds: canonical names as they are.
* `hf-stacked` - transformers module names (`DeepseekV4ForCausalLM.state_dict()`), routed experts stacked
                 as `mlp.experts.gate_up_proj` [E, 2I, H] (w1 rows first, then w3) and `down_proj` [E, H, I].
* `hf-experts` - the same module names with one module per expert, `mlp.experts.E.{gate,up,down}_proj`
                 (ModelOpt's HF export); any linear may carry NVFP4 leaves.
* `hf-saved`   - what transformers 5.23 `save_pretrained` writes for this model: its conversion mapping run
                 backwards, i.e. DeepSeek names under `model.` except `model.embed_tokens.weight`, `head.weight`,
                 `model.norm.weight`, `model.hc_head.hc_{fn,base,scale}`, and the attention kv_norm written as
                 `model.layers.N.attn.norm.weight` (transformers' `.norm. -> .kv_norm.` rename undone).
`mtp.*` tensors keep DeepSeek's names in every dialect (transformers drops them on load; we never do).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from types import MappingProxyType

DIALECTS = ("deepseek", "hf-stacked", "hf-experts", "hf-saved")

# What each placeholder matches. Numeric placeholders match whole dotted components only (see
# `_numeric_shape`); every other placeholder is a closed set of words.
LINEAR_LEAVES = ("weight", "scale", "weight_scale_inv", "weight_scale", "weight_scale_2", "input_scale")
PLACEHOLDERS = MappingProxyType({
    "layer": r"\d+",
    "mtp": r"\d+",
    "expert": r"\d+",
    "leaf": "|".join(LINEAR_LEAVES),
    "hcsub": "attn|ffn",
    "hcpart": "fn|base|scale",
    "w": "w1|w2|w3",
    "w13": "w1|w3",
    "attnlin": "wq_a|wq_b|wkv|wo_a|wo_b",
    "cproj": "wkv|wgate",
    "mtpproj": "e_proj|h_proj",
    "mtpnorm": "enorm|hnorm|norm",
})
NUMERIC_PLACEHOLDERS = ("layer", "mtp", "expert")
# Leaf spellings that mean a canonical leaf: transformers' FP8 name for DeepSeek's `.scale`.
LEAF_ALIASES = MappingProxyType({"weight_scale_inv": "scale"})
# Leaf spelling a writer uses per dialect (the reverse of LEAF_ALIASES where a dialect prefers the alias).
WRITE_LEAF = MappingProxyType({"hf-stacked": MappingProxyType({"scale": "weight_scale_inv"}),
                               "hf-experts": MappingProxyType({"scale": "weight_scale_inv"})})

# Transforms: how one stored tensor becomes canonical pieces.
SPLIT_GATE_UP = "split_gate_up"  # [E, 2R, C] -> experts.e.w1 = [e, :R], experts.e.w3 = [e, R:]
SPLIT_EXPERTS = "split_experts"  # [E, R, C]  -> experts.e.<w> = [e]
TRANSFORMS = (SPLIT_GATE_UP, SPLIT_EXPERTS)


@dataclass(frozen=True)
class Rule:
    dialect: str
    key: str                    # key template, e.g. "model.layers.{layer}.self_attn.q_a_proj.{leaf}"
    canonical: str              # canonical template, e.g. "layers.{layer}.attn.wq_a.{leaf}"
    transform: str | None = None

    def __str__(self) -> str:
        arrow = f" [{self.transform}]" if self.transform else ""
        return f"{self.dialect}: {self.key} -> {self.canonical}{arrow}"

    @property
    def regex(self) -> re.Pattern:
        return _template_regex(self.key)

    @property
    def canonical_regex(self) -> re.Pattern:
        return _template_regex(self.canonical, canonical=True)


# ------------------------------------------------------------------------------------------- the tables
# Tensors of one transformer block in DeepSeek's names, relative to the block prefix (`layers.N.` / `mtp.N.`).
_DS_BLOCK = (
    "attn_norm.weight",
    "ffn_norm.weight",
    "hc_{hcsub}_{hcpart}",
    "attn.attn_sink",
    "attn.{attnlin}.{leaf}",
    "attn.q_norm.weight",
    "attn.kv_norm.weight",
    "attn.compressor.{cproj}.{leaf}",
    "attn.compressor.ape",
    "attn.compressor.norm.weight",
    "attn.indexer.wq_b.{leaf}",
    "attn.indexer.weights_proj.{leaf}",
    "attn.indexer.compressor.{cproj}.{leaf}",
    "attn.indexer.compressor.ape",
    "attn.indexer.compressor.norm.weight",
    "ffn.gate.{leaf}",
    "ffn.gate.bias",
    "ffn.gate.tid2eid",
    "ffn.experts.{expert}.{w}.{leaf}",
    "ffn.shared_experts.{w}.{leaf}",
)
# An MTP block is a sliding-window (ratio 0), bias-routed block: no compressor, indexer or tid2eid.
_DS_MTP_BLOCK = tuple(s for s in _DS_BLOCK if not s.startswith(("attn.compressor.", "attn.indexer."))
                      and s != "ffn.gate.tid2eid")
_DS_MTP_EXTRA = ("{mtpproj}.{leaf}", "{mtpnorm}.weight", "hc_head_{hcpart}")
_DS_GLOBAL = ("embed.weight", "head.{leaf}", "norm.weight", "hc_head_{hcpart}")

# transformers module names of one main layer (prefix `model.layers.{layer}.`), canonical suffix second.
_HF_BLOCK = (
    ("input_layernorm.weight", "attn_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("{hcsub}_hc.{hcpart}", "hc_{hcsub}_{hcpart}"),
    ("self_attn.sinks", "attn.attn_sink"),
    ("self_attn.q_a_proj.{leaf}", "attn.wq_a.{leaf}"),
    ("self_attn.q_a_norm.weight", "attn.q_norm.weight"),
    ("self_attn.q_b_proj.{leaf}", "attn.wq_b.{leaf}"),
    ("self_attn.kv_proj.{leaf}", "attn.wkv.{leaf}"),
    ("self_attn.kv_norm.weight", "attn.kv_norm.weight"),
    ("self_attn.o_a_proj.{leaf}", "attn.wo_a.{leaf}"),
    ("self_attn.o_b_proj.{leaf}", "attn.wo_b.{leaf}"),
    ("self_attn.compressor.kv_proj.{leaf}", "attn.compressor.wkv.{leaf}"),
    ("self_attn.compressor.gate_proj.{leaf}", "attn.compressor.wgate.{leaf}"),
    ("self_attn.compressor.position_bias", "attn.compressor.ape"),
    ("self_attn.compressor.kv_norm.weight", "attn.compressor.norm.weight"),
    ("self_attn.compressor.indexer.kv_proj.{leaf}", "attn.indexer.compressor.wkv.{leaf}"),
    ("self_attn.compressor.indexer.gate_proj.{leaf}", "attn.indexer.compressor.wgate.{leaf}"),
    ("self_attn.compressor.indexer.position_bias", "attn.indexer.compressor.ape"),
    ("self_attn.compressor.indexer.kv_norm.weight", "attn.indexer.compressor.norm.weight"),
    ("self_attn.compressor.indexer.q_b_proj.{leaf}", "attn.indexer.wq_b.{leaf}"),
    ("self_attn.compressor.indexer.scorer.weights_proj.{leaf}", "attn.indexer.weights_proj.{leaf}"),
    ("mlp.gate.{leaf}", "ffn.gate.{leaf}"),
    ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
    ("mlp.gate.tid2eid", "ffn.gate.tid2eid"),
    ("mlp.shared_experts.gate_proj.{leaf}", "ffn.shared_experts.w1.{leaf}"),
    ("mlp.shared_experts.up_proj.{leaf}", "ffn.shared_experts.w3.{leaf}"),
    ("mlp.shared_experts.down_proj.{leaf}", "ffn.shared_experts.w2.{leaf}"),
)
_HF_GLOBAL = (
    ("model.embed_tokens.weight", "embed.weight"),
    ("lm_head.{leaf}", "head.{leaf}"),
    ("model.norm.weight", "norm.weight"),
    ("model.hc_head.hc_{hcpart}", "hc_head_{hcpart}"),
)
_HF_STACKED_EXPERTS = (
    ("mlp.experts.gate_up_proj", "ffn.experts.{expert}.{w13}.weight", SPLIT_GATE_UP),
    ("mlp.experts.gate_up_proj_scale_inv", "ffn.experts.{expert}.{w13}.scale", SPLIT_GATE_UP),
    ("mlp.experts.down_proj", "ffn.experts.{expert}.w2.weight", SPLIT_EXPERTS),
    ("mlp.experts.down_proj_scale_inv", "ffn.experts.{expert}.w2.scale", SPLIT_EXPERTS),
)
_HF_PER_EXPERT = (
    ("mlp.experts.{expert}.gate_proj.{leaf}", "ffn.experts.{expert}.w1.{leaf}"),
    ("mlp.experts.{expert}.up_proj.{leaf}", "ffn.experts.{expert}.w3.{leaf}"),
    ("mlp.experts.{expert}.down_proj.{leaf}", "ffn.experts.{expert}.w2.{leaf}"),
)
# hf-saved spells the attention kv_norm `attn.norm`; everything else of a block keeps DeepSeek's name.
_HF_SAVED_BLOCK = tuple(("attn.norm.weight" if s == "attn.kv_norm.weight" else s, s) for s in _DS_BLOCK)
_HF_SAVED_GLOBAL = (
    ("model.embed_tokens.weight", "embed.weight"),
    ("head.{leaf}", "head.{leaf}"),
    ("model.norm.weight", "norm.weight"),
    ("model.hc_head.hc_{hcpart}", "hc_head_{hcpart}"),
)


def _mtp_rules(dialect: str) -> list[Rule]:
    return [Rule(dialect, "mtp.{mtp}." + s, "mtp.{mtp}." + s) for s in _DS_MTP_BLOCK + _DS_MTP_EXTRA]


def _build_rules() -> dict[str, tuple[Rule, ...]]:
    ds = [Rule("deepseek", s, s) for s in _DS_GLOBAL]
    ds += [Rule("deepseek", "layers.{layer}." + s, "layers.{layer}." + s) for s in _DS_BLOCK]
    ds += _mtp_rules("deepseek")

    def hf(dialect: str, experts: tuple) -> list[Rule]:
        rules = [Rule(dialect, k, c) for k, c in _HF_GLOBAL]
        for key, canon, *transform in _HF_BLOCK + experts:
            rules.append(Rule(dialect, "model.layers.{layer}." + key, "layers.{layer}." + canon, *transform))
        return rules + _mtp_rules(dialect)

    saved = [Rule("hf-saved", k, c) for k, c in _HF_SAVED_GLOBAL]
    saved += [Rule("hf-saved", "model.layers.{layer}." + k, "layers.{layer}." + c) for k, c in _HF_SAVED_BLOCK]
    saved += _mtp_rules("hf-saved")
    return {"deepseek": tuple(ds), "hf-stacked": tuple(hf("hf-stacked", _HF_STACKED_EXPERTS)),
            "hf-experts": tuple(hf("hf-experts", _HF_PER_EXPERT)), "hf-saved": tuple(saved)}


RULES: MappingProxyType[str, tuple[Rule, ...]] = MappingProxyType(_build_rules())

# A key that only one dialect can produce; dialect detection looks for these (docs: names.py).
MARKERS = MappingProxyType({
    "deepseek": r"^layers\.\d+\.",
    "hf-saved": r"^model\.layers\.\d+\.(attn|ffn)\.",
    "hf-stacked": r"^model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)(_scale_inv)?$",
    "hf-experts": r"^model\.layers\.\d+\.mlp\.experts\.\d+\.",
})


# ------------------------------------------------------------------------------------------- matching
_PLACEHOLDER = re.compile(r"\{(\w+)\}")


@cache
def _template_regex(template: str, canonical: bool = False) -> re.Pattern:
    parts, pos, seen = [], 0, set()
    for m in _PLACEHOLDER.finditer(template):
        name = m.group(1)
        if name not in PLACEHOLDERS:
            raise ValueError(f"template {template!r}: unknown placeholder {{{name}}}")
        if name in seen:
            raise ValueError(f"template {template!r}: placeholder {{{name}}} used twice")
        seen.add(name)
        literal = template[pos:m.start()]
        alternatives = PLACEHOLDERS[name]
        if canonical and name == "leaf":
            alternatives = "|".join(v for v in LINEAR_LEAVES if v not in LEAF_ALIASES)
        parts.append(re.escape(literal))
        parts.append(f"(?P<{name}>{alternatives})")
        pos = m.end()
    parts.append(re.escape(template[pos:]))
    return re.compile("^" + "".join(parts) + "$")


def _numeric_shape(key: str) -> str:
    """The key with every all-digit dotted component replaced by '#'.

    Whether a rule matches depends only on this shape: numeric placeholders match exactly the all-digit
    components and literal text never contains one. Matching is memoised per shape, so a 69k-key index
    costs a few hundred rule scans.
    """
    return ".".join("#" if part.isdigit() else part for part in key.split("."))


def _check_tables() -> None:
    for dialect, rules in RULES.items():
        for rule in rules:
            for template in (rule.key, rule.canonical):
                for part in _PLACEHOLDER.sub("x", template).split("."):
                    if part.isdigit():
                        raise ValueError(f"rule {rule}: literal numeric component {part!r}")
                for name in NUMERIC_PLACEHOLDERS:
                    if "{" + name + "}" in template and not re.search(r"(^|\.)\{" + name + r"\}(\.|$)", template):
                        raise ValueError(f"rule {rule}: {{{name}}} must be a whole dotted component")
            if rule.transform not in (None, *TRANSFORMS):
                raise ValueError(f"rule {rule}: unknown transform {rule.transform!r}")
            key_groups = set(rule.regex.groupindex)
            canon_groups = set(rule.canonical_regex.groupindex)
            produced = {"expert", "w13"} if rule.transform == SPLIT_GATE_UP else (
                {"expert"} if rule.transform == SPLIT_EXPERTS else set())
            if canon_groups - key_groups - produced or key_groups - canon_groups:
                raise ValueError(f"rule {rule}: placeholders of key and canonical templates differ")


_check_tables()


@dataclass(frozen=True)
class Match:
    rule: Rule
    groups: dict[str, str]

    def canonical(self, **extra: str) -> str:
        """The canonical name (placeholders filled from the key, `extra` from a transform)."""
        values = dict(self.groups, **extra)
        if "leaf" in values:
            values["leaf"] = LEAF_ALIASES.get(values["leaf"], values["leaf"])
        return self.rule.canonical.format(**values)


class Renamer:
    """Matches keys of one dialect against its rules, memoised by numeric shape."""

    def __init__(self, dialect: str):
        if dialect not in RULES:
            raise ValueError(f"unknown dialect {dialect!r}; known: {DIALECTS}")
        self.dialect = dialect
        self.rules = RULES[dialect]
        self._by_shape: dict[str, tuple[Rule, ...]] = {}

    def candidates(self, key: str) -> tuple[Rule, ...]:
        shape = _numeric_shape(key)
        found = self._by_shape.get(shape)
        if found is None:
            found = tuple(r for r in self.rules if r.regex.match(key))
            self._by_shape[shape] = found
        return found

    def match(self, key: str) -> Match | None:
        """The single rule matching `key`, None if none does; two or more raise ValueError naming them."""
        rules = self.candidates(key)
        if not rules:
            return None
        if len(rules) > 1:
            raise ValueError(f"key {key!r} matches {len(rules)} rules of dialect {self.dialect!r}: "
                             + "; ".join(str(r) for r in rules))
        return Match(rules[0], rules[0].regex.match(key).groupdict())


def detect_dialect(keys) -> list[str]:
    """Dialects whose marker appears among `keys` (exactly one for a well-formed checkpoint)."""
    markers = {d: re.compile(p) for d, p in MARKERS.items()}
    found = []
    for dialect, marker in markers.items():
        if any(marker.match(k) for k in keys):
            found.append(dialect)
    return found


@cache
def _rules_for_canonical(dialect: str, shape: str) -> tuple[Rule, ...]:
    probe = ".".join("0" if part == "#" else part for part in shape.split("."))
    return tuple(r for r in RULES[dialect] if r.canonical_regex.match(probe))


def dialect_key(canonical: str, dialect: str) -> str:
    """The key `dialect` stores canonical tensor `canonical` under (a stacked key for stacked experts)."""
    if dialect not in RULES:
        raise ValueError(f"unknown dialect {dialect!r}; known: {DIALECTS}")
    hits = _rules_for_canonical(dialect, _numeric_shape(canonical))
    if len(hits) != 1:
        what = "no rule" if not hits else f"{len(hits)} rules ({'; '.join(str(r) for r in hits)})"
        raise ValueError(f"canonical name {canonical!r} has {what} in dialect {dialect!r}")
    rule = hits[0]
    groups = rule.canonical_regex.match(canonical).groupdict()
    if "leaf" in groups:
        groups["leaf"] = WRITE_LEAF.get(dialect, {}).get(groups["leaf"], groups["leaf"])
    return rule.key.format(**groups)


def rule_count() -> dict[str, int]:
    return {d: len(r) for d, r in RULES.items()}
