"""The plans (`kernels.policy`) at V4's shapes on an H200, read on a CPU: which launcher runs a linear or a MoE layer,
with which configuration. Each row is a decision docs/tuning.md records the measurements of."""

import pytest
import torch

from dsv4.kernels.policy import (H200, INTERPRETER, LARGE_FP4_8_ROWS, LARGE_FP4_16_ROWS, WIDE_DOWN, Device, Experts,
                                 Format, GemvConfig, Kernel, LinearPlan, Routed, Shared, TileConfig, plan_linear,
                                 plan_moe)

BF16, FP32 = torch.bfloat16, torch.float32
NVFP4, FP8 = Format("nvfp4"), Format("fp8")


@pytest.mark.parametrize("case,fmt,M,N,K,plan", [
    # decode: the GEMV up to 8 rows; at 9-16 rows only for weights of at least 30 MB (FP4) / 20 MB (FP8)
    ("V4-Flash expert w1/w3, 1 row", NVFP4, 1, 2048, 4096, LinearPlan(Kernel.GEMV, GemvConfig())),
    ("V4-Flash expert w1/w3, 16 rows", NVFP4, 16, 2048, 4096,
     LinearPlan(Kernel.TILES, TileConfig(16, 64, 128, 5, 1, 4, 3))),
    ("V4-Pro wq_b, 8 rows", NVFP4, 8, 65536, 1536, LinearPlan(Kernel.GEMV, LARGE_FP4_8_ROWS)),
    ("V4-Pro wq_b, 16 rows", NVFP4, 16, 65536, 1536, LinearPlan(Kernel.GEMV, LARGE_FP4_16_ROWS)),
    ("V4-Flash wo_b fp8, 16 rows", FP8, 16, 4096, 8192, LinearPlan(Kernel.GEMV, GemvConfig())),
    # 17-256 rows: the fused tiles, above 64 rows only for weights they stream faster than dequantize + cuBLAS
    ("V4-Flash wq_b, 64 rows", NVFP4, 64, 32768, 1024, LinearPlan(Kernel.TILES, TileConfig(64, 128, 128, 1, 1, 4, 3))),
    ("V4-Flash wq_b, 128 rows", NVFP4, 128, 32768, 1024,
     LinearPlan(Kernel.TILES, TileConfig(128, 128, 64, 1, 8, 4, 4))),
    ("V4-Flash expert w1/w3, 128 rows", NVFP4, 128, 2048, 4096, LinearPlan(Kernel.CUBLAS)),
    # prefill: dequantize + cuBLAS, but the fused tiles for fp32 activations and FP8 with fp32 scales
    ("V4-Pro wo_b, 4096 rows", NVFP4, 4096, 7168, 16384, LinearPlan(Kernel.CUBLAS)),
    ("V4-Pro wo_b fp8 fp32 scales, 4096 rows", Format("fp8", BF16, True), 4096, 7168, 16384,
     LinearPlan(Kernel.TILES, TileConfig(128, 128, 64, 1, 8, 8, 4))),
    ("V4-Pro wo_b, fp32 x, 4096 rows", Format("nvfp4", FP32), 4096, 7168, 16384,
     LinearPlan(Kernel.TILES, TileConfig(128, 128, 64, 1, 8, 8, 4))),
    # what no kernel takes: the reference
    ("fp16 activations", Format("nvfp4", torch.float16), 1, 2048, 4096, LinearPlan(Kernel.REFERENCE)),
    ("a dense weight", Format("dense"), 1, 2624, 4096, LinearPlan(Kernel.REFERENCE)),    # F.linear: cuBLAS
    ("FP4 K of 48", NVFP4, 1, 8, 48, LinearPlan(Kernel.REFERENCE)),
])
def test_linear_plans(case, fmt, M, N, K, plan):
    assert plan_linear(fmt, M, N, K, H200) == plan, case


