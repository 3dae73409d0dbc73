"""Triton linears against `kernels.ref` (the specification), under TRITON_INTERPRET=1 at small odd shapes.

The interpreter's tl.dot runs the fp32 operand path (its bf16 dot is broken) and its fp32->bf16 cast
truncates instead of rounding, so bf16 checks use a bf16-level bound while fp32 checks are near-exact.
"""

import pytest
import torch

from dsv4.formats import QWeight, quantize_fp8_block, quantize_mxfp4, quantize_nvfp4
from dsv4.kernels import Ops, dispatch, gemm, ops_for, policy, ref
from dsv4.kernels.host import Scratch, num_sms
from dsv4.kernels.policy import TileConfig
from kernel_util import refuse, rel_err, stacked_weight, strict_ops


FORMATS = ("nvfp4", "mxfp4", "fp8", "fp8-f32")


def make_weight(fmt: str, n: int, k: int, scale: float = 0.05) -> QWeight:
    w = torch.randn(n, k) * scale * torch.exp(torch.randn(n, 1))  # rows of different magnitude
    if fmt == "nvfp4":
        q, s, s2 = quantize_nvfp4(w)
        return QWeight("nvfp4", q, s, s2, torch.tensor(0.02))
    if fmt == "mxfp4":
        return QWeight("mxfp4", *quantize_mxfp4(w))
    if fmt == "fp8":
        return QWeight("fp8", *quantize_fp8_block(w))
    return QWeight("fp8", *quantize_fp8_block(w, torch.float32))


@pytest.fixture(scope="module")
def ops() -> Ops:
    return strict_ops()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 7])
def test_linear_matches_reference_fp32(ops, fmt, m):
    k = 200 if fmt.startswith("fp8") else 96  # fp8: a K tail past the last 128-block and BK
    w = make_weight(fmt, 37, k)
    x = torch.randn(m, k)
    y = ops.linear(x, w)
    assert y.shape == (m, 37) and y.dtype == torch.float32
    assert rel_err(y, ref.linear(x, w)) < 1e-6


@pytest.mark.parametrize("fmt", FORMATS)
def test_linear_bf16_and_leading_dims(ops, fmt):
    w = make_weight(fmt, 45, 128)
    x = torch.randn(2, 3, 128).to(torch.bfloat16)
    y = ops.linear(x, w)
    assert y.shape == (2, 3, 45) and y.dtype == torch.bfloat16
    assert rel_err(y, ref.linear(x, w)) < 1e-2


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantization_is_exact(ops, fmt):
    """x = identity: every output is one weight element, so nibble order, scales, the FP4 prescale and the
    epilogue factor must reproduce QWeight.dequantize bit for bit."""
    w = make_weight(fmt, 33, 64)
    y = ops.linear(torch.eye(64), w)
    assert torch.equal(y, w.dequantize(torch.float32).T)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fused_tiles_decode_fp4_exactly_in_both_k_orders(fmt):
    """The fused tiles decode FP4 as even / odd K halves at BM 32-64 and in natural K order at BM 16 and from BM 128
    (`tiles._accumulate_fp4`); x = identity makes every output one weight element, so each order must put every
    nibble, scale and the prescale where QWeight.dequantize does, bit for bit. Then both with split K, plain and
    gated (the clamped SwiGLU pair of the shared expert, large enough weights to reach the clamp)."""
    w = make_weight(fmt, 40, 64)
    want = w.dequantize(torch.float32).T
    for bm in (16, 64, 128):
        y = dispatch.linear(torch.eye(64), w, config=TileConfig(bm, 32, 64), fallback=refuse)
        assert torch.equal(y, want), bm
    x = torch.randn(3, 64)
    r = ref.linear(x, w)
    w13, w2 = stacked_weight(fmt, 32, 64, (2,), 0.5), stacked_weight(fmt, 64, 32, (), 0.1)
    want_mlp = ref.mlp(x, w13, w2, 3.0)
    for bm in (32, 128):
        cfg = TileConfig(bm, 16, 32, split_k=2)
        assert rel_err(dispatch.linear(x, w, config=cfg, fallback=refuse), r) < 1e-6
        y = dispatch.mlp(x, w13, w2, 3.0, fallback=refuse, linear=ops_for("cpu", "triton").linear, config=cfg)
        assert rel_err(y, want_mlp) < 1e-6, bm


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_split_k_and_prefill_tiles(fmt):
    w = make_weight(fmt, 40, 256)
    x = torch.randn(3, 256)
    r = ref.linear(x, w)
    split = TileConfig(16, 16, 64, split_k=3)
    scratch = Scratch()
    for _ in range(2):  # the second call checks that the semaphores re-armed themselves
        y = dispatch.linear(x, w, config=split, fallback=refuse, scratch=scratch)
        assert rel_err(y, r) < 1e-6
    assert int(scratch.counters(x.device, 1).abs().sum()) == 0
    xp = torch.randn(70, 256)  # M > 64: the prefill tiles, two row blocks, grouped program order
    prefill = policy.tile_config(70, 40, 256, w.fmt, num_sms(xp.device))
    assert prefill.BM == 64 and prefill.group_m == 8
    assert rel_err(dispatch.linear(xp, w, config=prefill, fallback=refuse), ref.linear(xp, w)) < 1e-6


