"""The DeepSeek-V4 model: embedding into hc_mult streams, blocks (mHC around attention and MoE), HyperHead,
final norm and head; plus the MTP block(s), whose weights are held for speculative decoding.

Module paths equal the canonical checkpoint names (`layers.3.attn.wq_a`, `hc_head_fn`, `mtp.0.e_proj`, ...)
except the stacked experts (see moe.py). `build_model` creates the model on the meta device; the loader
materialises each buffer once, from the checkpoint.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..kernels import Ops
from .attention import Attention
from .linear import Builder, LinearFormat, QLinear
from .moe import MoE
from .norm_rope import RMSNorm
from .state import LayerState, SeqBatch


def _hc_buffers(module: nn.Module, prefix: str, rows: int, cols: int, n_scales: int) -> None:
    """mHC parameters `{prefix}_fn [rows, cols]`, `_base [rows]`, `_scale [n_scales]`, fp32."""
    for leaf, shape in (("fn", (rows, cols)), ("base", (rows,)), ("scale", (n_scales,))):
        module.register_buffer(f"{prefix}_{leaf}", torch.empty(shape, dtype=torch.float32))


class Embedding(nn.Module):
    def __init__(self, vocab: int, dim: int, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("weight", torch.empty(vocab, dim, dtype=dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, b: Builder):
        super().__init__()
        d = cfg.hidden_size
        self.layer = layer
        self.hc_args = (cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(d, cfg.rms_norm_eps)
        _hc_buffers(self, "hc_attn", cfg.hc_dim, cfg.hc_mult * d, 3)
        _hc_buffers(self, "hc_ffn", cfg.hc_dim, cfg.hc_mult * d, 3)
        self.attn = Attention(cfg, layer, b.sub("attn"))
        self.ffn = MoE(cfg, layer, b.sub("ffn"))
        self.ops = b.ops

    def forward(self, x: torch.Tensor, positions: torch.Tensor, input_ids: torch.Tensor,
                state: LayerState | None = None, batch: SeqBatch | None = None) -> torch.Tensor:
        """Streams x [B, S, n, d] -> [B, S, n, d]. Everything but attention is per token."""
        ops = self.ops
        u, post, comb = ops.hc_pre(x, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, *self.hc_args)
        x = ops.hc_post(self.attn(self.attn_norm(u), positions, state, batch), x, post, comb)
        u, post, comb = ops.hc_pre(x, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, *self.hc_args)
        return ops.hc_post(self.ffn(self.ffn_norm(u), input_ids), x, post, comb)


class MTPBlock(Block):
    """Multi-token prediction: a sliding-window, bias-routed block fed with the main model's streams at t and
    the embedding of token t+1; it has its own HyperHead and final norm and shares embed and head."""

    def __init__(self, cfg: ModelConfig, layer: int, b: Builder):
        super().__init__(cfg, layer, b)
        d = cfg.hidden_size
        self.e_proj = b.linear("e_proj", d, d)
        self.h_proj = b.linear("h_proj", d, d)
        self.enorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        _hc_buffers(self, "hc_head", cfg.hc_mult, cfg.hc_mult * d, 1)

    def forward(self, streams: torch.Tensor, next_embed: torch.Tensor, positions: torch.Tensor,
                next_ids: torch.Tensor, state=None) -> torch.Tensor:
        """Main-model streams [B, S, n, d] at t and embed(token t+1) [B, S, d] -> the draft's streams."""
        x = self.e_proj(self.enorm(next_embed)).unsqueeze(2) + self.h_proj(self.hnorm(streams))
        return super().forward(x, positions, next_ids, state)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, b: Builder, mtp: bool = True):
        super().__init__()
        d, L = cfg.hidden_size, cfg.num_hidden_layers
        self.config = cfg
        self.hc_eps, self.norm_eps = cfg.hc_eps, cfg.rms_norm_eps
        self.ops = b.ops
        self.embed = Embedding(cfg.vocab_size, d, b.dtype)
        self.layers = nn.ModuleList(Block(cfg, i, b.sub(f"layers.{i}")) for i in range(L))
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.head = b.linear("head", d, cfg.vocab_size)
        _hc_buffers(self, "hc_head", cfg.hc_mult, cfg.hc_mult * d, 1)
        n_mtp = cfg.num_nextn_predict_layers if mtp else 0
        self.mtp = nn.ModuleList(MTPBlock(cfg, L + j, b.sub(f"mtp.{j}")) for j in range(n_mtp))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                states: list[LayerState] | None = None, batch: SeqBatch | None = None) -> torch.Tensor:
        """input_ids [B, S] -> the final residual streams [B, S, hc_mult, d] (before the HyperHead).

        positions=None and states=None: a causal prefill from position 0 with nothing cached. With `states`
        (one LayerState per layer, runtime-owned) the input is a ragged step: input_ids and positions [1, N]
        are the flattened tokens of `batch`'s sequences, whose caches are read and extended.
        """
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape)
        if states is not None and len(states) != len(self.layers):
            raise ValueError(f"{len(states)} layer states for a model of {len(self.layers)} layers")
        if batch is not None:
            batch = batch.on(input_ids.device)
        h = self.embed(input_ids)
        x = h.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, input_ids, None if states is None else states[i], batch)
        return x

    def head_logits(self, streams: torch.Tensor, hc: tuple[torch.Tensor, ...] | None = None,
                    norm: RMSNorm | None = None) -> torch.Tensor:
        """Streams [B, S, n, d] -> logits [B, S, vocab] through a HyperHead (the model's, or an MTP block's)."""
        fn, base, scale = hc or (self.hc_head_fn, self.hc_head_base, self.hc_head_scale)
        y = self.ops.hc_head(streams, fn, base, scale, self.hc_eps, self.norm_eps)
        return self.head((norm or self.norm)(y))

    @torch.inference_mode()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Causal prefill from position 0: LongTensor [B, S] -> logits [B, S, vocab] in the compute dtype."""
        return self.head_logits(self(input_ids))

    @torch.inference_mode()
    def mtp_logits(self, streams: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor | None = None,
                   depth: int = 0) -> torch.Tensor:
        """Draft logits of MTP block `depth` from the main streams at t and tokens t+1 (speculative decoding)."""
        if positions is None:
            positions = torch.arange(next_ids.shape[1], device=next_ids.device).expand(next_ids.shape)
        blk = self.mtp[depth]
        x = blk(streams, self.embed(next_ids), positions, next_ids)
        return self.head_logits(x, (blk.hc_head_fn, blk.hc_head_base, blk.hc_head_scale), blk.norm)

    def tile_weights_(self) -> int:
        """Store every quantized weight whose shape allows it tile-major, the order the GPU kernels read
        (`formats.tiling`); returns how many layers are stored tiled (a second call tiles nothing twice).
        Logits do not change; `state_dict()` then holds tiled bytes, so this is for the device placement only
        (the loader calls it on CUDA)."""
        return sum(m.tile_() for m in self.modules() if isinstance(m, QLinear))

    def num_parameters(self, include_mtp: bool = False) -> int:
        """Logical (dequantized) parameter count: gate biases in; tid2eid, quantization scales, rope out."""
        n = 0
        for name, m in self.named_modules():
            if name.startswith("mtp.") and not include_mtp:
                continue
            if isinstance(m, QLinear):
                n += m.logical_numel()
                own = [m.bias] if hasattr(m, "bias") else []      # a router's gate bias
            else:
                own = [t for k, t in m._buffers.items() if k not in m._non_persistent_buffers_set]
            n += sum(t.numel() for t in own if t.is_floating_point())
        return n


def build_model(cfg: ModelConfig, formats: dict[str, LinearFormat] | None = None, dtype: torch.dtype = torch.float32,
                ops: Ops | None = None, mtp: bool = True,
                device: torch.device | str = "meta") -> Transformer:
    """The model with uninitialised buffers (on the meta device by default: no memory until the loader fills it).

    `formats` maps linear module paths (`layers.3.ffn.experts.w13`) to their storage; absent ones are dense.
    mtp=False leaves out the MTP block(s) (for checkpoints that never had them, e.g. a transformers save).
    """
    with torch.device(device):
        model = Transformer(cfg, Builder(formats, dtype, ops or Ops.reference()), mtp)
    unknown = sorted(set(formats or {}) - {n for n, m in model.named_modules() if isinstance(m, QLinear)})
    if unknown:
        raise ValueError(f"formats given for modules the model does not have: {unknown[:8]}")
    return model
