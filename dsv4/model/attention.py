"""V4 attention: low-rank q, one shared K=V head, sliding window + compressed entries, sinks, grouped output.

    qr = q_norm(wq_a x)                         also the indexer's query input
    q  = rope_t(rms(wq_b qr per head))          unweighted per-head RMS, then rope on the trailing channels
    kv = rope_t(kv_norm(wkv x))                 one 512-wide vector: key and value
    keys: the window (last `sliding_window` tokens including t) + compressed entries
          (HCA: all visible; CSA: the indexer's picks)
    o_h = sum_s softmax(q_h.k_s / sqrt(D) | sink_h) kv_s    the sink enters only the denominator
    o_h = rope_t^-1(o_h)                        undo the value's absolute rotation at the query position
    out = wo_b(grouped wo_a(o))                 groups of consecutive heads, block-diagonal wo_a

With the fp8 cache (`LayerState.fp8_nope`) the step's K = V rows take the values a packed fp8 row holds (DeepSeek's
reference rounds them so: the trained weights expect it), the compressed entries are stored packed, and attention
reads them decoded; the fresh prefill (state=None) has no cache and no rounding.

Masks are built from absolute positions (keys' and queries'), so the same `attend` serves a stateless
prefill (keys = this chunk) and a cached step (keys = window ring + chunk, entries = all emitted so far).

`state=None` is a fresh prefill of a rectangular batch from position 0 with nothing cached. Otherwise x is
the flattened tokens of a ragged `SeqBatch` ([1, N, d]) and `state` the layer's `LayerState` (views the
runtime owns; see state.py). Projections, norms and rope run on all N tokens at once (q_norm and kv_norm in one
`ops.norm_ropes` call; the queries' norm and rope and the output's inverse rope inside `ops.sparse_attention`), and
so does the rest, through `Ops` (Triton kernels on the GPU, `kernels.ref` elsewhere), for sequence i with `start`
cached tokens:
* compressor (and the indexer's, in the same call): `ops.compress` pools the open rows + the step's rows with the
  saved Ca half and writes the entries of the windows that close into the sequence's pages;
* indexer: `ops.index_picks` scores each token against every key its sequence has emitted, top-k;
* attention: `ops.sparse_attention` over the ring (row r holds position `ring_positions(start)[r]`, -1 = empty),
  the step's rows and the entries (HCA all visible ones, CSA the picks); `ops.write_ring` then keeps each
  sequence's last `window` rows at rows p mod window.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..formats import FP8_BLOCK, QWeight
from ..kernels import Ops, Pending
from ..kernels.ref import SecondCompressor, attend, causal_entry_bias, picked_entry_bias, window_bias
from .compressor import Compressor
from .indexer import Indexer
from .linear import Builder, QLinear, grouped_linear
from .norm_rope import RMSNorm, Rope, StepRope
from .state import LayerState, SeqBatch


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
        self.ops = b.ops
        self.rope = Rope(cfg, compress=self.ratio > 0)
        self.compressor = Compressor(cfg, self.ratio, D, b.sub("compressor")) if self.ratio else None
        self.indexer = Indexer(cfg, b.sub("indexer")) if self.ratio == 4 else None
        # `fuse_projections_`: the dense projections of x in one weight, and their widths (a plain attribute, not a
        # buffer: built after loading, on the device, from the loaded weights, which become views of it)
        self.x_dense: torch.Tensor | None = None
        self.x_dense_widths: tuple[int, ...] = ()
        self.x_query_kv: QWeight | None = None      # `fuse_query_kv_`: wq_a and wkv as one weight (rows stacked)
        self.qr_queries: QWeight | None = None      # `fuse_queries_`: wq_b and the indexer's wq_b (CSA layers)

    def dense_projections(self) -> list[QLinear]:
        """The dense-capable projections of x a cached step runs besides wq_a / wkv, in the order of their rows in
        `x_dense`: the compressor's wkv, wgate, and on CSA layers the indexer compressor's and weights_proj."""
        if self.compressor is None:
            return []
        ix = self.indexer
        extra = [ix.compressor.wkv, ix.compressor.wgate, ix.weights_proj] if ix is not None else []
        return [self.compressor.wkv, self.compressor.wgate, *extra]

    def fuse_projections_(self) -> bool:
        """Run `dense_projections` as one product: their weights (all dense, in one dtype) move into one [sum N, d]
        buffer, each module's weight becoming a view of its rows (no memory added). The device placement calls this
        (one GEMV instead of up to five per layer); rounding may differ from separate products in the last bit, so
        the CPU's reference model keeps them apart. Returns whether the layer's projections are fused."""
        parts = self.dense_projections()
        if self.x_dense is None and parts and all(p.format.fmt == "dense" for p in parts) \
                and len({p.weight.dtype for p in parts}) == 1:
            self.x_dense = stack_rows_(*parts).weight
            self.x_dense_widths = tuple(p.out_features for p in parts)
        return self.x_dense is not None

    def fuse_query_kv_(self) -> bool:
        """Run wq_a and wkv (both products of x) as one: their weights and scales move into one buffer, wq_a's
        rows first, each layer's becoming a view of its rows (no memory added; `stackable`, `stack_rows_`). The
        device placement calls this; rounding may differ from separate products in the last bit, so the CPU's
        reference model keeps them apart. Returns whether they are fused."""
        if self.x_query_kv is None and stackable(self.wq_a, self.wkv):
            self.x_query_kv = stack_rows_(self.wq_a, self.wkv)
        return self.x_query_kv is not None

    def fuse_queries_(self) -> bool:
        """On CSA layers, run wq_b and the indexer's wq_b (both products of qr) as one, wq_b's rows first, as
        `fuse_query_kv_` does; the indexer's picks then run after wq_b, not beside it (`_start_picks`). Returns
        whether they are fused."""
        if self.qr_queries is None and self.indexer is not None and stackable(self.wq_b, self.indexer.wq_b):
            self.qr_queries = stack_rows_(self.wq_b, self.indexer.wq_b)
        return self.qr_queries is not None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, state: LayerState | None = None,
                batch: SeqBatch | None = None, ropes: StepRope | None = None) -> torch.Tensor:
        """x [B, S, d] (the attn_norm'ed block input) at `positions` [B, S] -> [B, S, d].

        state=None: a fresh causal prefill from position 0. Otherwise B = 1 and the S tokens are the ragged
        `batch`'s sequences, whose states this call reads and extends. `ropes`: the forward's rope tables at
        `positions` (shared by its layers), else computed here.
        """
        B, S, _ = x.shape
        ropes = ropes or StepRope(positions)
        cos, sin = ropes.at(self.rope)                                    # [B, S, rope/2]
        ops = self.ops                                                    # norm + rope: one kernel each
        compressed = picks = None          # a cached step's compressors and picks, running beside the products
        if state is not None:
            if B != 1 or batch is None or batch.num_tokens != S:
                got = "no batch" if batch is None else f"a batch of {batch.num_tokens} tokens"
                raise ValueError(f"cached attention takes the flattened tokens of a SeqBatch as [1, N, d]; got x "
                                 f"{tuple(x.shape)} and {got}")
            batch = batch.on(x.device)
            compressed = self._start_compressors(x, ropes, state, batch)
        if self.x_query_kv is not None:                                  # wq_a and wkv in one product
            xq, xkv = ops.linear(x, self.x_query_kv).split((self.wq_a.out_features, self.wkv.out_features), -1)
        else:
            xq, xkv = self.wq_a(x), self.wkv(x)
        fp8_nope = state.fp8_nope if state is not None else 0                # the fp8 cache's values
        qr, kv = ops.norm_ropes((xq, None, None, self.q_norm.weight, self.q_norm.eps),   # one launch; kv [B, S, D]
                                (xkv, cos, sin, self.kv_norm.weight, self.kv_norm.eps, False, fp8_nope))
        if state is not None and self.indexer is not None and self.qr_queries is None:
            picks = self._start_picks(qr, ropes, state, batch, compressed)    # beside wq_b
        index_q = None                                                   # the indexer's wq_b(qr), where fused
        if self.qr_queries is not None and state is not None:            # wq_b and the indexer's in one product
            q, index_q = ops.linear(qr, self.qr_queries).split((self.wq_b.out_features,
                                                                self.indexer.wq_b.out_features), -1)
        else:
            q = self.wq_b(qr)
        q = q.view(B, S, self.n_heads, self.head_dim)
        if state is None:
            q = ops.norm_rope(q, cos, sin, eps=self.eps)
            o = ops.norm_rope(self._prefill(x, qr, q, kv, positions), cos, sin, inverse=True)
        else:               # the attention launch normalises and rotates q, and rotates its output back
            o = self._cached(qr, q, kv, ropes, state, batch, index_q, compressed, picks)
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

    def _start_compressors(self, x, ropes: StepRope, state: LayerState, batch: SeqBatch) -> Pending | None:
        """A cached step's compressors (CSA: with the indexer's, in the same launch), started beside the query and
        kv products that follow (`Ops.start`; they read x alone, and nothing reads the compressors' states before
        the join): the dense products of x, then `ops.compress` for every sequence at once. The result is the
        products' rows (the indexer reads its weights_proj rows); None without a compressor."""
        if self.compressor is None:
            return None
        window = ropes.at(self.rope, self.ratio)     # both compressors' (CSA: ratio 4); made here, on this stream

        def work(ops):
            if self.x_dense is not None:                                  # kv, score (, index kv, score, weights)
                rows = ops.linear(x[0], QWeight("dense", self.x_dense)).split(self.x_dense_widths, -1)
            else:
                rows = [ops.linear(x[0], p.qweight()) for p in self.dense_projections()]
            second = None           # CSA: the indexer's (ratio 4, as the layer's), stepped in the same launch
            if self.indexer is not None:
                ic = self.indexer.compressor
                second = SecondCompressor(rows[2], rows[3], ic.ape, state.indexer, ic.norm.weight, ic.norm.eps)
            self._compress(ops, self.compressor, state.compressor, rows[0], rows[1], window, batch, second)
            return tuple(rows)
        return self.ops.start(x, work)

    def _start_picks(self, qr, ropes: StepRope, state: LayerState, batch: SeqBatch, compressed: Pending) -> Pending:
        """The indexer's picks for every sequence at once, started beside wq_b's product of qr (`Ops.start`, after
        the compressors there): its own query product of qr, rotated, then `ops.index_picks` over the keys the
        compressors wrote, with their weights_proj rows."""
        ix = self.indexer
        cos, sin = ropes.at(self.rope)

        def work(ops):
            iq = ix.rotated_queries(qr, cos, sin, product=ops.linear(qr, ix.wq_b.qweight()))
            return ops.index_picks(iq[0], compressed.value[4], state.indexer.entries, batch.tokens, ix.topk, 4,
                                   ix.scale, batch.key_bound(4), ix.head_scale, state.indexer.entry_scales)
        return self.ops.start(qr, work)

    def _cached(self, qr, q, kv, ropes: StepRope, state: LayerState, batch: SeqBatch,
                index_q: torch.Tensor | None = None, compressed: Pending | None = None,
                picks: Pending | None = None) -> torch.Tensor:
        """Attention for every token of the step in one `ops.sparse_attention` over the rings, the step's rows and
        the paged entries, once the compressors (and, where started, the picks) have joined; then the rings. q is
        wq_b's product per head: the attention normalises and rotates it, and rotates its output back. Where the
        indexer's query product came with wq_b's (index_q, `fuse_queries_`), its picks run here."""
        steps = batch.tokens
        entries = None
        if compressed is not None:
            rows = compressed.join()
            entries = state.compressor.entries
            if picks is not None:
                picks = picks.join()
            elif self.indexer is not None:
                ix = self.indexer
                iq = ix.rotated_queries(qr, *ropes.at(self.rope), product=index_q)
                picks = self.ops.index_picks(iq[0], rows[4], state.indexer.entries, steps, ix.topk, 4, ix.scale,
                                             batch.key_bound(4), ix.head_scale, state.indexer.entry_scales)
        decode = batch.max_length == 1        # one token per sequence: the attention launch updates the rings
        cos, sin = ropes.at(self.rope)
        o = self.ops.sparse_attention(q[0], kv[0], state.window, entries, picks, steps, self.ratio, self.attn_sink,
                                      self.head_dim ** -0.5, batch.key_bound(self.ratio) if self.ratio else None,
                                      update_ring=decode,
                                      entry_nope=state.compressor.packed_nope if self.compressor is not None else 0,
                                      rope=(cos[0], sin[0]), q_eps=self.eps)
        if not decode:
            self.ops.write_ring(state.window, kv[0], steps)
        return o[None]

    @staticmethod
    def _compress(ops: Ops, compressor: Compressor, cstate, kv, score, window, batch: SeqBatch,
                  second: SecondCompressor | None = None) -> None:
        """kv, score [N, width]: the step's rows of the compressor's wkv and wgate (ape not added); `second`: another
        compressor of the same ratio stepped with it (`Ops.compress`)."""
        cos, sin = window
        ops.compress(kv, score, compressor.ape, batch.tokens, cstate, compressor.ratio, cos[0], sin[0],
                     compressor.norm.weight, compressor.norm.eps, -(-batch.max_length // compressor.ratio),
                     second=second)


def stackable(a: QLinear, b: QLinear) -> bool:
    """Whether b's rows stack under a's unchanged (`stack_rows_`), as one product's weight: one format of dense, fp8
    (a's rows a whole number of 128-row scale blocks) or mxfp4 (scales per row), one scale dtype, both stored tiled or
    neither (tiles are row blocks, so stacked tiled weights are the tiled stack)."""
    fmt = a.format.fmt
    return (a.format == b.format and fmt in ("dense", "fp8", "mxfp4") and not a.leading and not b.leading
            and a.tiled == b.tiled and a.weight.dtype == b.weight.dtype
            and (fmt != "fp8" or a.out_features % FP8_BLOCK == 0))


def stack_rows_(*linears: QLinear) -> QWeight:
    """The linears' weights (and scales, unless dense) moved into one buffer, in order, each linear's becoming a view
    of its rows (no memory added): the weight of one product for linears of the same input (the caller checks that
    they stack, `stackable`)."""
    first = linears[0]
    weight = torch.cat([m.weight for m in linears])
    for m, rows in zip(linears, weight.split([m.out_features for m in linears])):
        m.weight = rows
    scale = None
    if first.format.fmt != "dense":
        scale = torch.cat([m.scale for m in linears])
        for m, rows in zip(linears, scale.split([m.scale.shape[0] for m in linears])):
            m.scale = rows
    return QWeight(first.format.fmt, weight, scale, None, None, tiled=first.tiled)
