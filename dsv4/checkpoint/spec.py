"""The canonical tensor list of a V4 model: DeepSeek's own names, logical shapes, roles.

Every dialect is renamed into these names (see `names.py`); every format is a storage of these logical
tensors (a Linear's logical tensor is its dequantized `[out, in]` weight). `role` decides the storage a
checkpoint format gives a tensor (see `FORMAT_PLANS` in the writer) and which loader path fills it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ModelConfig

# Roles of linear layers (stored as bf16, FP8 blocks, MXFP4 or NVFP4 depending on the checkpoint format).
ATTN = "attn_linear"                # attn.wq_a / wq_b / wkv / wo_a / wo_b
INDEXER_WQ_B = "indexer_wq_b"       # attn.indexer.wq_b
INDEXER_WEIGHTS = "indexer_weights"  # attn.indexer.weights_proj
COMPRESSOR = "compressor_linear"    # attn.compressor.{wkv,wgate}, attn.indexer.compressor.{wkv,wgate}
ROUTER = "router"                   # ffn.gate.weight
SHARED = "shared_expert"            # ffn.shared_experts.w{1,2,3}
ROUTED = "routed_expert"            # ffn.experts.E.w{1,2,3}
MTP_PROJ = "mtp_proj"               # mtp.N.e_proj / h_proj
EMBED, HEAD = "embed", "head"
LINEAR_ROLES = (ATTN, INDEXER_WQ_B, INDEXER_WEIGHTS, COMPRESSOR, ROUTER, SHARED, ROUTED, MTP_PROJ, EMBED, HEAD)
# Roles of plain tensors (never quantized).
NORM = "norm"            # RMSNorm weights: bf16 in the release, kept fp32 in the model
HC = "hc"                # mHC fn/base/scale and hc_head_*: fp32
SINK = "sink"            # attn.attn_sink: fp32
APE = "ape"              # compressor position bias: fp32
GATE_BIAS = "gate_bias"  # ffn.gate.bias (e_score_correction_bias): fp32
TID2EID = "tid2eid"      # ffn.gate.tid2eid: int64 [vocab, top-k]


@dataclass(frozen=True)
class TensorSpec:
    name: str                 # canonical name; for a linear, the module prefix + ".weight"
    shape: tuple[int, ...]    # logical shape; linears are [out, in]
    role: str
    dtype: torch.dtype        # dtype of the unquantized release (bf16 for linears and norms)

    @property
    def is_linear(self) -> bool:
        return self.role in LINEAR_ROLES and self.role not in (EMBED,)

    @property
    def module(self) -> str:
        """`layers.3.attn.wq_a` for `layers.3.attn.wq_a.weight`; the name itself for plain tensors."""
        return self.name[: -len(".weight")] if self.name.endswith(".weight") else self.name


def layer_specs(cfg: ModelConfig, i: int, prefix: str) -> list[TensorSpec]:
    """Tensors of main layer i (prefix `layers.i.`) or MTP block (prefix `mtp.j.`, i = num_hidden_layers + j)."""
    d, bf16, f32 = cfg.hidden_size, torch.bfloat16, torch.float32
    H, hd, ratio = cfg.num_attention_heads, cfg.head_dim, cfg.compress_ratios[i]
    hc_rows, hc_cols = cfg.hc_dim, cfg.hc_mult * d
    t: list[TensorSpec] = []

    def add(name: str, shape: tuple[int, ...], role: str, dtype: torch.dtype = bf16) -> None:
        t.append(TensorSpec(prefix + name, tuple(shape), role, dtype))

    add("attn_norm.weight", (d,), NORM)
    add("ffn_norm.weight", (d,), NORM)
    for sub in ("attn", "ffn"):
        add(f"hc_{sub}_fn", (hc_rows, hc_cols), HC, f32)
        add(f"hc_{sub}_base", (hc_rows,), HC, f32)
        add(f"hc_{sub}_scale", (3,), HC, f32)
    add("attn.attn_sink", (H,), SINK, f32)
    add("attn.wq_a.weight", (cfg.q_lora_rank, d), ATTN)
    add("attn.q_norm.weight", (cfg.q_lora_rank,), NORM)
    add("attn.wq_b.weight", (H * hd, cfg.q_lora_rank), ATTN)
    add("attn.wkv.weight", (hd, d), ATTN)
    add("attn.kv_norm.weight", (hd,), NORM)
    add("attn.wo_a.weight", (cfg.o_groups * cfg.o_lora_rank, H * hd // cfg.o_groups), ATTN)
    add("attn.wo_b.weight", (d, cfg.o_groups * cfg.o_lora_rank), ATTN)
    if ratio:
        # CSA (ratio 4) projects to two series (overlap Ca | current Cb), HCA to one.
        width = hd * (2 if ratio == 4 else 1)
        add("attn.compressor.wkv.weight", (width, d), COMPRESSOR)
        add("attn.compressor.wgate.weight", (width, d), COMPRESSOR)
        add("attn.compressor.ape", (ratio, width), APE, f32)
        add("attn.compressor.norm.weight", (hd,), NORM)
    if ratio == 4:
        ihd = cfg.index_head_dim
        add("attn.indexer.wq_b.weight", (cfg.index_n_heads * ihd, cfg.q_lora_rank), INDEXER_WQ_B)
        add("attn.indexer.weights_proj.weight", (cfg.index_n_heads, d), INDEXER_WEIGHTS)
        add("attn.indexer.compressor.wkv.weight", (2 * ihd, d), COMPRESSOR)
        add("attn.indexer.compressor.wgate.weight", (2 * ihd, d), COMPRESSOR)
        add("attn.indexer.compressor.ape", (ratio, 2 * ihd), APE, f32)
        add("attn.indexer.compressor.norm.weight", (ihd,), NORM)
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
    add("ffn.gate.weight", (E, d), ROUTER)
    if cfg.is_hash_layer(i):
        add("ffn.gate.tid2eid", (cfg.vocab_size, cfg.num_experts_per_tok), TID2EID, torch.int64)
    else:
        add("ffn.gate.bias", (E,), GATE_BIAS, f32)
    for e in range(E):
        add(f"ffn.experts.{e}.w1.weight", (I, d), ROUTED)
        add(f"ffn.experts.{e}.w2.weight", (d, I), ROUTED)
        add(f"ffn.experts.{e}.w3.weight", (I, d), ROUTED)
    if cfg.n_shared_experts:
        add("ffn.shared_experts.w1.weight", (I, d), SHARED)
        add("ffn.shared_experts.w2.weight", (d, I), SHARED)
        add("ffn.shared_experts.w3.weight", (I, d), SHARED)
    return t


def model_specs(cfg: ModelConfig, include_mtp: bool = True) -> list[TensorSpec]:
    """Every canonical tensor of the model, in a stable order (globals, layers, MTP blocks)."""
    d, f32 = cfg.hidden_size, torch.float32
    out = [
        TensorSpec("embed.weight", (cfg.vocab_size, d), EMBED, torch.bfloat16),
        TensorSpec("norm.weight", (d,), NORM, torch.bfloat16),
        TensorSpec("head.weight", (cfg.vocab_size, d), HEAD, torch.bfloat16),
        TensorSpec("hc_head_fn", (cfg.hc_mult, cfg.hc_mult * d), HC, f32),
        TensorSpec("hc_head_base", (cfg.hc_mult,), HC, f32),
        TensorSpec("hc_head_scale", (1,), HC, f32),
    ]
    for i in range(cfg.num_hidden_layers):
        out += layer_specs(cfg, i, f"layers.{i}.")
    if include_mtp:
        for j in range(cfg.num_nextn_predict_layers):
            p = f"mtp.{j}."
            out += layer_specs(cfg, cfg.num_hidden_layers + j, p)
            out += [
                TensorSpec(p + "e_proj.weight", (d, d), MTP_PROJ, torch.bfloat16),
                TensorSpec(p + "h_proj.weight", (d, d), MTP_PROJ, torch.bfloat16),
                TensorSpec(p + "enorm.weight", (d,), NORM, torch.bfloat16),
                TensorSpec(p + "hnorm.weight", (d,), NORM, torch.bfloat16),
                TensorSpec(p + "norm.weight", (d,), NORM, torch.bfloat16),
                TensorSpec(p + "hc_head_fn", (cfg.hc_mult, cfg.hc_mult * d), HC, f32),
                TensorSpec(p + "hc_head_base", (cfg.hc_mult,), HC, f32),
                TensorSpec(p + "hc_head_scale", (1,), HC, f32),
            ]
    return out
