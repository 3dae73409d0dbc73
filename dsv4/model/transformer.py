"""The DeepSeek-V4 model: embedding into hc_mult streams, blocks (mHC around attention and MoE), HyperHead,
final norm and head; plus the MTP block(s), whose weights are held for speculative decoding.

Module paths equal the canonical checkpoint names (`layers.3.attn.wq_a`, `hc_head_fn`, `mtp.0.e_proj`, ...)
except the stacked experts (see moe.py). `build_model` creates the model on the meta device; the loader
materialises each buffer once, from the checkpoint.

One rank of several (`parallel.Shard`, docs/parallel.md) builds its part: its pipeline stage's layers (the others are
None in `layers`, so paths stay canonical), the embedding on the first stage, the HyperHead, norm, head and MTP
blocks on the last; with tensor parallelism H / tp query heads per attention, its slice of every expert (or its
experts), its vocabulary rows of embedding and head. The block all-reduces attention's and the MoE's partial outputs,
the embedding its masked lookup, and the head gathers its logits; with tp = 1 none of these runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..kernels import Ops
from ..parallel import Communicator, Shard
from .attention import Attention
from .linear import Builder, LinearFormat, QLinear
from .moe import Gate, MoE
from .norm_rope import RMSNorm, StepRope
from .state import LayerState, SeqBatch


Pending = tuple[torch.Tensor, torch.Tensor, torch.Tensor]    # a residual update not yet applied: (out, post, comb)


def _hc_buffers(module: nn.Module, prefix: str, rows: int, cols: int, n_scales: int) -> None:
    """mHC parameters `{prefix}_fn [rows, cols]`, `_base [rows]`, `_scale [n_scales]`, fp32."""
    for leaf, shape in (("fn", (rows, cols)), ("base", (rows,)), ("scale", (n_scales,))):
        module.register_buffer(f"{prefix}_{leaf}", torch.empty(shape, dtype=torch.float32))


class Embedding(nn.Module):
    """Rows `rows` of the embedding; with a communicator, ids outside them look up zeros and the ranks' lookups are
    summed (exactly one rank holds each id's row)."""

    def __init__(self, vocab: int, dim: int, dtype: torch.dtype, rows: range | None = None,
                 comm: Communicator | None = None):
        super().__init__()
        self.rows, self.comm = rows or range(vocab), comm
        self.register_buffer("weight", torch.empty(len(self.rows), dim, dtype=dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.comm is None:
            return F.embedding(ids, self.weight)
        local = ids - self.rows.start
        elsewhere = (local < 0) | (local >= len(self.rows))
        h = F.embedding(local.masked_fill(elsewhere, 0), self.weight).masked_fill(elsewhere.unsqueeze(-1), 0)
        return self.comm.all_reduce(h)


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
        self.attn = Attention(b.shard.attention_config() if b.shard else cfg, layer, b.sub("attn"))
        self.ffn = MoE(cfg, layer, b.sub("ffn"))
        self.ops, self.comm = b.ops, b.comm

    def forward(self, x: torch.Tensor, positions: torch.Tensor, input_ids: torch.Tensor,
                state: LayerState | None = None, batch: SeqBatch | None = None, ropes: StepRope | None = None,
                pending: Pending | None = None) -> tuple[torch.Tensor, Pending]:
        """Streams x [B, S, n, d] -> (streams, pending): the block's attention residual is applied to the streams,
        its MoE's is returned as pending (MoE output, post, comb), which the next block's collapse applies in the
        same launches (`Ops.hc_post_pre`) or `settle` applies. `pending`: the previous block's, applied here first
        the same way. Everything but attention is per token. `ropes`: the forward's rope tables (shared by its
        layers)."""
        ops = self.ops
        attn = (self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, *self.hc_args, self.attn_norm.weight,
                self.attn_norm.eps)                                  # the collapse comes out normed
        if pending is None:
            u, post, comb = ops.hc_pre(x, *attn)
        else:
            x, u, post, comb = ops.hc_post_pre(pending[0], x, pending[1], pending[2], *attn)
        a = self._summed(self.attn(u, positions, state, batch, ropes))
        x, u, post, comb = ops.hc_post_pre(a, x, post, comb, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale,
                                           *self.hc_args, self.ffn_norm.weight, self.ffn_norm.eps)
        return x, (self._summed(self.ffn(u, input_ids)), post, comb)

    def settle(self, x: torch.Tensor, pending: Pending) -> torch.Tensor:
        """The streams with a pending residual update applied (`forward`)."""
        return self.ops.hc_post(pending[0], x, pending[1], pending[2])

    def _summed(self, partial: torch.Tensor) -> torch.Tensor:
        """A sub-block's output: on tensor-parallel ranks the sum of their partial outputs."""
        return partial if self.comm is None else self.comm.all_reduce(partial)


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
        return self.settle(*super().forward(x, positions, next_ids, state))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, b: Builder, mtp: bool = True):
        super().__init__()
        d, L = cfg.hidden_size, cfg.num_hidden_layers
        self.config = cfg
        self.hc_eps, self.norm_eps = cfg.hc_eps, cfg.rms_norm_eps
        self.ops, self.comm, shard = b.ops, b.comm, b.shard
        self.stage = shard.layers if shard else range(L)          # the main layers this rank runs
        first, last = shard is None or shard.first_stage, shard is None or shard.last_stage
        vocab = shard.vocab if shard else range(cfg.vocab_size)
        # the head's vocabulary rows on each rank of the tensor-parallel group, in rank order (for the gather)
        self.vocab_sizes = [len(shard.layout.vocab_rows(cfg, t)) for t in range(shard.tp)] if shard else None
        self.embed = Embedding(cfg.vocab_size, d, b.dtype, vocab, b.comm) if first else None
        self.layers = nn.ModuleList(Block(cfg, i, b.sub(f"layers.{i}")) if i in self.stage else None for i in range(L))
        if last:
            self.norm = RMSNorm(d, cfg.rms_norm_eps)
            self.head = b.linear("head", d, len(vocab))
            _hc_buffers(self, "hc_head", cfg.hc_mult, cfg.hc_mult * d, 1)
        n_mtp = cfg.num_nextn_predict_layers if mtp and last else 0
        self.mtp = nn.ModuleList(MTPBlock(cfg, L + j, b.sub(f"mtp.{j}")) for j in range(n_mtp))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                states: list[LayerState] | None = None, batch: SeqBatch | None = None,
                streams: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, S] -> the final residual streams [B, S, hc_mult, d] (before the HyperHead).

        positions=None and states=None: a causal prefill from position 0 with nothing cached. With `states`
        (one LayerState per layer of `stage`, runtime-owned) the input is a ragged step: input_ids and positions
        [1, N] are the flattened tokens of `batch`'s sequences, whose caches are read and extended. `streams`: the
        previous pipeline stage's output, which this stage's layers continue (the ids still route hash layers).
        """
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape)
        if states is not None and len(states) != len(self.stage):
            raise ValueError(f"{len(states)} layer states for a model of {len(self.stage)} layers")
        if batch is not None:
            batch = batch.on(input_ids.device)
            first = next((s.compressor for s in states or () if s.compressor is not None), None)
            if first is not None:      # once a step: every compressed layer's pages cover the same positions
                batch.check_pages(first.entries.shape[1], first.open_kv.shape[1])
        x = streams
        if x is None:
            h = self.embed(input_ids)
            x = h.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()
        ropes = StepRope(positions)                                  # cos / sin once per rope, for every layer
        pending = None                                               # a block's MoE residual, applied by the next
        for i in self.stage:
            x, pending = self.layers[i](x, positions, input_ids,
                                        None if states is None else states[i - self.stage.start], batch, ropes,
                                        pending)
        return x if pending is None else self.layers[self.stage[-1]].settle(x, pending)

    def head_logits(self, streams: torch.Tensor, hc: tuple[torch.Tensor, ...] | None = None,
                    norm: RMSNorm | None = None) -> torch.Tensor:
        """Streams [B, S, n, d] -> logits [B, S, vocab] through a HyperHead (the model's, or an MTP block's)."""
        fn, base, scale = hc or (self.hc_head_fn, self.hc_head_base, self.hc_head_scale)
        norm = norm or self.norm
        logits = self.head(self.ops.hc_head(streams, fn, base, scale, self.hc_eps, self.norm_eps, norm.weight,
                                            norm.eps))                  # collapsed and normed
        return logits if self.comm is None else self.comm.gather_last(logits, self.vocab_sizes)

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

    def fuse_projections_(self) -> int:
        """Each attention's projections in fewer products: the compressors' dense ones of x as one
        (`Attention.fuse_projections_`), wq_a with wkv (`Attention.fuse_query_kv_`) and, on CSA layers whose Ops
        table has no second stream, wq_b with the indexer's (`Attention.fuse_queries_`; with one, the indexer's
        product and picks run there beside wq_b's); returns how many layers run the first fused. Logits may change
        in the last bit (one GEMM's rounding instead of several)."""
        attentions = [m for m in self.modules() if isinstance(m, Attention)]
        for m in attentions:
            m.fuse_query_kv_()
            if m.ops.beside is None:
                m.fuse_queries_()
        return sum(m.fuse_projections_() for m in attentions)

    def prepare_for_kernels_(self) -> None:
        """The device placement's layout for the GPU kernels: weights tile-major (`tile_weights_`), fused
        projections (`fuse_projections_`) and the routers' dense weights in fp32 (`Gate.widen_`). The loader and the
        dummy builders' callers run it on CUDA."""
        self.tile_weights_()
        self.fuse_projections_()
        for m in self.modules():
            if isinstance(m, Gate):
                m.widen_()

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
                ops: Ops | None = None, mtp: bool = True, device: torch.device | str = "meta",
                shard: Shard | None = None, comm: Communicator | None = None) -> Transformer:
    """The model with uninitialised buffers (on the meta device by default: no memory until the loader fills it).

    `formats` maps linear module paths (`layers.3.ffn.experts.w13`) to their storage; absent ones are dense.
    mtp=False leaves out the MTP block(s) (for checkpoints that never had them, e.g. a transformers save).
    shard: build only one rank's part (`parallel.Shard`; formats of modules it does not hold are ignored), whose
    tensor-parallel group's collectives run through `comm` (None where tp = 1).
    """
    with torch.device(device):
        model = Transformer(cfg, Builder(formats, dtype, ops or Ops.reference(), shard=shard, comm=comm), mtp)
    unknown = sorted(set(formats or {}) - {n for n, m in model.named_modules() if isinstance(m, QLinear)})
    unknown = [n for n in unknown if shard is None or shard.holds(n)]
    if unknown:
        raise ValueError(f"formats given for modules the model does not have: {unknown[:8]}")
    return model
