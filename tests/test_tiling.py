"""Tile-major weight storage (`formats.tiling`, `QWeight.tiled`): the layout itself, and every kernel that reads
weights giving bit-identical results on tiled and row-major copies of the same weight (CPU interpreter)."""

import dataclasses

import pytest
import torch

from dsv4.checkpoint.loader import load
from dsv4.checkpoint.tiny import make_tiny
from dsv4.config import ModelConfig
from dsv4.formats import TILE_BYTES, TILE_ROWS, QWeight, scale_chunk, tile_bytes, tile_bytes_, untile_bytes
from dsv4.kernels import Ops, dispatch, gemm, ops_for, policy, ref, w4a4
from dsv4.kernels.host import Scratch
from dsv4.kernels.policy import GemvConfig, TileConfig
from dsv4.model.linear import QLinear
from kernel_util import refuse, stacked_weight

LIMIT = 10.0


def test_tiled_order_puts_each_tile_chunk_in_one_run():
    """Independent of `tile_bytes`' view arithmetic: byte (r, c) of a [*L, N, R] array sits at
    (r // 64, c // C, r % 64, c % C) of [*L, N / 64, R / C, 64, C]."""
    n, r, chunk = 128, 192, 64
    t = torch.randint(0, 256, (3, n, r), dtype=torch.uint8)
    flat = tile_bytes(t, chunk).reshape(3, -1)
    for e, row, col in [(0, 0, 0), (1, 63, 191), (2, 64, 65), (0, 127, 128), (1, 70, 5)]:
        at = (row // TILE_ROWS) * TILE_ROWS * r + (col // chunk) * TILE_ROWS * chunk + (row % TILE_ROWS) * chunk \
            + col % chunk
        assert flat[e, at] == t[e, row, col]
    assert torch.equal(untile_bytes(tile_bytes(t, chunk), chunk), t)
    inplace = t.clone()
    assert tile_bytes_(inplace, chunk).data_ptr() == inplace.data_ptr()
    assert torch.equal(inplace, tile_bytes(t, chunk))   # one matrix at a time, same bytes
    assert TILE_BYTES == 64 and scale_chunk("nvfp4") == 8 and scale_chunk("mxfp4") == 4 and scale_chunk("fp8") == 0


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp8", "fp8-f32"])
def test_tiled_weight_dequantizes_like_the_row_major_one(fmt):
    w = stacked_weight(fmt, 128, 256, (3, 2))
    t = w.tile()
    assert t.tiled and not w.tiled and t.weight.shape == w.weight.shape and t.nbytes() == w.nbytes()
    assert not torch.equal(t.weight.view(torch.uint8), w.weight.view(torch.uint8))   # the bytes did move
    assert torch.equal(t.dequantize(), w.dequantize())
    assert torch.equal(t.index(1, 0).dequantize(), w.index(1, 0).dequantize()) and t.index(1, 0).tiled
    u = t.untiled()
    same = lambda a, b: torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # noqa: E731  (float8 bytes)
    assert not u.tiled and same(u.weight, w.weight) and same(u.scale, w.scale)
    assert t.tile() is t and w.untiled() is w


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_stacking_tiled_weights_gives_the_tiled_stack(fmt):
    """What `Attention.fuse_query_kv_` relies on: tiles are row blocks, so wq_a's and wkv's tiled bytes (and scales)
    stacked are the stack's tiled bytes; FP8's 128-row scale blocks stack as rows too."""
    a, b = stacked_weight(fmt, 128, 256), stacked_weight(fmt, 64, 256)
    stacked = QWeight(fmt, torch.cat((a.weight, b.weight)), torch.cat((a.scale, b.scale)))
    ta, tb, ts = a.tile(), b.tile(), stacked.tile()
    same = lambda x, y: torch.equal(x.view(torch.uint8), y.view(torch.uint8))  # noqa: E731  (float8 bytes)
    assert same(torch.cat((ta.weight, tb.weight)), ts.weight) and same(torch.cat((ta.scale, tb.scale)), ts.scale)
    fused = QWeight(fmt, torch.cat((ta.weight, tb.weight)), torch.cat((ta.scale, tb.scale)), tiled=True)
    assert torch.equal(fused.dequantize(), torch.cat((a.dequantize(), b.dequantize())))


def test_row_slices_of_a_tiled_weight():
    w = stacked_weight("nvfp4", 256, 128)
    t = w.tile()
    whole = t.rows(64, 192)          # whole tiles: a view, still tiled
    assert whole.tiled and whole.weight.data_ptr() == t.weight.data_ptr() + 64 * 64
    part = t.rows(32, 96)            # not whole tiles: a row-major copy
    assert not part.tiled
    for s in (whole, part):
        rows = slice(64, 192) if s is whole else slice(32, 96)
        assert torch.equal(s.dequantize(), w.dequantize()[rows])


def test_tiling_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="100 rows is not a multiple of 64"):
        stacked_weight("nvfp4", 100, 128).tile()
    with pytest.raises(ValueError, match="32 bytes per row is not a multiple of 64"):
        stacked_weight("nvfp4", 64, 64).tile()
    with pytest.raises(ValueError, match="dense weights are not tiled"):
        QWeight("dense", torch.zeros(64, 64)).tile()
    w = stacked_weight("fp8", 128, 256)
    with pytest.raises(ValueError, match="strided rows"):
        QWeight("fp8", w.weight[:, :128], w.scale[:, :1], tiled=True)
    with pytest.raises(ValueError, match="must be whole contiguous tiles"):
        QWeight("fp8", w.weight[:96], w.scale, tiled=True)


