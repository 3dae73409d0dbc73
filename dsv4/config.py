"""ModelConfig: one description of a DeepSeek-V4 model, read from either config.json dialect.

DeepSeek's own config.json (and NVIDIA's NVFP4 builds) carry `compress_ratios` (one entry per layer, then
one per MTP layer), `num_hash_layers`, `qk_rope_head_dim` and a flat `rope_scaling`. What transformers'
`save_pretrained` writes carries `layer_types`, `compress_rates`, `mlp_layer_types`, `rope_parameters` and
`partial_rotary_factor` instead. Both fold into the same frozen dataclass whose field names are DeepSeek's
config.json keys. Unknown keys and contradictions raise `ConfigError` naming the key.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
RATIO_TO_LAYER_TYPE = MappingProxyType({0: SLIDING, 4: CSA, 128: HCA})


class ConfigError(ValueError):
    """A config.json that dsv4 cannot interpret unambiguously."""


@dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters of the compress rope (CSA/HCA layers). V4 applies no mscale to cos/sin."""

    factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    type: str = "yarn"


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2048
    num_hash_layers: int = 3
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hidden_act: str = "silu"
    sliding_window: int = 128
    # One entry per main layer, then one per MTP layer (0 = sliding only, 4 = CSA, 128 = HCA).
    compress_ratios: tuple[int, ...] = (0, 0) + (4, 128) * 20 + (4, 0)
    compress_rope_theta: float = 160000.0
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = field(default_factory=RopeScaling)
    max_position_embeddings: int = 1048576
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    num_nextn_predict_layers: int = 1
    tie_word_embeddings: bool = False
    bos_token_id: int = 0
    eos_token_id: int = 1
    # Storage of the routed experts in the *release* this config describes: "fp4" (MXFP4), "fp8", or None (bf16).
    expert_dtype: str | None = field(default="fp4", compare=False)
    # The raw quantization_config of config.json (kept for writing it back); formats are detected per tensor.
    quantization_config: dict | None = field(default=None, compare=False, hash=False)

    def __post_init__(self) -> None:
        self.validate()

    # ----------------------------------------------------------------- derived
    @property
    def n_layers_total(self) -> int:
        return self.num_hidden_layers + self.num_nextn_predict_layers

    def compress_ratio(self, layer: int) -> int:
        """Ratio of main layer `layer`, or of MTP block `layer - num_hidden_layers`."""
        return self.compress_ratios[layer]

    def layer_type(self, layer: int) -> str:
        return RATIO_TO_LAYER_TYPE[self.compress_ratios[layer]]

    def is_hash_layer(self, layer: int) -> bool:
        """MTP blocks are never hash-routed."""
        return layer < min(self.num_hash_layers, self.num_hidden_layers)

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def hc_dim(self) -> int:
        """Rows of an mHC `fn` matrix: pre (n) + post (n) + comb (n*n)."""
        return (2 + self.hc_mult) * self.hc_mult

    # -------------------------------------------------------------- validation
    def validate(self) -> None:
        def need(cond: bool, key: str, msg: str) -> None:
            if not cond:
                raise ConfigError(f"config field {key!r}: {msg}")

        need(len(self.compress_ratios) == self.n_layers_total, "compress_ratios",
             f"has {len(self.compress_ratios)} entries, expected num_hidden_layers + num_nextn_predict_layers "
             f"= {self.num_hidden_layers} + {self.num_nextn_predict_layers}")
        bad = sorted({r for r in self.compress_ratios if r not in RATIO_TO_LAYER_TYPE})
        need(not bad, "compress_ratios", f"values {bad} are not V4 ratios (0, 4, 128)")
        need(all(r == 0 for r in self.compress_ratios[self.num_hidden_layers:]), "compress_ratios",
             "MTP entries must be 0 (the MTP block is sliding-window only)")
        need(self.num_key_value_heads == 1, "num_key_value_heads", "V4 has one shared K=V head")
        need(0 < self.qk_rope_head_dim < self.head_dim and self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim",
             f"{self.qk_rope_head_dim} must be even and below head_dim {self.head_dim}")
        need(self.index_head_dim > self.qk_rope_head_dim, "index_head_dim",
             f"{self.index_head_dim} must exceed qk_rope_head_dim {self.qk_rope_head_dim}")
        need(self.num_attention_heads % self.o_groups == 0, "o_groups",
             f"{self.o_groups} must divide num_attention_heads {self.num_attention_heads}")
        need(self.num_experts_per_tok <= self.n_routed_experts, "num_experts_per_tok",
             f"{self.num_experts_per_tok} exceeds n_routed_experts {self.n_routed_experts}")
        need(0 <= self.num_hash_layers <= self.num_hidden_layers, "num_hash_layers",
             f"{self.num_hash_layers} not in [0, num_hidden_layers]")
        need(self.n_shared_experts in (0, 1), "n_shared_experts", "V4 has at most one shared expert")
        need(self.scoring_func == "sqrtsoftplus", "scoring_func", f"{self.scoring_func!r} is not 'sqrtsoftplus'")
        need(self.topk_method == "noaux_tc", "topk_method", f"{self.topk_method!r} is not 'noaux_tc'")
        need(self.hidden_act == "silu", "hidden_act", f"{self.hidden_act!r} is not 'silu'")
        need(self.norm_topk_prob, "norm_topk_prob", "V4 normalises the top-k weights")
        need(self.expert_dtype in ("fp4", "fp8", None), "expert_dtype", f"{self.expert_dtype!r} not fp4/fp8/null")
        need(self.hc_sinkhorn_iters >= 1, "hc_sinkhorn_iters", "must be >= 1")
        need(self.rope_scaling is None or self.rope_scaling.type == "yarn", "rope_scaling",
             f"type {getattr(self.rope_scaling, 'type', None)!r} is not 'yarn'")

    # ---------------------------------------------------------------- reading
    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no config.json") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        try:
            return cls.from_dict(raw)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Accepts DeepSeek-style and transformers-style keys (and a mix, when they agree)."""
        raw = dict(raw)
        if raw.get("model_type", "deepseek_v4") != "deepseek_v4":
            raise ConfigError(f"config field 'model_type': {raw['model_type']!r} is not 'deepseek_v4' "
                              "(DeepSeek-V4.1 and other models are different architectures)")
        unknown = sorted(k for k in raw if k not in _FIELDS and k not in _HF_KEYS and k not in _IGNORED_KEYS
                         and not k.startswith(_IGNORED_PREFIXES))
        if unknown:
            raise ConfigError(f"unknown config fields {unknown}; dsv4 refuses to guess what they change")
        kw = {k: v for k, v in raw.items() if k in _FIELDS}
        kw.update(_fold_hf_keys(raw, kw))
        if "rope_scaling" in kw:
            kw["rope_scaling"] = _rope_scaling(kw["rope_scaling"])
        qc = kw.get("quantization_config")
        if isinstance(qc, dict) and "expert_dtype" in qc:
            if "expert_dtype" in raw and raw["expert_dtype"] != qc["expert_dtype"]:
                raise ConfigError(f"config fields 'expert_dtype' ({raw['expert_dtype']!r}) and "
                                  f"'quantization_config.expert_dtype' ({qc['expert_dtype']!r}) disagree")
            kw["expert_dtype"] = qc["expert_dtype"]
        if "expert_dtype" not in kw and not (isinstance(qc, dict) and qc.get("quant_method") == "fp8"):
            kw["expert_dtype"] = None
        if isinstance(kw.get("eos_token_id"), list):
            kw["eos_token_id"] = kw["eos_token_id"][0]
        for key in ("compress_ratios",):
            if key in kw:
                kw[key] = tuple(int(r) for r in kw[key])
        try:
            return cls(**kw)
        except TypeError as e:
            raise ConfigError(str(e)) from None

    # ---------------------------------------------------------------- writing
    def to_dict(self) -> dict[str, Any]:
        """DeepSeek-style config.json contents (what the official release and NVIDIA's builds ship)."""
        d = dataclasses.asdict(self)
        d["compress_ratios"] = list(self.compress_ratios)
        if self.quantization_config is None:
            d.pop("quantization_config")
        if self.rope_scaling is not None:
            d["rope_scaling"] = dataclasses.asdict(self.rope_scaling)
        return {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", **d}

    def to_hf_dict(self) -> dict[str, Any]:
        """Keyword arguments for transformers' `DeepseekV4Config` (the oracle) describing the same model."""
        d = self.to_dict()
        for k in ("architectures", "quantization_config", "expert_dtype"):
            d.pop(k, None)
        return d

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def with_layers(self, n: int) -> "ModelConfig":
        """This model cut to its first `n` main layers (their ratios and hash routing as they are; MTP blocks kept):
        for benchmarks, where the time per layer is the difference of two layer counts."""
        if not 1 <= n <= self.num_hidden_layers:
            raise ConfigError(f"num_hidden_layers override {n} not in [1, {self.num_hidden_layers}]")
        ratios = self.compress_ratios[:n] + self.compress_ratios[self.num_hidden_layers:]
        return self.replace(num_hidden_layers=n, compress_ratios=ratios,
                            num_hash_layers=min(self.num_hash_layers, n))

    # ---------------------------------------------------------------- presets
    @classmethod
    def flash(cls) -> "ModelConfig":
        """deepseek-ai/DeepSeek-V4-Flash (284B total, 13B active)."""
        return cls()

    @classmethod
    def pro(cls) -> "ModelConfig":
        """deepseek-ai/DeepSeek-V4-Pro (1.6T total, 49B active)."""
        return cls(hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536,
                   o_groups=16, n_routed_experts=384, moe_intermediate_size=3072, routed_scaling_factor=2.5,
                   compress_ratios=(128, 128) + (4, 128) * 29 + (4, 0), index_topk=1024)

    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        """"v4-flash", "v4-pro" or "tiny" (case and '_' / '-' ignored)."""
        key = name.lower().replace("_", "-")
        presets = {"v4-flash": cls.flash, "v4-pro": cls.pro, "tiny": cls.tiny}
        if key not in presets:
            raise ConfigError(f"unknown model preset {name!r}; expected one of {sorted(presets)}")
        return presets[key]()

    @classmethod
    def tiny(cls, **changes: Any) -> "ModelConfig":
        """A few-layer model with every layer type (S, S, C, H, C + MTP S), hash and biased MoE layers.

        Small enough for CPU tests; ratio 128 still makes HCA entries appear past 128 tokens.
        """
        base = dict(vocab_size=512, hidden_size=64, num_hidden_layers=5, num_attention_heads=4, head_dim=64,
                    qk_rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=16, n_routed_experts=8,
                    num_experts_per_tok=2, moe_intermediate_size=32, num_hash_layers=2, sliding_window=128,
                    compress_ratios=(0, 0, 4, 128, 4, 0), index_n_heads=2, index_head_dim=32, index_topk=4,
                    max_position_embeddings=4096, routed_scaling_factor=1.5,
                    rope_scaling=RopeScaling(factor=4.0, original_max_position_embeddings=256,
                                             beta_fast=32.0, beta_slow=1.0))
        base.update(changes)
        return cls(**base)


_FIELDS = frozenset(f.name for f in dataclasses.fields(ModelConfig))
# transformers-style keys folded by _fold_hf_keys.
_HF_KEYS = frozenset({"layer_types", "compress_rates", "mlp_layer_types", "rope_parameters", "partial_rotary_factor",
            "compress_rate_csa", "compress_rate_hca"})
# Keys real config.json files carry that do not change the forward pass of a V4 model.
_IGNORED_KEYS = frozenset({
    "architectures", "model_type", "torch_dtype", "dtype", "transformers_version", "auto_map", "use_cache",
    "attention_bias", "attention_dropout", "mlp_bias", "initializer_range", "pad_token_id", "output_router_logits",
    "router_aux_loss_coef", "router_jitter_noise", "aux_loss_alpha", "seq_aux", "first_k_dense_replace",
    "n_group", "topk_group", "moe_layer_freq", "ep_size", "_name_or_path", "return_dict", "output_hidden_states",
    "output_attentions", "is_encoder_decoder", "tie_encoder_decoder", "chunk_size_feed_forward", "id2label",
    "label2id", "problem_type", "tokenizer_class", "prefix", "sep_token_id", "decoder_start_token_id",
    "task_specific_params", "finetuning_task", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
    "intermediate_size", "num_local_experts", "scale_fmt", "moe_quant_algo", "quantized_layers", "ignore",
    "config_groups",
})
# Speculative-decoding add-ons of later V4 releases (Flash-0731's DSpark): read elsewhere, never by the forward.
_IGNORED_PREFIXES = ("dspark_",)


def _rope_scaling(value: Any) -> RopeScaling | None:
    if value is None or isinstance(value, RopeScaling):
        return value
    value = dict(value)
    kind = value.pop("type", value.pop("rope_type", "yarn"))
    value.pop("attention_factor", None)
    for k in ("mscale", "mscale_all_dim"):
        if value.pop(k, None) not in (None, 0, 1, 1.0):
            raise ConfigError(f"config field 'rope_scaling.{k}': V4 uses no YaRN mscale")
    allowed = {f.name for f in dataclasses.fields(RopeScaling)}
    unknown = sorted(set(value) - allowed - {"rope_theta", "partial_rotary_factor"})
    if unknown:
        raise ConfigError(f"config field 'rope_scaling': unknown keys {unknown}")
    return RopeScaling(type=kind, **{k: v for k, v in value.items() if k in allowed})


def _agree(kw: dict, key: str, value: Any, source: str) -> None:
    if key in kw and kw[key] != value:
        raise ConfigError(f"config fields {key!r} ({kw[key]!r}) and {source!r} ({value!r}) disagree")
    kw[key] = value


def _fold_hf_keys(raw: dict[str, Any], kw: dict[str, Any]) -> dict[str, Any]:
    """Translate transformers-style keys into ModelConfig fields, refusing contradictions."""
    out: dict[str, Any] = {}
    merged = dict(kw)
    n_layers = raw.get("num_hidden_layers", ModelConfig.num_hidden_layers)
    n_mtp = raw.get("num_nextn_predict_layers", ModelConfig.num_nextn_predict_layers)

    rates = dict(raw.get("compress_rates") or {})
    for key, layer_type in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if key in raw:
            rates[layer_type] = raw[key]
    for layer_type, expected in ((CSA, 4), (HCA, 128)):
        if rates.get(layer_type, expected) != expected:
            raise ConfigError(f"config field 'compress_rates': {layer_type} = {rates[layer_type]}, V4 uses {expected}")

    if "layer_types" in raw:
        by_type = {v: k for k, v in RATIO_TO_LAYER_TYPE.items()}
        try:
            ratios = [by_type[t] for t in raw["layer_types"]]
        except KeyError as e:
            raise ConfigError(f"config field 'layer_types': unknown layer type {e.args[0]!r}") from None
        if len(ratios) != n_layers:
            raise ConfigError(f"config field 'layer_types' has {len(ratios)} entries, num_hidden_layers is {n_layers}")
        if "compress_ratios" in merged:
            if tuple(merged["compress_ratios"][:n_layers]) != tuple(ratios):
                raise ConfigError("config fields 'compress_ratios' and 'layer_types' disagree")
        else:
            merged["compress_ratios"] = tuple(ratios) + (0,) * n_mtp
    if "mlp_layer_types" in raw:
        types = list(raw["mlp_layer_types"])
        n_hash = sum(t == "hash_moe" for t in types)
        if types != ["hash_moe"] * n_hash + ["moe"] * (len(types) - n_hash) or len(types) != n_layers:
            raise ConfigError(f"config field 'mlp_layer_types' must be hash_moe layers first, then moe, one per "
                              f"layer; got {types}")
        _agree(merged, "num_hash_layers", n_hash, "mlp_layer_types")
    if "partial_rotary_factor" in raw and raw["partial_rotary_factor"] is not None:
        head_dim = merged.get("head_dim", ModelConfig.head_dim)
        _agree(merged, "qk_rope_head_dim", int(round(head_dim * raw["partial_rotary_factor"])),
               "partial_rotary_factor")
    rp = raw.get("rope_parameters")
    if isinstance(rp, dict) and isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        _agree(merged, "rope_theta", float(rp["main"]["rope_theta"]), "rope_parameters.main.rope_theta")
        _agree(merged, "compress_rope_theta", float(rp["compress"]["rope_theta"]),
               "rope_parameters.compress.rope_theta")
        if rp["main"].get("rope_type", "default") != "default":
            raise ConfigError("config field 'rope_parameters.main': V4's main rope has no scaling")
        compress = rp["compress"]
        scaling = None if compress.get("rope_type", "default") == "default" else _rope_scaling(compress)
        if "rope_scaling" in merged and _rope_scaling(merged["rope_scaling"]) != scaling:
            raise ConfigError("config fields 'rope_scaling' and 'rope_parameters.compress' disagree")
        merged["rope_scaling"] = scaling
    elif rp is not None and "rope_scaling" not in merged:
        merged["rope_scaling"] = rp or None
    for k in ("rope_theta", "compress_rope_theta"):
        if k in merged:
            merged[k] = float(merged[k])
    out.update({k: v for k, v in merged.items() if k not in kw or kw[k] is not v})
    return out


def count_parameters(cfg: ModelConfig, include_mtp: bool = False) -> int:
    """Logical (dequantized) parameter count: e_score biases in, tid2eid out. Flash: 284,332,240,471."""
    from math import prod

    d, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
    hc = cfg.hc_dim * cfg.hc_mult * d + cfg.hc_dim + 3

    def layer(i: int) -> int:
        n = 2 * d + 2 * hc  # attn_norm, ffn_norm, hc_attn_*, hc_ffn_*
        n += cfg.num_attention_heads  # attn_sink
        n += cfg.q_lora_rank * d + cfg.q_lora_rank + cfg.num_attention_heads * cfg.head_dim * cfg.q_lora_rank
        n += cfg.head_dim * d + cfg.head_dim  # wkv, kv_norm
        n += cfg.o_groups * cfg.o_lora_rank * (cfg.num_attention_heads * cfg.head_dim // cfg.o_groups)
        n += d * cfg.o_groups * cfg.o_lora_rank
        ratio = cfg.compress_ratios[i]
        if ratio:
            width = cfg.head_dim * (2 if ratio == 4 else 1)
            n += 2 * width * d + ratio * width + cfg.head_dim
        if ratio == 4:
            n += cfg.index_n_heads * cfg.index_head_dim * cfg.q_lora_rank + cfg.index_n_heads * d
            n += 2 * 2 * cfg.index_head_dim * d + 4 * 2 * cfg.index_head_dim + cfg.index_head_dim
        n += E * d + (0 if cfg.is_hash_layer(i) else E)
        n += E * 3 * I * d + cfg.n_shared_experts * 3 * I * d
        return n

    total = 2 * cfg.vocab_size * d + d + prod((cfg.hc_mult, cfg.hc_mult * d)) + cfg.hc_mult + 1
    total += sum(layer(i) for i in range(cfg.num_hidden_layers))
    if include_mtp:
        for i in range(cfg.num_hidden_layers, cfg.n_layers_total):
            total += layer(i) + 2 * d * d + 3 * d + cfg.hc_mult * cfg.hc_mult * d + cfg.hc_mult + 1
    return total


__all__ = ["ModelConfig", "RopeScaling", "ConfigError", "count_parameters", "SLIDING", "CSA", "HCA",
           "RATIO_TO_LAYER_TYPE"]
