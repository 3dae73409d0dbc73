"""Pieces of the forward that are easy to get silently wrong, each against transformers' module or the spec."""

import math

import pytest
import torch

from dsv4.config import ModelConfig, count_parameters
from dsv4.formats import quantize_nvfp4, stage_activation, w4a4_matmul_ref
from dsv4.kernels import Ops, emulation
from dsv4.kernels.ref import swiglu
from dsv4.model import Builder, LinearFormat, QLinear, build_model
from dsv4.model.compressor import Compressor
from dsv4.model.indexer import Indexer
from dsv4.kernels.ref import apply_rope, hc_head, hc_post, hc_pre
from dsv4.model.moe import Experts
from dsv4.model.norm_rope import Rope

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf  # noqa: E402

OPS = Ops.reference()


def hf_config(cfg: ModelConfig):
    return transformers.DeepseekV4Config(**cfg.to_hf_dict())


def fill_(module: torch.nn.Module, seed: int, std: float = 0.5) -> None:
    """Random values for a transformers module's parameters (its rotary buffers stay as derived)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)


# ------------------------------------------------------------------------------------------------ mHC
def test_mhc_sinkhorn_order_and_eps_match_transformers():
    # A large eps and few iterations make eps placement and the row/column order visible at fp32 precision.
    cfg = ModelConfig.tiny(hc_eps=1e-2, hc_sinkhorn_iters=4)
    ref = hf.DeepseekV4HyperConnection(hf_config(cfg))
    fill_(ref, 0)
    x = torch.randn(2, 5, cfg.hc_mult, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    post, comb, collapsed = ref(x)
    u, my_post, my_comb = hc_pre(x, ref.fn, ref.base, ref.scale, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
    torch.testing.assert_close(my_comb, comb, rtol=0, atol=0)
    torch.testing.assert_close(my_post, post, rtol=0, atol=0)
    torch.testing.assert_close(u, collapsed, rtol=0, atol=0)
    # The last Sinkhorn step normalises columns: they sum to ~1 (up to eps), rows do not exactly.
    col = my_comb.sum(-2)
    assert torch.allclose(col, torch.ones_like(col), atol=2 * cfg.hc_eps)
    assert not torch.allclose(my_comb.sum(-1), torch.ones_like(col), atol=1e-4)

    head = hf.DeepseekV4HyperHead(hf_config(cfg))
    fill_(head, 2)
    y = hc_head(x, head.hc_fn, head.hc_base, head.hc_scale, cfg.hc_eps, cfg.rms_norm_eps)
    torch.testing.assert_close(y, head(x), rtol=0, atol=0)


def test_comb_is_applied_transposed():
    g = torch.Generator().manual_seed(0)
    streams, out = torch.randn(1, 3, 4, 8, generator=g), torch.randn(1, 3, 8, generator=g)
    post, comb = torch.rand(1, 3, 4, generator=g), torch.rand(1, 3, 4, 4, generator=g)
    assert not torch.allclose(comb, comb.transpose(-1, -2))
    # X'[k] = post[k] F + sum_j comb[j, k] X[j]: the first comb axis is the source stream.
    want = post[..., None] * out[:, :, None, :] + torch.einsum("bsjk,bsjd->bskd", comb, streams)
    torch.testing.assert_close(hc_post(out, streams, post, comb), want)
    wrong = post[..., None] * out[:, :, None, :] + torch.einsum("bsjk,bskd->bsjd", comb, streams)
    assert not torch.allclose(hc_post(out, streams, post, comb), wrong)


# ------------------------------------------------------------------------------------------------ RoPE
@pytest.mark.parametrize("preset", ["flash", "tiny"])
def test_rope_frequencies_match_transformers(preset):
    cfg = getattr(ModelConfig, preset)()
    ref = hf.DeepseekV4RotaryEmbedding(hf_config(cfg))
    assert torch.equal(Rope(cfg, compress=False).inv_freq, ref.main_inv_freq)
    assert torch.equal(Rope(cfg, compress=True).inv_freq, ref.compress_inv_freq)


def test_flash_yarn_frequencies_match_the_spec():
    # dsv4-architecture.md §4: theta 1.6e5, YaRN(16, 65536, 32, 1) gives low = 15, high = 25.
    w = Rope(ModelConfig.flash(), compress=True).inv_freq
    base = 160000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    assert torch.allclose(w[:16].double(), base[:16], rtol=1e-6)           # pairs 0..15 unscaled
    assert torch.allclose(w[25:].double(), base[25:] / 16, rtol=1e-6)      # pairs >= 25 divided by 16
    spec = [1.0, .6877, .4729, .3252, .2236, .1538, .1057, .07271, .05, .03438, .02364, .01626, .01118, .007688,
            .005287, .003636, .002266, .001397, 8.497e-4, 5.081e-4, 2.970e-4, 1.682e-4, 9.087e-5, 4.544e-5,
            1.953e-5, 5.372e-6, 3.694e-6, 2.540e-6, 1.747e-6, 1.201e-6, 8.261e-7, 5.681e-7]
    assert torch.allclose(w.double(), torch.tensor(spec, dtype=torch.float64), rtol=2e-3)


def test_rope_is_interleaved_on_the_trailing_channels_and_inverts():
    cfg = ModelConfig.tiny()
    rope, rd, nope = Rope(cfg, compress=True), cfg.qk_rope_head_dim, cfg.nope_head_dim
    cos, sin = rope(torch.tensor([7]))
    x = torch.zeros(1, cfg.head_dim)
    x[0, nope] = 1.0                                            # pair 0 = channels (nope, nope + 1)
    y = apply_rope(x, cos, sin)
    phi = 7 * rope.inv_freq[0]
    assert torch.allclose(y[0, nope:nope + 2], torch.stack((phi.cos(), phi.sin())))
    assert torch.count_nonzero(y[0, :nope]) == 0 and torch.count_nonzero(y[0, nope + 2:]) == 0
    # Same result as transformers' rotate_half formulation, and the inverse undoes it.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, cfg.head_dim, generator=g)           # [B, S, H, D]
    pos = torch.randint(0, 4000, (2, 3), generator=g)
    cos, sin = rope(pos)
    mine = apply_rope(x, cos[:, :, None], sin[:, :, None])
    theirs = hf.apply_rotary_pos_emb(x.transpose(1, 2), cos, sin).transpose(1, 2)
    torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    torch.testing.assert_close(apply_rope(mine, cos[:, :, None], sin[:, :, None], inverse=True), x)
    assert rd == 2 * cos.shape[-1]


# ------------------------------------------------------------------------------------------ compressor
def _my_compressor(cfg: ModelConfig, ref: torch.nn.Module, ratio: int, head_dim: int) -> Compressor:
    mine = Compressor(cfg, ratio, head_dim, Builder(None, torch.float32, OPS))
    with torch.no_grad():
        mine.wkv.weight.copy_(ref.kv_proj.weight)
        mine.wgate.weight.copy_(ref.gate_proj.weight)
        mine.ape.copy_(ref.position_bias)
        mine.norm.weight.copy_(ref.kv_norm.weight)
    return mine


def test_csa_compressor_overlap_matches_transformers():
    cfg = ModelConfig.tiny()
    ref = hf.DeepseekV4CSACompressor(hf_config(cfg))
    fill_(ref, 0)
    mine = _my_compressor(cfg, ref, 4, cfg.head_dim)
    g = torch.Generator().manual_seed(1)
    B, S = 2, 23                                               # 5 complete windows, 3 tokens left over
    x, qr = torch.randn(B, S, cfg.hidden_size, generator=g), torch.randn(B, S, cfg.q_lora_rank, generator=g)
    pos = torch.arange(S).expand(B, S)
    want, _ = ref(x, qr, pos, None, 0)
    got = mine(x, pos, Rope(cfg, compress=True))
    assert got.shape == (B, 5, cfg.head_dim)
    torch.testing.assert_close(got, want.squeeze(1), rtol=0, atol=0)

    # Receptive field of entry j: the Ca half of window j-1 and the Cb half of window j (tokens 4j-4 .. 4j+3).
    def entries_after_bumping(token: int, half: slice) -> torch.Tensor:
        with torch.no_grad():
            saved = mine.wkv.weight.clone()
            mine.wkv.weight.zero_()
            mine.wkv.weight[half] = saved[half]
            x2 = x.clone()
            x2[:, token] += 3.0
            a, b = mine(x, pos, Rope(cfg, compress=True)), mine(x2, pos, Rope(cfg, compress=True))
            mine.wkv.weight.copy_(saved)
        return (a - b).abs().amax(dim=(0, 2)) > 0

    ca, cb = slice(0, cfg.head_dim), slice(cfg.head_dim, 2 * cfg.head_dim)
    # Token 9 is in window 2. Through its Ca half it feeds entry 3 only (and the gates move entries 2 and 3).
    assert entries_after_bumping(9, cb).tolist() == [False, False, True, True, False]
    with torch.no_grad():
        mine.wgate.weight.zero_()  # freeze the gates: only the kv value of the bumped token matters now
    assert entries_after_bumping(9, ca).tolist() == [False, False, False, True, False]
    assert entries_after_bumping(9, cb).tolist() == [False, False, True, False, False]


def test_hca_compressor_matches_transformers():
    cfg = ModelConfig.tiny()
    ref = hf.DeepseekV4HCACompressor(hf_config(cfg))
    fill_(ref, 3)
    mine = _my_compressor(cfg, ref, 128, cfg.head_dim)
    x = torch.randn(2, 270, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    pos = torch.arange(270).expand(2, 270)
    want, _ = ref(x, None, pos, None, 0)
    torch.testing.assert_close(mine(x, pos, Rope(cfg, compress=True)), want.squeeze(1), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------ indexer
def test_indexer_picks_match_transformers_and_are_causal():
    cfg = ModelConfig.tiny(index_topk=3)
    ref = hf.DeepseekV4Indexer(hf_config(cfg))
    fill_(ref, 5)
    mine = Indexer(cfg, Builder(None, torch.float32, OPS))
    with torch.no_grad():
        mine.wq_b.weight.copy_(ref.q_b_proj.weight)
        mine.weights_proj.weight.copy_(ref.scorer.weights_proj.weight)
        for a, b in (("wkv", "kv_proj"), ("wgate", "gate_proj")):
            getattr(mine.compressor, a).weight.copy_(getattr(ref, b).weight)
        mine.compressor.ape.copy_(ref.position_bias)
        mine.compressor.norm.weight.copy_(ref.kv_norm.weight)
    g = torch.Generator().manual_seed(6)
    B, S = 2, 41
    x, qr = torch.randn(B, S, cfg.hidden_size, generator=g), torch.randn(B, S, cfg.q_lora_rank, generator=g)
    pos = torch.arange(S).expand(B, S)
    picks = mine(x, qr, pos, Rope(cfg, compress=True))
    assert torch.equal(picks, ref(x, qr, pos, None, 0))
    # Causality: a valid pick j needs 4(j+1) <= t+1; there are min(topk, visible) valid picks per query.
    visible = (pos + 1) // 4
    valid = picks >= 0
    assert bool((picks[valid] < visible.unsqueeze(-1).expand_as(picks)[valid]).all())
    assert torch.equal(valid.sum(-1), visible.clamp(max=cfg.index_topk))


# ------------------------------------------------------------------------------------------ quantized layers
def _nvfp4_linear(w: torch.Tensor, input_scale: float, w4a4: bool) -> QLinear:
    n, k = w.shape
    layer = QLinear(k, n, LinearFormat("nvfp4", input_scale=True), torch.float32, Ops.reference(w4a4=w4a4))
    q, s, s2 = quantize_nvfp4(w)
    for name, t in (("weight", q), ("weight_scale", s), ("weight_scale_2", s2),
                    ("input_scale", torch.tensor(input_scale))):
        getattr(layer, name).copy_(t)
    return layer


def test_w4a4_option_matches_the_reference_gemm_and_default_is_weight_only():
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(48, 64, generator=g), torch.randn(5, 64, generator=g) * 3
    input_scale = float(x.abs().max()) / (6 * 448)
    emulated = _nvfp4_linear(w, input_scale, w4a4=True)
    x_fp4, x_sf, _ = stage_activation(x, torch.tensor(input_scale))
    alpha = input_scale * emulated.weight_scale_2
    want = w4a4_matmul_ref(x_fp4, x_sf, emulated.weight, emulated.weight_scale, alpha)
    torch.testing.assert_close(emulated(x), want, rtol=0, atol=0)
    weight_only = _nvfp4_linear(w, input_scale, w4a4=False)
    exact = x @ weight_only.qweight().dequantize().T
    torch.testing.assert_close(weight_only(x), exact, rtol=1e-6, atol=1e-5)
    assert not torch.allclose(emulated(x), exact, rtol=1e-3, atol=1e-3)   # the option really changes numerics


def _nvfp4_experts(ws: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], w4a4: bool) -> Experts:
    E, (w1, _, w2) = len(ws), ws[0]
    nvfp4 = LinearFormat("nvfp4", input_scale=True)
    ex = Experts((E,), w1.shape[1], w1.shape[0],
                 Builder({"w13": nvfp4, "w2": nvfp4}, torch.float32, Ops.reference(w4a4=w4a4)))
    with torch.no_grad():
        for e, shards in enumerate(ws):
            for layer, idx, w in ((ex.w13, (e, 0), shards[0]), (ex.w13, (e, 1), shards[1]), (ex.w2, (e,), shards[2])):
                q, s, s2 = quantize_nvfp4(w)
                layer.weight[idx], layer.weight_scale[idx], layer.weight_scale_2[idx] = q, s, s2
                layer.input_scale[idx] = 0.01
    return ex


def test_stacked_w13_keep_their_own_weight_scale_2():
    g = torch.Generator().manual_seed(0)
    d, inter, E = 64, 32, 3
    # w3 is 16x larger than w1: its weight_scale_2 differs, and using w1's for both would be silently wrong.
    ws = [(torch.randn(inter, d, generator=g), 16 * torch.randn(inter, d, generator=g),
           torch.randn(d, inter, generator=g)) for _ in range(E)]
    ex = _nvfp4_experts(ws, w4a4=False)
    assert not torch.equal(ex.w13.weight_scale_2[:, 0], ex.w13.weight_scale_2[:, 1])
    x = torch.randn(7, d, generator=g)
    ids = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1], [2, 0], [1, 2], [0, 2]])
    weights = torch.rand(7, 2, generator=g)
    got = OPS.moe(x, ids, weights, ex.w13.qweight(), ex.w2.qweight(), 10.0)
    want = torch.zeros(7, d)
    for t in range(7):
        for j in range(2):
            e = int(ids[t, j])
            w1, w3, w2 = (ex.w13.piece(e, 0).dequantize(), ex.w13.piece(e, 1).dequantize(), ex.w2.piece(e).dequantize())
            want[t] += weights[t, j] * (swiglu(x[t] @ w1.T, x[t] @ w3.T, 10.0) @ w2.T)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
    # Each piece dequantizes with its own scale_2: w3's dequantized values are ~16x w1's.
    ratio = ex.w13.piece(0, 1).dequantize().abs().mean() / ex.w13.piece(0, 0).dequantize().abs().mean()
    assert 10 < float(ratio) < 25


def test_w4a4_experts_match_a_per_expert_reference():
    g = torch.Generator().manual_seed(1)
    d, inter, E = 64, 32, 2
    ws = [(torch.randn(inter, d, generator=g), torch.randn(inter, d, generator=g), torch.randn(d, inter, generator=g))
          for _ in range(E)]
    ex = _nvfp4_experts(ws, w4a4=True)
    x = torch.randn(4, d, generator=g)

    def w4a4(h, layer, *idx):
        q = layer.piece(*idx)
        h_fp4, h_sf, _ = stage_activation(h, q.input_scale)
        return w4a4_matmul_ref(h_fp4, h_sf, q.weight, q.scale, q.input_scale * q.scale_2)

    want = w4a4(swiglu(w4a4(x, ex.w13, 1, 0), w4a4(x, ex.w13, 1, 1), 10.0), ex.w2, 1)
    one = emulation.expert(x, ex.w13.qweight(), ex.w2.qweight(), (1,), 10.0, ex.w13.ops.linear)   # expert 1
    torch.testing.assert_close(one, want, rtol=0, atol=0)


@pytest.mark.parametrize("layer", [0, 3], ids=["hash", "biased"])
def test_moe_block_calls_the_experts_right_after_routing(layer):
    """The MoE block hands ops.moe `after_route=True` (the Triton MoE then streams the shared expert while the
    routing kernel runs: kernels/moe.py) right after ops.route, with the shared expert folded in; the reference
    takes the hint and ignores it."""
    import dataclasses

    from dsv4.kernels import ref
    from dsv4.model.moe import MoE

    calls = []

    def moe_spy(*args, **kwargs):
        calls.append(kwargs)
        return ref.moe(*args, **kwargs)

    cfg = ModelConfig.tiny()
    ops = dataclasses.replace(OPS, moe=moe_spy)
    block = MoE(cfg, layer, Builder(None, torch.float32, ops))
    fill_(block, seed=layer)
    with torch.no_grad():
        for b in block.buffers():
            if b.is_floating_point():
                b.copy_(torch.randn(b.shape) * 0.5)
    if block.gate.hash:
        block.gate.tid2eid.copy_(torch.randint(0, cfg.n_routed_experts, block.gate.tid2eid.shape))
    x, ids = torch.randn(1, 5, cfg.hidden_size), torch.randint(0, cfg.vocab_size, (1, 5))
    y = block(x, ids)
    assert len(calls) == 1 and calls[0]["after_route"] is True and calls[0]["shared"] is not None
    flat = x.reshape(-1, cfg.hidden_size)
    g = block.gate
    weights, picked = ref.route(g(flat), None if g.hash else g.bias, cfg.num_experts_per_tok,
                                cfg.routed_scaling_factor, g.tid2eid if g.hash else None, ids if g.hash else None)
    ex, sh = block.experts, block.shared_experts
    want = ref.moe(flat, picked, weights, ex.w13.qweight(), ex.w2.qweight(), cfg.swiglu_limit,
                   shared=(sh.w13.qweight(), sh.w2.qweight()))
    torch.testing.assert_close(y.reshape(flat.shape), want, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------ presets
@pytest.mark.parametrize("preset, total, with_mtp", [
    ("flash", 284_332_240_471, 290_942_289_362),
    ("pro", 1_572_997_201_763, 1_598_837_347_742),
])
def test_presets_instantiate_on_meta_with_published_parameter_counts(preset, total, with_mtp):
    cfg = getattr(ModelConfig, preset)()
    model = build_model(cfg)
    assert all(t.is_meta for k, t in model.state_dict().items())
    assert model.num_parameters() == total == count_parameters(cfg)
    assert model.num_parameters(include_mtp=True) == with_mtp
    assert len(model.layers) == cfg.num_hidden_layers and len(model.mtp) == 1
    experts = model.layers[5].ffn.experts
    assert experts.w13.weight.shape == (cfg.n_routed_experts, 2, cfg.moe_intermediate_size, cfg.hidden_size)
    assert math.isclose(model.num_parameters() / 1e9, {"flash": 284.3, "pro": 1573.0}[preset], rel_tol=1e-3)


def cached_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """The logits of ids [1, >= 140] run as cached steps of 100, 30, 1 and 9 tokens (one sequence, pages 3 and 2)."""
    from dsv4.model.state import SeqBatch
    from dsv4.runtime.cache import KVCache

    cache, start, out = KVCache(model.config, 2, 4, torch.float32), 0, []
    with torch.inference_mode():
        for n in (100, 30, 1, 9):
            batch = SeqBatch((1,), (start,), (n,), ((3, 2),))
            out.append(model.head_logits(model(ids[:, start:start + n], batch.positions()[None], cache.layers,
                                               batch))[0])
            start += n
    return torch.cat(out)


def test_fused_projections_give_the_separate_products_logits():
    """`prepare_for_kernels_`'s fusion of each attention's dense projections of x (compressor and indexer
    compressor wkv / wgate, weights_proj) into one weight: the decode steps' logits stay those of the separate
    products (to fp32 rounding), the weights become views of the fused buffer and the state dict is unchanged."""
    import dsv4
    import runtime_fixtures as rf

    model = dsv4.load(rf.variant("wide"))
    ids = torch.tensor([rf.prompt_ids(140, seed=3)])
    want, keys = cached_logits(model, ids), set(model.state_dict())
    fused = model.fuse_projections_()
    assert fused == sum(1 for r in model.config.compress_ratios[:model.config.num_hidden_layers] if r)
    assert model.fuse_projections_() == fused                      # idempotent
    attn = next(b.attn for b in model.layers if b.attn.indexer is not None)
    parts = attn.dense_projections()
    assert [p.weight.data_ptr() for p in parts][0] == attn.x_dense.data_ptr() and len(parts) == 5
    for block in model.layers:                                     # wq_a and wkv: views of one weight too
        a = block.attn
        assert a.x_query_kv is not None and a.wq_a.weight.data_ptr() == a.x_query_kv.weight.data_ptr()
        assert a.wkv.weight.data_ptr() == a.x_query_kv.weight[a.wq_a.out_features:].data_ptr()
        if a.indexer is None:                                      # and on CSA layers wq_b and the indexer's
            assert a.qr_queries is None
        else:
            assert a.wq_b.weight.data_ptr() == a.qr_queries.weight.data_ptr()
            assert a.indexer.wq_b.weight.data_ptr() == a.qr_queries.weight[a.wq_b.out_features:].data_ptr()
    assert set(model.state_dict()) == keys
    got = cached_logits(model, ids)
    assert (got - want).abs().max() / want.abs().max() < 1e-5


@pytest.mark.parametrize("q_lora_rank, fused", [(128, True), (96, False)])
def test_fp8_query_and_kv_projections_fuse_on_whole_scale_blocks(tmp_path, q_lora_rank, fused):
    """`fuse_query_kv_` and `fuse_queries_` on FP8-block weights (DeepSeek's release format): wq_a's rows and
    128-row scale blocks first, then wkv's, in one weight, when wq_a's rows fill whole scale blocks (else the layers
    stay apart); on CSA layers wq_b's then the indexer's; a prefill's and cached steps' logits equal the unfused
    model's, and the state dict keeps its keys and values."""
    import dsv4
    from dsv4.checkpoint.tiny import make_tiny
    from dsv4.config import ModelConfig

    make_tiny(tmp_path, seed=0, fmt="official", cfg=ModelConfig.tiny(q_lora_rank=q_lora_rank))
    model = dsv4.load(tmp_path)
    attn = model.layers[0].attn
    csa = next(b.attn for b in model.layers if b.attn.indexer is not None)
    assert attn.wq_a.format.fmt == attn.wkv.format.fmt == csa.wq_b.format.fmt == csa.indexer.wq_b.format.fmt == "fp8"
    ids = torch.tensor([list(range(2, 40)) * 4])
    with torch.inference_mode():
        want, state = model(ids[:, :38]), {k: v.clone() for k, v in model.state_dict().items()}
        want_cached = cached_logits(model, ids)
        assert all(bool(a.fuse_query_kv_()) == fused for a in (b.attn for b in model.layers))
        assert all(a.fuse_queries_() == (a.indexer is not None) for a in (b.attn for b in model.layers))
        got, got_cached = model(ids[:, :38]), cached_logits(model, ids)
    if fused:
        w = attn.x_query_kv
        assert w.fmt == "fp8" and w.weight.shape[0] == q_lora_rank + attn.wkv.out_features
        assert attn.wkv.scale.data_ptr() == w.scale[q_lora_rank // 128:].data_ptr()
    w = csa.qr_queries
    assert w.fmt == "fp8" and w.weight.shape[0] == csa.wq_b.out_features + csa.indexer.wq_b.out_features
    assert csa.indexer.wq_b.scale.data_ptr() == w.scale[csa.wq_b.out_features // 128:].data_ptr()
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert (got_cached - want_cached).abs().max() <= 1e-5 * want_cached.abs().max()


def test_router_logits_are_fp32_products_of_the_bf16_values():
    """The gate computes in fp32 from bf16 activations and weights (DeepSeek's reference does), before and after the
    device placement stores its weight in fp32 (`Gate.widen_`): the same logits, not rounded to bf16."""
    from dsv4.config import ModelConfig
    from dsv4.kernels import Ops
    from dsv4.model.linear import DENSE
    from dsv4.model.moe import Gate
    from dsv4.model.linear import Builder

    cfg = ModelConfig.tiny()
    gate = Gate(cfg, 3, Builder({}, torch.bfloat16, Ops.reference()))
    assert gate.format == DENSE
    g = torch.Generator().manual_seed(0)
    gate.weight = torch.randn(cfg.n_routed_experts, cfg.hidden_size, generator=g).bfloat16()
    x = torch.randn(5, cfg.hidden_size, generator=g).bfloat16()
    want = x.double() @ gate.weight.double().T
    got = gate(x)
    assert got.dtype == torch.float32 and torch.allclose(got.double(), want, rtol=1e-6, atol=1e-6)
    assert not torch.equal(got, got.bfloat16().float())                 # more than bf16 holds
    assert gate.widen_() and gate.weight.dtype == torch.float32
    assert torch.equal(gate(x), got)