def test_linear_plans_under_the_interpreter_and_forced():
    """The interpreter runs the GEMV wherever it can (every kernel is tested there); a forced GemvConfig the GEMV
    cannot take is refused, a forced TileConfig taken (also on a dense weight)."""
    assert plan_linear(Format("nvfp4", FP32), 16, 2048, 4096, INTERPRETER) == LinearPlan(Kernel.GEMV, GemvConfig())
    with pytest.raises(ValueError, match="GemvConfig"):
        plan_linear(NVFP4, 17, 2048, 4096, H200, force=GemvConfig())
    tiles = TileConfig(16, 32, 64)
    assert plan_linear(NVFP4, 1, 2048, 4096, H200, force=tiles) == LinearPlan(Kernel.TILES, tiles)
    # a dense weight: the tiles where forced and the kernels run, else the reference; no GEMV
    assert plan_linear(Format("dense"), 1, 2624, 4096, H200, force=tiles) == LinearPlan(Kernel.TILES, tiles)
    no_kernels = Device(gpu=False)
    assert plan_linear(Format("dense"), 1, 2624, 4096, no_kernels, force=tiles) == LinearPlan(Kernel.REFERENCE)
    with pytest.raises(ValueError, match="dense weight"):
        plan_linear(Format("dense"), 1, 1024, 4096, H200, force=GemvConfig())
    # wo_a (block-diagonal, 8 groups of 1024 rows): the GEMV at decode, dequantize + one bmm at prefill
    assert plan_linear(NVFP4, 1, 8192, 512, H200, groups=8).kernel is Kernel.GEMV
    assert plan_linear(NVFP4, 4096, 8192, 512, H200, groups=8).kernel is Kernel.CUBLAS


FLASH, FLASH_SHARED = Experts(NVFP4, NVFP4, 4096, 2048), Experts(FP8, FP8, 4096, 2048)   # 256 experts, top 6
PRO, PRO_SHARED = Experts(NVFP4, NVFP4, 7168, 3072), Experts(FP8, FP8, 7168, 3072)       # 384 experts, top 6
THREE_STAGES = GemvConfig(num_stages=3)


@pytest.mark.parametrize("case,tokens,experts,weights,shared,want", [
    # (routed, shared, blocks, up, down, up_alone, fused, x_ready)
    ("Flash 0", 0, 256, FLASH, FLASH_SHARED, (Routed.EMPTY, Shared.NONE, False, None, None, None, None, False)),
    ("Flash 1", 1, 256, FLASH, FLASH_SHARED, (Routed.PAIR, Shared.IN_PAIR, False, GemvConfig(), GemvConfig(),
                                              THREE_STAGES, None, True)),
    ("Flash 4", 4, 256, FLASH, FLASH_SHARED, (Routed.PAIR, Shared.IN_PAIR, False, GemvConfig(),
                                              GemvConfig(pdl=False), None, None, True)),
    ("Flash 12", 12, 256, FLASH, FLASH_SHARED, (Routed.PAIR, Shared.IN_PAIR, True, GemvConfig(),
                                                GemvConfig(pdl=False), None, None, True)),
    ("Flash 32", 32, 256, FLASH, FLASH_SHARED, (Routed.PAIR, Shared.SIDE, True, GemvConfig(pdl=False),
                                                GemvConfig(pdl=False), None, None, False)),
    ("Flash 300", 300, 256, FLASH, FLASH_SHARED, (Routed.SORTED, Shared.SIDE, False,
                                                  TileConfig(16, 128, 128, 1, 369, 4, 3, maxnreg=128),
                                                  TileConfig(16, 128, 128, 1, 369, 4, 3), None, None, False)),
    ("Pro 1", 1, 384, PRO, PRO_SHARED, (Routed.PAIR, Shared.IN_PAIR, False, GemvConfig(pdl=True, num_stages=3),
                                        WIDE_DOWN, None, False, True)),
    ("Pro 4", 4, 384, PRO, PRO_SHARED, (Routed.PAIR, Shared.SIDE, False, GemvConfig(pdl=False),
                                        GemvConfig(pdl=False), None, None, False)),
    ("Pro 512", 512, 384, PRO, PRO_SHARED, (Routed.SORTED, Shared.SIDE, False,
                                            TileConfig(16, 128, 128, 1, 576, 4, 3, maxnreg=128),
                                            TileConfig(16, 128, 128, 1, 576, 4, 3), None, None, False)),
])
def test_moe_plans(case, tokens, experts, weights, shared, want):
    """As the model runs the layer: right after routing, with the Ops table's side stream."""
    p = plan_moe(tokens, experts, 6, weights, shared, H200, after_route=True, side=True)
    assert (p.routed, p.shared, p.blocks, p.up, p.down, p.up_alone, p.fused, p.x_ready) == want, case


def test_moe_plans_without_a_side_stream_and_forced_paths():
    assert plan_moe(32, 256, 6, FLASH, FLASH_SHARED, H200).shared is Shared.AFTER
    tiles = plan_moe(4, 256, 6, FLASH, FLASH_SHARED, H200, decode="tiles")
    assert (tiles.routed, tiles.shared, tiles.up.BM, tiles.up.group_m) == (Routed.TILES, Shared.AFTER, 16, 24)
    assert plan_moe(12, 256, 6, FLASH, None, H200, block_tokens=None).routed is Routed.SORTED
    assert plan_moe(4, 256, 6, Experts(Format("dense"), Format("dense"), 4096, 2048), None, H200).routed is \
        Routed.REFERENCE
