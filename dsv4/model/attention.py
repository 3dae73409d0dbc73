"""V4 attention: low-rank q, one shared K=V head, sliding window + compressed entries, sinks, grouped output.

    qr = q_norm(wq_a x)                         also the indexer's query input
    q  = rope_t(rms(wq_b qr per head))          unweighted per-head RMS, then rope on the trailing channels
    kv = rope_t(kv_norm(wkv x))                 one 512-wide vector: key and value
    keys: the window (last `sliding_window` tokens including t) + compressed entries
          (HCA: all visible; CSA: the indexer's picks)
    o_h = sum_s softmax(q_h.k_s / sqrt(D) | sink_h) kv_s    the sink enters only the denominator
    o_h = rope_t^-1(o_h)                        undo the value's absolute rotation at the query position
    out = wo_b(grouped wo_a(o))                 groups of consecutive heads, block-diagonal wo_a

Masks are built from absolute positions (keys' and queries'), so the same `attend` serves a stateless
prefill (keys = this chunk) and a cached decode (keys = window ring + chunk, entries = all emitted so far).

`state=None` is a fresh prefill from position 0 with nothing cached. Cached decoding and chunked prefill
(issue 4) pass a per-layer state the runtime allocates and owns; forward only reads and updates it:
* window: a ring [B, sliding_window, D] of rotated kv with the position of each slot (-1 = empty); keys =
  ring + this chunk, masked by `window_bias(positions, key_positions)`; the chunk's last tokens are then
  written at slot p mod window;
* per compressor (main, and the indexer's): the rows of the open window (kv, score incl. ape), for CSA the
  Ca half of the last complete window, the entries emitted so far and their count. A step is
  `project` -> prepend the open rows -> `pool` the complete windows with `prev` = the saved Ca half ->
  `finish` at `first_window` = the count -> append; the entries for `attend` are all emitted ones;
* the indexer scores queries against all its emitted keys (`Indexer.scores` / `select`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .compressor import Compressor
from .indexer import Indexer, visible_entries
from .linear import Builder, grouped_linear
from .norm_rope import RMSNorm, Rope, apply_rope, rms


def window_bias(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Additive mask [B, S, T]: key at position p is visible to query t iff t - window < p <= t (p >= 0)."""
    q, k = q_pos.unsqueeze(-1), k_pos.unsqueeze(-2)
    ok = (k <= q) & (k > q - window) & (k >= 0)
    return torch.zeros(ok.shape, dtype=torch.float32, device=ok.device).masked_fill(~ok, float("-inf"))


def causal_entry_bias(q_pos: torch.Tensor, n_entries: int, ratio: int) -> torch.Tensor:
    """HCA: entry j is visible to query t iff (j+1)*ratio <= t+1. -> [B, S, n_entries]."""
    ids = torch.arange(n_entries, device=q_pos.device)
    hidden = ids >= visible_entries(q_pos, ratio).unsqueeze(-1)
    return torch.zeros(hidden.shape, dtype=torch.float32, device=q_pos.device).masked_fill(hidden, float("-inf"))


def picked_entry_bias(picks: torch.Tensor, n_entries: int) -> torch.Tensor:
    """CSA: only the indexer's valid picks [B, S, k] (-1 = invalid) are visible. -> [B, S, n_entries]."""
    B, S, _ = picks.shape
    bias = torch.full((B, S, n_entries + 1), float("-inf"), device=picks.device)
    bias.scatter_(-1, torch.where(picks >= 0, picks, n_entries), 0.0)   # invalid picks land in a dropped column
    return bias[..., :n_entries]


def attend(q: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor, sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, S, H, D], shared K=V kv [B, T, D], additive bias [B, S, T], sinks [H] -> o [B, S, H, D].

    The sink is one more logit per head (not scaled) whose probability is dropped.
    """
    B, S, H, _ = q.shape
    logits = torch.matmul(q.transpose(1, 2), kv.transpose(-1, -2).unsqueeze(1)) * scale     # [B, H, S, T]
    logits = logits + bias.unsqueeze(1).to(logits.dtype)
    logits = torch.cat((logits, sinks.view(1, H, 1, 1).expand(B, H, S, 1).to(logits.dtype)), dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(kv.dtype)
    return torch.matmul(probs, kv.unsqueeze(1)).transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, b: Builder):
        super().__init__()
        H, D, d = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
        self.n_heads, self.head_dim, self.groups = H, D, cfg.o_groups
        self.window, self.eps = cfg.sliding_window, cfg.rms_norm_eps
        self.ratio = cfg.compress_ratio(layer)
        self.wq_a = b.linear("wq_a", d, cfg.q_lora_rank)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = b.linear("wq_b", cfg.q_lora_rank, H * D)
        self.wkv = b.linear("wkv", d, D)
        self.kv_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.wo_a = b.linear("wo_a", H * D // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank)
        self.wo_b = b.linear("wo_b", cfg.o_groups * cfg.o_lora_rank, d)
        self.register_buffer("attn_sink", torch.empty(H, dtype=torch.float32))
        self.rope = Rope(cfg, compress=self.ratio > 0)
        self.compressor = Compressor(cfg, self.ratio, D, b.sub("compressor")) if self.ratio else None
        self.indexer = Indexer(cfg, b.sub("indexer")) if self.ratio == 4 else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, state=None) -> torch.Tensor:
        """x [B, S, d] (the attn_norm'ed block input) at `positions` [B, S] -> [B, S, d].

        state=None: a fresh causal prefill from position 0 (keys are this chunk only; nothing is cached).
        """
        if state is not None:
            raise NotImplementedError("cached attention arrives with the runtime (issue 4)")
        B, S, _ = x.shape
        cos, sin = self.rope(positions)                                   # [B, S, rope/2]
        qr = self.q_norm(self.wq_a(x))
        q = rms(self.wq_b(qr).view(B, S, self.n_heads, self.head_dim), self.eps)
        q = apply_rope(q, cos.unsqueeze(2), sin.unsqueeze(2))
        kv = apply_rope(self.kv_norm(self.wkv(x)), cos, sin)                # [B, S, D]

        bias = window_bias(positions, positions, self.window)
        if self.compressor is not None:
            entries = self.compressor(x, positions, self.rope)             # [B, T, D]
            if self.indexer is not None:
                entry_bias = picked_entry_bias(self.indexer(x, qr, positions, self.rope), entries.shape[1])
            else:
                entry_bias = causal_entry_bias(positions, entries.shape[1], self.ratio)
            kv, bias = torch.cat((kv, entries), dim=1), torch.cat((bias, entry_bias), dim=-1)

        o = attend(q, kv, bias, self.attn_sink, self.head_dim ** -0.5)
        o = apply_rope(o, cos.unsqueeze(2), sin.unsqueeze(2), inverse=True)
        o = grouped_linear(o.reshape(B, S, self.groups, -1), self.wo_a, self.groups)
        return self.wo_b(o.flatten(2))