# ------------------------------------------------------------------------------------------ kernels

def both(fmt, n, k, lead=(), scale=0.05):
    w = stacked_weight(fmt, n, k, lead, scale)
    return w, w.tile()


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp8", "fp8-f32"])
@pytest.mark.parametrize("m", [1, 5, 12])
def test_gemv_reads_tiled_weights(fmt, m):
    """K = 384: an odd number of FP4 sub-steps (the last step re-read); N = 192: three tiles."""
    w, t = both(fmt, 192, 384)
    x = torch.randn(m, 384)
    for cfg in (GemvConfig(), GemvConfig(split=3), GemvConfig(BN=128, num_warps=4),
                policy.LARGE_FP4_16_ROWS, GemvConfig(prefetch=3)):
        y = dispatch.linear(x, w, config=cfg, fallback=refuse, scratch=Scratch())
        assert torch.equal(dispatch.linear(x, t, config=cfg, fallback=refuse, scratch=Scratch()), y)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp8", "fp8-f32"])
def test_fused_tiles_and_dequantize_read_tiled_weights(fmt):
    w, t = both(fmt, 128, 512)
    for m, cfg in [(3, TileConfig(16, 32, 128)), (3, TileConfig(16, 64, 256, split_k=2)),
                   (70, TileConfig(64, 64, 128))]:
        x = torch.randn(m, 512)
        y = dispatch.linear(x, w, config=cfg, fallback=refuse, scratch=Scratch())
        assert torch.equal(dispatch.linear(x, t, config=cfg, fallback=refuse, scratch=Scratch()), y)
    assert torch.equal(gemm.dequantize(t, torch.float32), w.dequantize())


def test_grouped_linear_reads_tiled_weights():
    w, t = both("nvfp4", 4 * 64, 128)
    x = torch.randn(3, 4, 128)
    assert torch.equal(dispatch.grouped_linear(x, t, 4, fallback=refuse),
                       dispatch.grouped_linear(x, w, 4, fallback=refuse))


def test_w4a4_reads_tiled_weights():
    w = stacked_weight("nvfp4", 128, 256)
    w = QWeight(w.fmt, w.weight, w.scale, w.scale_2, torch.tensor(0.01))
    x = torch.randn(5, 256)
    y = w4a4.linear_w4a4(x, w, fallback=refuse)
    assert torch.equal(w4a4.linear_w4a4(x, w.tile(), fallback=refuse), y)
    assert torch.equal(ref.linear_w4a4(x, w.tile()), ref.linear_w4a4(x, w))


@pytest.mark.parametrize("T,kw", [(3, {}), (3, dict(decode="tiles")), (11, {})],
                         ids=["gemv-pair", "tiles", "sorted"])
def test_moe_reads_tiled_experts(T, kw):
    E, k, D, I = 5, 2, 128, 128
    (w13, t13), (w2, t2) = both("nvfp4", I, D, (E, 2), 0.5), both("mxfp4", D, I, (E,), 0.1)
    (s13, st13), (s2, st2) = both("fp8", I, D, (2,), 0.5), both("nvfp4", D, I, (), 0.1)
    x = torch.randn(T, D)
    w, ids = ref.route(torch.randn(T, E), torch.zeros(E), k, 1.5)
    run = lambda a, b, sh: dispatch.moe(x, ids, w, a, b, LIMIT, fallback=refuse, shared=sh,  # noqa: E731
                                        scratch=Scratch(), **kw)
    y = run(w13, w2, (s13, s2))
    assert torch.equal(run(t13, t2, (st13, st2)), y)
    assert torch.equal(run(t13, t2, (s13, s2)), y)          # routed tiled, shared expert row-major
    assert torch.equal(run(w13, w2, (st13, st2)), y)


# ------------------------------------------------------------------------------------------ model

def weight_kernels_only(triton_ops):
    """The reference table with the Triton table's weight kernels (every operation that reads a `QWeight`): tiling
    changes only how those read, and the model-through-kernels test (`test_kernels_attention`) runs the others. Any
    other operation, present or added later, stays the reference's."""
    weight_ops = ("linear", "linear_w4a4", "mlp", "moe", "grouped_linear", "reads_tiled")
    return dataclasses.replace(Ops.reference(), name="triton weight kernels",
                               **{name: getattr(triton_ops, name) for name in weight_ops})


@pytest.mark.parametrize("fmt", ["nvfp4", "official"])
def test_loaded_model_gives_the_same_logits_tiled(tmp_path, fmt):
    """A model wide enough for whole tiles (experts, shared expert, attention projections), loaded with and
    without tiling: the reference untiles, the Triton kernels read the tiles; logits equal bit for bit."""
    cfg = ModelConfig.tiny(hidden_size=128, moe_intermediate_size=128, q_lora_rank=128)
    make_tiny(tmp_path / "m", fmt=fmt, cfg=cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, 10))
    for ops in (ops_for("cpu", "ref"), weight_kernels_only(ops_for("cpu", "triton"))):
        plain = load(tmp_path / "m", "cpu", torch.float32, ops)       # CPU: not tiled by default
        tiled = load(tmp_path / "m", "cpu", torch.float32, ops, tile_weights=True)
        layers = [m for m in tiled.modules() if isinstance(m, QLinear) and m.tiled]
        assert not any(m.tiled for m in plain.modules() if isinstance(m, QLinear))
        assert len(layers) >= 40 and any(m.leading for m in layers)    # stacked experts among them
        assert torch.equal(tiled.logits(ids), plain.logits(ids))
