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
prefill (keys = this chunk) and a cached step (keys = window ring + chunk, entries = all emitted so far).

`state=None` is a fresh prefill of a rectangular batch from position 0 with nothing cached. Otherwise x is
the flattened tokens of a ragged `SeqBatch` ([1, N, d]) and `state` the layer's `LayerState` (views the
runtime owns; see state.py). Projections, norms and rope run on all N tokens at once; the keys are per
sequence (a loop here, one batched kernel later), for sequence i with `start` cached tokens:
* window: keys = its ring (row r holds position `ring_positions(start)[r]`, -1 = empty) + its chunk,
  masked by `window_bias`; the chunk's last `window` tokens are then written at rows p mod window;
* compressor (and the indexer's): `Compressor.append` pools the open rows + the chunk with the saved Ca
  half and writes the new entries into the sequence's pages; attention sees every entry emitted so far, HCA
  all visible ones, CSA the indexer's picks scored against every emitted indexer key.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .compressor import Compressor
from .indexer import Indexer, visible_entries
from .linear import Builder, grouped_linear
from .norm_rope import RMSNorm, Rope, apply_rope, rms
from .state import LayerState, SeqBatch


def window_bias(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Additive mask [B, S, T]: key at position p is visible to query t iff t - window < p <= t (p >= 0)."""
    q, k = q_pos.unsqueeze(-1), k_pos.unsqueeze(-2)
    ok = (k <= q) & (k > q - window) & (k >= 0)
    return torch.zeros(ok.shape, dtype=torch.float32, device=ok.device).masked_fill(~ok, float("-inf"))


def ring_positions(start: int, window: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Position held by each ring row once `start` tokens are cached: the latest p < start with p = row
    (mod window), or -1 if there is none yet. -> int64 [window]."""
    rows = torch.arange(window, device=device)
    held = start - 1 - torch.remainder(start - 1 - rows, window)
    return torch.where(held >= 0, held, -1)


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

    def forward(self, x: torch.Tensor, positions: torch.Tensor, state: LayerState | None = None,
                batch: SeqBatch | None = None) -> torch.Tensor:
        """x [B, S, d] (the attn_norm'ed block input) at `positions` [B, S] -> [B, S, d].

        state=None: a fresh causal prefill from position 0. Otherwise B = 1 and the S tokens are the ragged
        `batch`'s sequences, whose states this call reads and extends.
        """
        B, S, _ = x.shape
        cos, sin = self.rope(positions)                                   # [B, S, rope/2]
        qr = self.q_norm(self.wq_a(x))
        q = rms(self.wq_b(qr).view(B, S, self.n_heads, self.head_dim), self.eps)
        q = apply_rope(q, cos.unsqueeze(2), sin.unsqueeze(2))
        kv = apply_rope(self.kv_norm(self.wkv(x)), cos, sin)                # [B, S, D]

        if state is None:
            o = self._prefill(x, qr, q, kv, positions)
        else:
            if B != 1 or batch is None or batch.num_tokens != S:
                got = "no batch" if batch is None else f"a batch of {batch.num_tokens} tokens"
                raise ValueError(f"cached attention takes the flattened tokens of a SeqBatch as [1, N, d]; got x "
                                 f"{tuple(x.shape)} and {got}")
            o = self._cached(x, qr, q, kv, positions, state, batch)
        o = apply_rope(o, cos.unsqueeze(2), sin.unsqueeze(2), inverse=True)
        o = grouped_linear(o.reshape(B, S, self.groups, -1), self.wo_a, self.groups)
        return self.wo_b(o.flatten(2))

    def _prefill(self, x, qr, q, kv, positions) -> torch.Tensor:
        bias = window_bias(positions, positions, self.window)
        if self.compressor is not None:
            entries = self.compressor(x, positions, self.rope)             # [B, T, D]
            if self.indexer is not None:
                entry_bias = picked_entry_bias(self.indexer(x, qr, positions, self.rope), entries.shape[1])
            else:
                entry_bias = causal_entry_bias(positions, entries.shape[1], self.ratio)
            kv, bias = torch.cat((kv, entries), dim=1), torch.cat((bias, entry_bias), dim=-1)
        return attend(q, kv, bias, self.attn_sink, self.head_dim ** -0.5)

    def _cached(self, x, qr, q, kv, positions, state: LayerState, batch: SeqBatch) -> torch.Tensor:
        projected = self.compressor.project(x, positions) if self.compressor is not None else None
        out = []
        for slot, start, tok, pages in batch.spans():
            st, pos, new_kv = state.at(slot), positions[:, tok], kv[:, tok]
            keys = torch.cat((st.window, new_kv), dim=1)                    # [1, window + n, D]
            key_pos = torch.cat((ring_positions(start, self.window, pos.device), pos[0])).unsqueeze(0)
            bias = window_bias(pos, key_pos, self.window)
            if self.compressor is not None:
                entries = self.compressor.append(projected[0][:, tok], projected[1][:, tok], start,
                                                 st.compressor, pages, self.rope)
                if self.indexer is not None:
                    picks = self.indexer(x[:, tok], qr[:, tok], pos, self.rope, st.indexer, start, pages)
                    entry_bias = picked_entry_bias(picks, entries.shape[1])
                else:
                    entry_bias = causal_entry_bias(pos, entries.shape[1], self.ratio)
                keys, bias = torch.cat((keys, entries), dim=1), torch.cat((bias, entry_bias), dim=-1)
            out.append(attend(q[:, tok], keys, bias, self.attn_sink, self.head_dim ** -0.5))
            last = pos[0, -self.window:]
            st.window[0, last % self.window] = new_kv[0, -self.window:]
        return torch.cat(out, dim=1)