# (model linear, fmt, M, N, K) -> the tiles bench/lab/profile_tiles.py measured fastest or within 3 % of it on an H200
# (bench/RESULTS.md round twenty-two), which `dense_tiles` must keep choosing
MEASURED_TILES = [
    ("V4-Flash wq_b", "nvfp4", 64, 32768, 1024, (64, 128, 1)),
    ("V4-Flash wq_b", "nvfp4", 256, 32768, 1024, (128, 128, 1)),
    ("V4-Pro wo_b", "nvfp4", 32, 7168, 16384, (32, 128, 4)),
    ("V4-Pro wo_b", "nvfp4", 64, 7168, 16384, (64, 128, 4)),
    ("V4-Pro wo_b", "nvfp4", 128, 7168, 16384, (128, 128, 4)),
    ("V4-Pro wo_b", "fp8", 64, 7168, 16384, (64, 128, 4)),
    ("V4-Flash indexer wq_b", "fp8", 64, 8192, 1024, (64, 64, 1)),
]


@pytest.mark.parametrize("name,fmt,m,n,k,tiles", MEASURED_TILES)
def test_dense_tiles_keep_the_measured_winners(name, fmt, m, n, k, tiles):
    cfg = policy.dense_tiles(m, n, k, fmt, 132)
    assert (cfg.BM, cfg.BN, cfg.split_k) == tiles, name


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp8"])
def test_dense_tiles_one_wave_of_long_enough_programs(fmt):
    """Every split leaves each program MID_MIN_STEPS K steps and keeps the launch to one wave of 2 CTAs per SM;
    without a split the K loop is whole. Over the benchmark linears' sizes and every row count up to MID_ROWS."""
    seen_split = seen_plain = 0
    for n, k in ((2048, 4096), (4096, 2048), (32768, 1024), (7168, 16384), (3072, 7168), (8192, 1536), (40, 256)):
        for m in range(1, policy.MID_ROWS + 1, 7):
            cfg = policy.dense_tiles(m, n, k, fmt, 132)   # an H200's SMs
            chunks = -(-k // cfg.BK)
            programs = -(-m // cfg.BM) * -(-n // cfg.BN) * cfg.split_k
            assert cfg.BM >= min(m, 64) and (cfg.BN in (64, 128) or cfg.BN >= n)
            if cfg.split_k > 1:
                seen_split += 1
                assert chunks // cfg.split_k >= policy.MID_MIN_STEPS and programs <= policy.MID_CTAS_PER_SM * 132
            else:
                seen_plain += 1
    assert seen_split and seen_plain


def test_fused_beats_cublas_only_for_large_weights_and_mid_rows():
    assert policy.fused_beats_cublas("nvfp4", 56.6e6, 256) and policy.fused_beats_cublas("mxfp4", 18.9e6, 65)
    assert not policy.fused_beats_cublas("nvfp4", 4.7e6, 128)          # small: dequantize + cuBLAS
    assert not policy.fused_beats_cublas("nvfp4", 56.6e6, policy.MID_ROWS + 1)   # prefill
    assert policy.fused_beats_cublas("fp8", 117e6, 256) and \
        not policy.fused_beats_cublas("fp8", 117e6, policy.MID_ROWS + 1)
    assert not policy.fused_beats_cublas("fp8", 22e6, 100) and not policy.fused_beats_cublas("dense", 1e9, 100)


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
@pytest.mark.parametrize("m", [20, 100])
def test_dense_tiles_with_split_k_match_the_reference(fmt, m):
    w = make_weight(fmt, 40, 2048)   # 16 K steps of 128 / 32 of 64: dense_tiles splits K on the interpreter's 4 SMs
    x = torch.randn(m, 2048)
    cfg = policy.tile_config(m, 40, 2048, fmt, num_sms(x.device))
    assert cfg.split_k > 1
    assert rel_err(dispatch.linear(x, w, fallback=refuse, scratch=Scratch()), ref.linear(x, w)) < 1e-6


@pytest.mark.parametrize("m", [1, 5])
def test_dense_tiles_forced_match_the_reference(m):
    """The tiles' dense path, forced (`policy._plan_dense`) under the interpreter: split-K over a K tail; a weight in
    another dtype than x is refused by the kernels (the reference casts it)."""
    w = QWeight("dense", torch.randn(72, 1600) * 0.05)
    x = torch.randn(m, 1600)
    cfg = policy.dense_tiles(m, 72, 1600, "dense", 4)
    assert cfg.split_k > 1 and 1600 % cfg.BK
    assert rel_err(dispatch.linear(x, w, config=cfg, fallback=refuse, scratch=Scratch()), ref.linear(x, w)) < 1e-6
    other = QWeight("dense", w.weight.double())
    with pytest.raises(Exception, match="fell back"):
        dispatch.linear(x, other, config=cfg, fallback=refuse)


def test_every_output_is_written(ops):
    w = make_weight("nvfp4", 50, 64)
    x = torch.randn(5, 64)
    out = torch.full((5, 50), float("nan"))
    dispatch.linear(x, w, out=out, fallback=refuse)
    assert torch.isfinite(out).all() and rel_err(out, ref.linear(x, w)) < 1e-6


def test_unsupported_shapes_and_formats_fall_back():
    ops = ops_for("cpu", "triton")
    q, s, s2 = quantize_nvfp4(torch.randn(8, 48))  # K=48: no 32-multiple K block
    w = QWeight("nvfp4", q, s, s2)
    x = torch.randn(2, 48)
    assert torch.equal(ops.linear(x, w), ref.linear(x, w))
    dense = QWeight("dense", torch.randn(8, 16))
    xd = torch.randn(3, 16)
    assert torch.equal(ops.linear(xd, dense), ref.linear(xd, dense))
    x16 = torch.randn(2, 64).half()  # fp16 activations: reference
    w16 = make_weight("mxfp4", 8, 64)
    assert torch.equal(ops.linear(x16, w16), ref.linear(x16, w16))


def test_ops_for_dispatch():
    assert ops_for("cpu").name == "ref"
    assert ops_for("cpu", "ref").name == "ref"
    assert ops_for("cpu", "triton").name == "triton"  # conftest sets TRITON_INTERPRET=1
    with pytest.raises(ValueError, match="backend"):
        ops_for("cpu", "cuda-graphs")
    with pytest.raises(ValueError, match="stacked"):
        ops_for("cpu", "triton").linear(torch.randn(1, 64), make_stacked())


def make_stacked() -> QWeight:
    q, s = quantize_mxfp4(torch.randn(2, 8, 64))
    return QWeight("mxfp4", q, s)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_kernel_is_exact(fmt):
    w = make_weight(fmt, 37, 200 if fmt.startswith("fp8") else 96)
    assert torch.equal(gemm.dequantize(w, torch.float32), w.dequantize(torch.float32))
