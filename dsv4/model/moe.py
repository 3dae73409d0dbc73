"""V4 MoE: a sqrt-softplus router (bias for selection only, or hash routing via tid2eid), routed experts
stacked per layer, and one shared expert; every expert is a clamped SwiGLU.

Module layout (the two places where module paths are not canonical names):
    ffn.gate                       weight [E, d] (+ bias [E] fp32, or tid2eid [vocab, k] int64 on hash layers)
    ffn.experts.w13                leading (E, 2): [e, 0] = experts.e.w1 (gate), [e, 1] = experts.e.w3 (up)
    ffn.experts.w2                 leading (E,):   [e]    = experts.e.w2 (down)
    ffn.shared_experts.w13 / .w2   leading (2,) / ()
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .linear import Builder, QLinear


class Gate(QLinear):
    """The router's projection: logits in fp32, as DeepSeek's reference computes them (x and W in fp32)."""

    def __init__(self, cfg: ModelConfig, layer: int, b: Builder):
        super().__init__(cfg.hidden_size, cfg.n_routed_experts, b.format("gate"), b.dtype, b.ops)
        self.hash = cfg.is_hash_layer(layer)
        if self.hash:
            self.register_buffer("tid2eid", torch.empty(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.int64))
        else:
            self.register_buffer("bias", torch.empty(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., d] -> fp32 logits [..., E]: a dense weight multiplies x in fp32 (`ops.router_logits`: exact
        products of bf16 values, fp32 sums; `widen_` stores the weight in fp32 once so that no call converts it); a
        quantized one runs its kernel and the logits are widened."""
        if self.format.fmt == "dense":
            return self.ops.router_logits(x, self.weight)
        return self.ops.linear(x, self.qweight()).float()

    def widen_(self) -> bool:
        """Store a dense weight in fp32 (the device placement: 2 bytes more per weight, no conversion per step);
        returns whether the weight is fp32 now."""
        if self.format.fmt == "dense" and self.weight.dtype != torch.float32:
            self.weight = self.weight.float()
        return self.format.fmt == "dense"


class Experts(nn.Module):
    """A SwiGLU expert stack: w13 [*lead, 2, I, d] (gate, up) and w2 [*lead, d, I]; lead = (E,) or () (shared)."""

    def __init__(self, lead: tuple[int, ...], dim: int, inter: int, b: Builder):
        super().__init__()
        self.w13 = b.linear("w13", dim, inter, leading=(*lead, 2))
        self.w2 = b.linear("w2", inter, dim, leading=lead)


class MoE(nn.Module):
    """On one rank of several (`b.shard`), the experts held are 1 / tp of every expert's intermediate dimension, or
    with expert parallel the whole experts `shard.experts` (a contiguous range); the output is then this rank's
    partial sum, which the block all-reduces. The router is replicated: every rank routes every token alike."""

    def __init__(self, cfg: ModelConfig, layer: int, b: Builder):
        super().__init__()
        d, I, shard = cfg.hidden_size, cfg.moe_intermediate_size, b.shard
        self.top_k, self.scaling, self.limit = cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.swiglu_limit
        self.ops = b.ops
        self.gate = Gate(cfg, layer, b)
        held = shard.experts if shard else range(cfg.n_routed_experts)
        # expert parallel: the global ids of the experts held, else None (every expert, as ids name them)
        self.held = held if len(held) < cfg.n_routed_experts else None
        self.experts = Experts((len(held),), d, shard.routed_intermediate if shard else I, b.sub("experts"))
        shared_inter = shard.shared_intermediate if shard else I
        self.shared_experts = Experts((), d, shared_inter, b.sub("shared_experts")) if cfg.n_shared_experts else None

    def route(self, flat: torch.Tensor, input_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """flat [T, d] (the ffn_norm'ed tokens), input_ids (hash routing; else unused) -> (weights, ids) [T, top_k]:
        the gate's logits routed by `ops.route`, with the biased top-k or the hash table."""
        g = self.gate
        return self.ops.route(g(flat), None if g.hash else g.bias, self.top_k, self.scaling,
                              g.tid2eid if g.hash else None, input_ids if g.hash else None, self.held)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """x [B, S, d] (the ffn_norm'ed block input), input_ids [B, S] (hash routing) -> [B, S, d].

        Expert parallel (`held`): routing numbers the experts held from 0 and gives each pick of an expert held
        elsewhere weight 0 on a held one (`ref.held_picks`), so the shapes stay fixed (a CUDA graph captures the
        step) and the pick adds exactly zero. The sorted path (prefill; decode past the expert blocks' token range)
        leaves such pairs out; the GEMV pair and the decode tiles run them, all T * k pairs on every rank."""
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = self.route(flat, input_ids)
        ex, sh = self.experts, self.shared_experts
        out = self.ops.moe(flat, ids, weights, ex.w13.qweight(), ex.w2.qweight(), self.limit,
                           shared=None if sh is None else (sh.w13.qweight(), sh.w2.qweight()), after_route=True)
        return out.view(x.shape)
