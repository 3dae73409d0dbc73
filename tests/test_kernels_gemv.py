"""The decode GEMV (kernels/gemv.py) and the grouped linear against `kernels.ref`, under TRITON_INTERPRET=1.

The interpreter runs the portable decoders (the PTX ones run on GPUs only; bench/run_all.py checks them bit
for bit there) and fp32 dot operands, so fp32 checks are near-exact. Every test asserts that the GEMV itself
ran (a call counter on `gemv_launch.launch`), so a silent fallback to another kernel or the reference fails.
"""

import re

import pytest
import torch
import torch.nn.functional as F

from dsv4.formats import QWeight
from dsv4.formats.wordcode import code_words
from dsv4.kernels import Ops, decode, dispatch, gemm, gemv, gemv_launch, moe_pair, ops_for, policy, ref
from dsv4.kernels import moe as tmoe
from dsv4.kernels import tiles
from dsv4.kernels.host import Scratch
from dsv4.kernels.policy import INTERPRETER, Format, GemvConfig, TileConfig
from kernel_util import refuse, rel_err, stacked_weight

FORMATS = ("nvfp4", "mxfp4", "fp8", "fp8-f32")
LIMIT = 10.0


@pytest.fixture
def launches(monkeypatch):
    """Counts GEMV launches by row mode; the MoE pair (`moe_pair.launch_pair`, one launch or two) counts as its two
    stages."""
    seen = []
    real, real_pair = gemv_launch.launch, moe_pair.launch_pair

    def counting(*args, **kwargs):
        seen.append(kwargs.get("rows", policy.ROWS_DENSE))
        return real(*args, **kwargs)

    def counting_pair(*args, **kwargs):
        seen.extend([policy.ROWS_PAIR, policy.ROWS_TOKEN])
        return real_pair(*args, **kwargs)

    monkeypatch.setattr(gemv_launch, "launch", counting)
    monkeypatch.setattr(moe_pair, "launch_pair", counting_pair)
    return seen


def make_weight(fmt: str, n: int, k: int, lead: tuple = (), scale: float = 0.05) -> QWeight:
    return stacked_weight(fmt, n, k, lead, scale, spread="row")


def pair_into_nan(x, w13, w2, ids, w, shared, cfg, scratch, **launch):
    """h and out of `moe_pair.launch_pair` (cfg for both stages) written into NaN-filled buffers, so that a row or
    tile no unit writes stays NaN; `launch`: its other keyword arguments (fused, x_ready, blocks, ...)."""
    T, k = ids.shape
    h = torch.full((T * k + (T if shared else 0), w13.out_features), float("nan"))
    out = torch.full((T, w2.out_features), float("nan"))
    moe_pair.launch_pair(x, w13, h, w2, out, cfg, cfg, tokens=T, topk=k, ids=ids, rw=w.reshape(-1), limit=LIMIT,
                         shared=shared, scratch=scratch, **launch)
    return h, out


def stored_weight(fmt: str, n: int, k: int, lead: tuple = ()) -> QWeight:
    """A weight with the stored tensors of the right sizes (zeros): for decisions made on bytes alone."""
    if fmt == "fp8":
        return QWeight("fp8", torch.zeros(*lead, n, k, dtype=torch.float8_e4m3fn),
                       torch.ones(*lead, -(-n // 128), -(-k // 128)))
    if fmt == "mxfp4":
        return QWeight("mxfp4", torch.zeros(*lead, n, k // 2, dtype=torch.uint8),
                       torch.zeros(*lead, n, k // 32, dtype=torch.float8_e8m0fnu))
    return QWeight("nvfp4", torch.zeros(*lead, n, k // 2, dtype=torch.uint8),
                   torch.zeros(*lead, n, k // 16, dtype=torch.float8_e4m3fn), torch.ones(lead))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,n,k", [(1, 70, 384), (5, 64, 256), (16, 130, 128)])
def test_linear_matches_reference(launches, fmt, m, n, k):
    """Odd N (clamped rows never stored), an odd number of FP4 sub-steps (K = 384), the full 16 rows."""
    w = make_weight(fmt, n, k)
    x = torch.randn(m, k)
    y = dispatch.linear(x, w, fallback=refuse, scratch=Scratch())
    assert launches == [policy.ROWS_DENSE]
    assert y.shape == (m, n) and rel_err(y, ref.linear(x, w)) < 1e-6


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("cfg", [GemvConfig(), GemvConfig(BN=128, num_warps=4), policy.LARGE_FP4_16_ROWS],
                         ids=["w2", "w4 bn128", "w2 bn128"])
def test_dequantization_is_exact(launches, fmt, cfg):
    """x = identity rows: each output is one weight element, so the decoders' nibble and byte order, the K and
    row re-indexing (2 and 4 warps), the scales and the epilogue factor must reproduce QWeight.dequantize
    bit for bit."""
    w = make_weight(fmt, 70, 256)
    exact = w.dequantize(torch.float32).T
    for cols in (torch.arange(16) * 17, torch.arange(8) * 32 + torch.tensor([0, 5, 10, 15, 16, 21, 26, 31])):
        # one column in every scale group (16 rows), then at every offset within a word (8 rows: MMA N = 8)
        y = dispatch.linear(torch.eye(256)[cols], w, config=cfg, fallback=refuse)
        assert torch.equal(y, exact[cols])
    assert len(launches) == 2


@pytest.fixture
def kernel_calls(monkeypatch):
    """Every `_gemv_kernel` and `_moe_pair_kernel` launch as a dict: its unit counts (`gemv_launch.Units`) and layout
    (`gemv_launch.Layout`) by field name, its other constexprs and launch options, its grid and which kernel ("gemv"
    or "pair"); a one-launch pair's down stage as the same under "down"."""
    seen = []

    def fields(*bundles) -> dict:
        return {k: v for b in bundles for k, v in b._asdict().items()}

    class Recording:
        def __init__(self, real, name):
            self.real, self.name, self.arg_names = real, name, real.arg_names

        def __getitem__(self, grid):
            def run(*args, **consts):
                a = dict(zip(self.real.arg_names, args), **consts)
                if self.name == "gemv":
                    rec = fields(a["units"], a["L"])
                else:
                    rec = dict(fields(a["up_units"], a["UP"]), down=fields(a["dn_units"], a["DN"]))
                options = {k: v for k, v in consts.items() if not hasattr(v, "_asdict")}
                seen.append(dict(rec, **options, kernel=self.name, grid=grid))
                return self.real[grid](*args, **consts)
            return run

    monkeypatch.setattr(gemv, "_gemv_kernel", Recording(gemv._gemv_kernel, "gemv"))
    monkeypatch.setattr(moe_pair, "_moe_pair_kernel", Recording(moe_pair._moe_pair_kernel, "pair"))
    return seen


def stages(calls: list[dict]) -> list[dict]:
    """`kernel_calls` as one dict per GEMV stage: a `_gemv_kernel` launch is one, the MoE pair in one launch two."""
    out = []
    for a in calls:
        out.append(a)
        if a["kernel"] == "pair":
            out.append(a["down"])
    return out


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_group_columns_are_exact_for_one_fp4_row(kernel_calls, fmt):
    """One x row, FP4 weights: the MMA's columns carry the scale groups (`GemvConfig.group_cols`); with x a one-hot row
    every output is one weight element, so decode, group masks, scales and the final column sum must give
    QWeight.dequantize bit for bit - a column in each scale group of both sub-steps, and a split."""
    w = make_weight(fmt, 70, 256)
    exact = w.dequantize(torch.float32).T
    for col in (0, 17, 34, 51, 68, 85, 102, 119, 127, 128, 143, 200, 255):
        for cfg in (GemvConfig(group_cols=True), GemvConfig(group_cols=True, split=2)):
            y = dispatch.linear(torch.eye(256)[col:col + 1], w, config=cfg, fallback=refuse, scratch=Scratch())
            assert torch.equal(y, exact[col:col + 1]), col
    assert {c["GROUP_COLS"] for c in kernel_calls} == {True}


def test_group_columns_serve_exactly_the_one_row_fp4_launches(kernel_calls):
    """By default GROUP_COLS is on for both MoE launches (one x row per unit) and off for dense calls; asked for, it
    serves dense FP4 calls of one row, but not two rows or FP8. Every result matches the reference."""
    x = torch.randn(2, 384)
    on = GemvConfig(group_cols=True)
    for fmt, m, cfg, want in (("nvfp4", 1, on, True), ("mxfp4", 1, on, True),
                              ("nvfp4", 1, GemvConfig(), False), ("nvfp4", 2, on, False), ("fp8", 1, on, False)):
        w = make_weight(fmt, 70, 384)
        y = dispatch.linear(x[:m], w, config=cfg, fallback=refuse)
        assert kernel_calls[-1]["GROUP_COLS"] is want and rel_err(y, ref.linear(x[:m], w)) < 1e-6, (fmt, m)
    E, k, D, I, T = 4, 2, 128, 128, 2
    w13, w2 = make_weight("nvfp4", I, D, (E, 2), 0.1), make_weight("mxfp4", D, I, (E,), 0.1)
    xm = torch.randn(T, D)
    rw, ids = ref.route(torch.randn(T, E), torch.zeros(E), k, 1.5)
    kernel_calls.clear()
    y = dispatch.moe(xm, ids, rw, w13, w2, LIMIT, fallback=refuse, decode="gemv", scratch=Scratch())
    assert [c["GROUP_COLS"] for c in stages(kernel_calls)] == [True, True]
    assert rel_err(y, ref.moe(xm, ids, rw, w13, w2, LIMIT)) < 1e-6


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_split_k_rearms_and_bf16(launches, fmt):
    w = make_weight(fmt, 64, 512)
    x = torch.randn(3, 512)
    scratch = Scratch()
    for _ in range(2):  # the second call checks that the semaphores re-armed themselves
        y = dispatch.linear(x, w, config=GemvConfig(BN=64, split=3), fallback=refuse, scratch=scratch)
        assert rel_err(y, ref.linear(x, w)) < 1e-6
    assert int(scratch.counters(x.device, 1).abs().sum()) == 0
    xb = x.bfloat16()
    out = torch.full((3, 64), float("nan"), dtype=torch.bfloat16)
    dispatch.linear(xb, w, out=out, fallback=refuse)
    assert torch.isfinite(out).all() and rel_err(out, ref.linear(xb, w)) < 1e-2
    assert len(launches) == 3


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
@pytest.mark.parametrize("prefetch", [0, 3])
def test_every_weight_load_schedule_matches_reference(launches, fmt, prefetch):
    """Without and with register prefetch (the default prefetches FP8 only), over an odd number of
    sub-steps and K splits, where the last prefetches re-read the final step; plain and gated."""
    for n, k, split in ((70, 384, 0), (64, 640, 3), (64, 256, 2)):
        w = make_weight(fmt, n, k)
        x = torch.randn(3, k)
        y = dispatch.linear(x, w, config=GemvConfig(prefetch=prefetch, split=split), fallback=refuse,
                            scratch=Scratch())
        assert rel_err(y, ref.linear(x, w)) < 1e-6, (n, k, split)
        # gated (FP4: gate and up in one K loop), 1 and 3 rows: SwiGLU with the clamp of the dequantized products
        w13 = make_weight(fmt, n, k, (2,), 0.5)
        gate, up = (x @ w13.dequantize(torch.float32).transpose(-1, -2)).unbind(0)
        want = F.silu(gate.clamp(max=LIMIT / 4)) * up.clamp(-LIMIT / 4, LIMIT / 4)
        for m in (1, 3):
            h = torch.empty(m, n)
            gemv_launch.launch(x[:m], w13, h, GemvConfig(prefetch=prefetch, split=split), M=m, gated=True,
                        limit=LIMIT / 4, scratch=Scratch())
            assert rel_err(h, want[:m]) < 1e-5, (n, k, split, m)
    assert len(launches) == 9


def test_split_choice_weighs_fill_against_unit_cost():
    assert policy.choose_split(1024, 12, 1056) == 1     # the tiles fill the grid: no split
    assert policy.choose_split(112, 128, 1056) == 8     # V4-Pro wo_b: one wave of 16-step units
    split = policy.choose_split(1, 128, 1056)           # one tile, long K: split, >= 2 sub-steps each
    assert 1 < split <= 64 and 128 // split >= 2


def test_moe_auto_takes_the_gemv_pair_up_to_six_pairs_per_expert(launches):
    """The GEMV pair up to 8 tokens, over expert blocks from 9 tokens while the (token, slot) pairs are at most
    `policy.BLOCK_PAIRS_PER_EXPERT` (6) per expert (`moe.auto_block_tokens`: 4 experts of 2 per token, 12 tokens), above
    the grouped (sorted) kernels."""
    E, k, D, I = 4, 2, 128, 128
    assert policy.auto_block_tokens(E, k) == (9, 12) and policy.auto_block_tokens(256, 6) == (9, 256)
    w13, w2 = make_weight("nvfp4", I, D, (E, 2), 0.1), make_weight("nvfp4", D, I, (E,), 0.1)
    pair = [policy.ROWS_PAIR, policy.ROWS_TOKEN]
    for T, want in ((1, pair), (8, pair), (9, pair), (12, pair), (13, [])):
        launches.clear()
        x = torch.randn(T, D)
        w, ids = ref.route(torch.randn(T, E), torch.zeros(E), k, 1.5)
        y = dispatch.moe(x, ids, w, w13, w2, LIMIT, fallback=refuse, scratch=Scratch())
        assert launches == want and rel_err(y, ref.moe(x, ids, w, w13, w2, LIMIT)) < 1e-6
    with pytest.raises(ValueError, match="block_tokens 'on'"):
        dispatch.moe(x, ids, w, w13, w2, LIMIT, fallback=refuse, block_tokens="on")


def test_unsupported_calls_leave_the_gemv():
    x = torch.randn(2, 96)
    nvfp4 = Format("nvfp4", x.dtype)
    assert not policy.gemv_takes(nvfp4, 2, 96, INTERPRETER)          # K not a multiple of 128
    assert not policy.gemv_takes(nvfp4, 17, 128, INTERPRETER)        # > 16 rows
    assert not policy.gemv_takes(Format("dense", x.dtype), 1, 128, INTERPRETER)
    with pytest.raises(ValueError, match="GemvConfig"):
        dispatch.linear(torch.randn(2, 96), make_weight("nvfp4", 8, 96), config=GemvConfig(), fallback=refuse)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp8"])
def test_grouped_linear(launches, fmt):
    groups, R, c = 4, 64, 128
    w = make_weight(fmt, groups * R, c)
    ops = ops_for("cpu", "triton")
    for T in (1, 3):
        x = torch.randn(T, groups, c)
        y = ops.grouped_linear(x, w, groups)
        # independent oracle: one F.linear per group on the dequantized rows
        wd = w.dequantize(torch.float32)
        r = torch.stack([F.linear(x[:, g], wd[g * R:(g + 1) * R]) for g in range(groups)], dim=1)
        assert y.shape == (T, groups, R) and rel_err(y, r) < 1e-6
    assert launches == [policy.ROWS_DENSE] * 2
    y = dispatch.grouped_linear(x, w, groups, fallback=refuse, scratch=Scratch())
    assert rel_err(y, ref.grouped_linear(x, w, groups)) < 1e-6


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
@pytest.mark.parametrize("T", [20, 70])
def test_grouped_linear_fused_tiles(fmt, T):
    """Above the GEMV's rows, up to policy.MID_ROWS: the fused tiles, each N tile reading its group's x columns."""
    groups, R, c = 3, 128, 256
    w = make_weight(fmt, groups * R, c)
    x = torch.randn(T, groups, c)
    y = dispatch.grouped_linear(x, w, groups, fallback=refuse, scratch=Scratch())
    wd = w.dequantize(torch.float32)
    r = torch.stack([F.linear(x[:, g], wd[g * R:(g + 1) * R]) for g in range(groups)], dim=1)
    assert y.shape == (T, groups, R) and rel_err(y, r) < 1e-6
    with pytest.raises(ValueError, match="multiple of BN"):
        gemm.launch(x.reshape(T, -1), w, torch.empty(T, groups * R), TileConfig(16, 128, 128), M=T, group_r=64,
                    x_gstride=c)


def test_grouped_linear_reference_and_dispatch():
    w = QWeight("dense", torch.randn(3 * 8, 16))
    x = torch.randn(2, 5, 3, 16)
    r = torch.einsum("btgc,grc->btgr", x, w.weight.view(3, 8, 16))
    assert torch.allclose(ref.grouped_linear(x, w, 3), r, atol=1e-5)
    with pytest.raises(ValueError, match="grouped_linear"):
        ref.grouped_linear(x, w, 4)
    assert Ops.reference().grouped_linear is ref.grouped_linear
    assert ops_for("cpu", "triton").grouped_linear.func is dispatch.grouped_linear


@pytest.mark.parametrize("fmt13,fmt2", [("nvfp4", "nvfp4"), ("mxfp4", "fp8")])
def test_moe_decode(launches, fmt13, fmt2):
    """Gate/up over (token, slot) pairs; down with the routing weights and the top-k sum as extra K splits."""
    E, k, D, I, T = 6, 3, 128, 128, 3
    w13 = make_weight(fmt13, I, D, (E, 2), 0.1)
    w2 = make_weight(fmt2, D, I, (E,), 0.1)
    x = torch.randn(T, D)
    w, ids = ref.route(torch.randn(T, E), torch.zeros(E), k, 1.5)
    y = dispatch.moe(x, ids, w, w13, w2, LIMIT, fallback=refuse, decode="gemv", scratch=Scratch())
    assert launches == [policy.ROWS_PAIR, policy.ROWS_TOKEN]
    assert rel_err(y, ref.moe(x, ids, w, w13, w2, LIMIT)) < 1e-6


def test_moe_decode_split_and_shared_mlp(launches):
    E, k, D, I, T = 4, 2, 256, 128, 2
    w13 = make_weight("nvfp4", I, D, (E, 2), 1.0)   # large pre-activations: both clamps engage
    w2 = make_weight("mxfp4", D, I, (E,), 0.1)
    x = torch.randn(T, D) * 3
    w, ids = ref.route(torch.randn(T, E), torch.zeros(E), k, 1.0)
    up, down = GemvConfig(BN=64, split=2), GemvConfig(BN=64, split=1)
    h = torch.empty(T * k, I)
    out = torch.empty(T, D)
    scratch = Scratch()
    gemv_launch.launch(x, w13, h, up, M=T * k, rows=policy.ROWS_PAIR, R=T * k, gated=True, x_div=k, ids=ids,
                limit=0.5, scratch=scratch)
    gemv_launch.launch(h, w2, out, down, M=T, rows=policy.ROWS_TOKEN, R=T, topk=k, ids=ids, rw=w.reshape(-1),
                scratch=scratch)
    assert rel_err(out, ref.moe(x, ids, w, w13, w2, 0.5)) < 1e-5   # split-K order; large pre-activations
    assert int(scratch.counters(x.device, 1).abs().sum()) == 0
    s13, s2 = make_weight("fp8", 256, D, (2,), 0.5), make_weight("fp8", D, 256)
    y = dispatch.mlp(x, s13, s2, LIMIT, fallback=refuse, linear=ops_for("cpu", "triton").linear, scratch=scratch)
    assert rel_err(y, ref.mlp(x, s13, s2, LIMIT)) < 1e-6
    assert launches == [policy.ROWS_PAIR, policy.ROWS_TOKEN, policy.ROWS_DENSE, policy.ROWS_DENSE]


@pytest.mark.parametrize("fmt,shared_fmt", [("nvfp4", "fp8"), ("mxfp4", "nvfp4")])
def test_moe_streams_the_shared_expert_in_its_two_launches(launches, fmt, shared_fmt):
    """The shared expert (any format) is one more gate/up pair and one more down slot per token: still two
    launches, no separate MLP, and the same result as routed + shared."""
    E, k, D, I, T = 5, 2, 512, 256, 3
    w13, w2 = make_weight(fmt, I, D, (E, 2), 0.5), make_weight(fmt, D, I, (E,), 0.1)
    shared = make_weight(shared_fmt, I, D, (2,), 0.5), make_weight(shared_fmt, D, I, (), 0.1)
    x = torch.randn(T, D) * 2
    w, ids = ref.route(torch.randn(T, E), torch.zeros(E), k, 1.5)
    want = ref.moe(x, ids, w, w13, w2, LIMIT, shared=shared)
    y = dispatch.moe(x, ids, w, w13, w2, LIMIT, fallback=refuse, shared=shared, scratch=Scratch())
    assert launches == [policy.ROWS_PAIR, policy.ROWS_TOKEN] and rel_err(y, want) < 1e-6
    # forced K splits (FP4 and FP8 split K differently), twice: the semaphores re-arm
    scratch, P = Scratch(), T * k
    for _ in range(2):
        h, out = torch.empty(P + T, I), torch.empty(T, D)
        gemv_launch.launch(x, w13, h, GemvConfig(split=2), M=P + T, rows=policy.ROWS_PAIR, R=P + T, gated=True,
                    x_div=k, ids=ids, limit=LIMIT, shared=shared[0], pairs=P, scratch=scratch)
        gemv_launch.launch(h, w2, out, GemvConfig(split=2), M=T, rows=policy.ROWS_TOKEN, R=T, topk=k, ids=ids,
                    rw=w.reshape(-1), shared=shared[1], pairs=P, scratch=scratch)
        assert rel_err(out, want) < 1e-6
    assert int(scratch.counters(x.device, 1).abs().sum()) == 0
    with pytest.raises(ValueError, match="shared expert"):
        gemv_launch.launch(x, w13, h, GemvConfig(), M=P + T, rows=policy.ROWS_PAIR, R=P + T, gated=True, x_div=k,
                    ids=ids, shared=make_weight(shared_fmt, I + 8, D, (2,)), pairs=P)


@pytest.mark.parametrize("fmt,shared_fmt", [("nvfp4", "fp8"), ("mxfp4", "nvfp4")])
def test_shared_expert_first_after_route_gives_the_same_bits(kernel_calls, fmt, shared_fmt):
    """`moe(after_route=True)`: the gate/up launch runs the shared expert's units first (X_READY; with PDL on a
    GPU they overlap the routing kernel). Every unit computes what it did before and split partials are summed
    in split order, so the result is bit for bit the plain launch's, with and without K splits; the down
    launch and calls without a shared expert are unchanged."""
    E, k, D, I, T = 5, 2, 512, 128, 3
    w13, w2 = make_weight(fmt, I, D, (E, 2), 0.5), make_weight(fmt, D, I, (E,), 0.1)
    shared = make_weight(shared_fmt, I, D, (2,), 0.5), make_weight(shared_fmt, D, I, (), 0.1)
    x = torch.randn(T, D) * 2
    w, ids = ref.route(torch.randn(T, E), torch.zeros(E), k, 1.5)
    plain = dispatch.moe(x, ids, w, w13, w2, LIMIT, fallback=refuse, shared=shared, scratch=Scratch())
    first = dispatch.moe(x, ids, w, w13, w2, LIMIT, fallback=refuse, shared=shared, scratch=Scratch(),
                     after_route=True)
    # the pair in one launch (its down projection is more than one wave of the interpreter's 4 slots)
    assert [(c["kernel"], c["X_READY"]) for c in kernel_calls] == [("pair", False), ("pair", True)]
    assert torch.equal(first, plain) and rel_err(first, ref.moe(x, ids, w, w13, w2, LIMIT, shared=shared)) < 1e-6
    dispatch.moe(x, ids, w, w13, w2, LIMIT, fallback=refuse, scratch=Scratch(), after_route=True)
    assert [c["X_READY"] for c in kernel_calls[-1:]] == [False]
    P = T * k
    for split in (1, 2):
        hs = []
        for x_ready in (False, True):
            hs.append(torch.empty(P + T, I))
            gemv_launch.launch(x, w13, hs[-1], GemvConfig(split=split), M=P + T, rows=policy.ROWS_PAIR, R=P + T,
                        gated=True, x_div=k, ids=ids, limit=LIMIT, shared=shared[0], pairs=P,
                        scratch=Scratch(), x_ready=x_ready)
        assert kernel_calls[-1]["X_READY"] and (kernel_calls[-1]["SPLIT"] > 1) == (split > 1)
        assert torch.equal(hs[0], hs[1]), split


@pytest.mark.parametrize("fmt,shared_fmt,split", [("nvfp4", "fp8", 2), ("mxfp4", "nvfp4", 1), ("nvfp4", None, 2),
                                                   ("fp8", "fp8", 1)])
def test_pair_in_one_launch_gives_the_bits_of_two(kernel_calls, fmt, shared_fmt, split):
    """`moe_pair.launch_pair(fused=True)`: gate/up and down in one launch, down units waiting for their h rows. Each
    unit computes what it does in two launches and split partials are summed in split order, so h and the
    output are bit for bit the two launches', with and without K splits, the shared expert first or last and
    the down units in either order; the scratch's semaphores, tickets and row flags re-arm (a second call on
    the same scratch, and all zero after)."""
    E, k, D, I, T = 5, 2, 512, 256, 2
    w13, w2 = make_weight(fmt, I, D, (E, 2), 0.5), make_weight(fmt, D, I, (E,), 0.1)
    shared = (make_weight(shared_fmt, I, D, (2,), 0.5), make_weight(shared_fmt, D, I, (), 0.1)) if shared_fmt else None
    x = torch.randn(T, D) * 2
    w, ids = ref.route(torch.randn(T, E), torch.zeros(E), k, 1.5)
    cfg, scratch = GemvConfig(split=split), Scratch()
    runs = []
    for fused, x_ready, order in ((False, False, True), (True, False, True), (True, True, False)):
        runs.append(pair_into_nan(x, w13, w2, ids, w, shared, cfg, scratch, x_ready=x_ready, fused=fused,
                                  pair_order=order))
        assert kernel_calls[-1]["kernel"] == ("pair" if fused else "gemv")
    assert rel_err(runs[0][1], ref.moe(x, ids, w, w13, w2, LIMIT, shared=shared)) < 1e-6
    for h, out in runs[1:]:
        assert torch.equal(h, runs[0][0]) and torch.equal(out, runs[0][1])
    assert (kernel_calls[-1]["SPLIT"] > 1) == (split > 1) and kernel_calls[-1]["X_READY"] == bool(shared)
    assert int(scratch.counters(x.device, 1).abs().sum()) == 0


def test_expert_blocks_list_each_distinct_expert_once_with_its_pairs():
    """`moe.expert_blocks`: one row per block of at most MP (the MMA's N) pairs of one expert, experts in increasing
    order, each expert's pairs in pair order (an expert with more continues in the next block); rows past the last
    block have no pairs. Up to 240 pairs: several of the kernel's chunks of 64, experts whose pairs span them. The
    table has `moe.block_rows` rows: fewer than the pairs where experts are few, every one used where each expert
    has one pair more than a multiple of MP (3 experts x 9 pairs: 6 blocks)."""
    MP = policy.mma_n(1)
    gen = torch.Generator().manual_seed(1)
    for ids, E in ((torch.tensor([[3, 1], [1, 4], [3, 1], [0, 2]]), 5), (torch.tensor([[5, 2, 7]] * 11), 8),
                   (torch.randint(0, 9, (8, 6), generator=gen), 9), (torch.tensor([[4]]), 6),
                   (torch.stack([torch.randperm(13, generator=gen)[:6] for _ in range(40)]), 13),
                   (torch.stack([torch.randperm(200, generator=gen)[:6] for _ in range(20)]), 200),
                   (torch.tensor([[0, 1, 2]] * (MP + 1)), 3)):
        table = tmoe.expert_blocks(ids, E)
        flat = ids.flatten().tolist()
        want = []   # (expert, pairs) per block
        for e in sorted(set(flat)):
            pairs = [p for p, f in enumerate(flat) if f == e]
            want += [(e, pairs[i:i + MP]) for i in range(0, len(pairs), MP)]
        rows = tmoe.block_rows(ids.numel(), E)
        assert len(want) <= rows <= ids.numel() and table.shape == (rows, 2 + MP) and table.dtype == torch.int32
        for b, row in enumerate(table.tolist()):
            if b < len(want):
                e, pairs = want[b]
                assert row[:2] == [e, len(pairs)] and row[2:2 + len(pairs)] == pairs, (ids, b)
            else:
                assert row[1] == 0
        assert sum(len(p) for _, p in want) == ids.numel()
    assert (tmoe.block_rows(3 * (MP + 1), 3), tmoe.block_rows(24, 2), tmoe.block_rows(384, 256)) == (6, 4, 272)


@pytest.mark.parametrize("fmt,shared_fmt,T", [("nvfp4", "fp8", 4), ("mxfp4", "nvfp4", 5), ("fp8", None, 6),
                                               ("nvfp4", None, 8)])
def test_moe_streams_each_distinct_expert_once(kernel_calls, fmt, shared_fmt, T):
    """`moe(block_tokens=(4, 8))`: at 4-8 tokens the GEMV pair runs over expert blocks (BLOCKS; by default only from
    9 tokens): tokens that share an expert are that block's MMA columns, in gate/up and down. Against the reference
    with experts shared by 2-4 tokens; with every expert distinct the blocks have one pair each and the output is bit
    for bit that of the pair without blocks (T outside `block_tokens`, or None)."""
    E, k, D, I = 5, 2, 256, 128
    gen = torch.Generator().manual_seed(T)
    w13, w2 = make_weight(fmt, I, D, (E, 2), 0.5), make_weight(fmt, D, I, (E,), 0.1)
    shared = (make_weight(shared_fmt, I, D, (2,), 0.5), make_weight(shared_fmt, D, I, (), 0.1)) if shared_fmt else None
    x = torch.randn(T, D, generator=gen) * 2
    w, ids = ref.route(torch.randn(T, E, generator=gen), torch.zeros(E), k, 1.5)
    assert ids.unique().numel() < ids.numel()   # experts shared between tokens
    got = dispatch.moe(x, ids, w, w13, w2, LIMIT, fallback=refuse, shared=shared, scratch=Scratch(),
                   block_tokens=(4, 8))
    assert kernel_calls[-1]["BLOCKS"]
    assert rel_err(got, ref.moe(x, ids, w, w13, w2, LIMIT, shared=shared)) < 1e-6
    E2 = 2 * T
    w13u, w2u = make_weight(fmt, I, D, (E2, 2), 0.5), make_weight(fmt, D, I, (E2,), 0.1)
    distinct = torch.randperm(E2, generator=gen)[:T * k].reshape(T, k)
    blocks = dispatch.moe(x, distinct, w, w13u, w2u, LIMIT, fallback=refuse, shared=shared, scratch=Scratch(),
                      block_tokens=(T, T))
    assert kernel_calls[-1]["BLOCKS"]
    for off in ((T + 1, 8), None):
        plain = dispatch.moe(x, distinct, w, w13u, w2u, LIMIT, fallback=refuse, shared=shared, scratch=Scratch(),
                         block_tokens=off)
        assert not kernel_calls[-1].get("BLOCKS", False) and torch.equal(blocks, plain)


def test_moe_beyond_eight_tokens_runs_the_pair_over_expert_blocks(kernel_calls):
    """From 9 tokens (`moe.auto_block_tokens`) `moe` runs the routed experts as the GEMV pair over expert blocks (up
    to 8 pairs of one expert per block) and adds the shared expert with `mlp_op` (token columns hold at most 8
    tokens); past the range, the sorted grouped tiles: both against the reference."""
    E, k, D, I, T = 8, 4, 256, 128, 12   # (at most 6 pairs per expert: blocks up to 12 tokens)
    gen = torch.Generator().manual_seed(T)
    w13, w2 = make_weight("nvfp4", I, D, (E, 2), 0.5), make_weight("nvfp4", D, I, (E,), 0.1)
    shared = make_weight("fp8", I, D, (2,), 0.5), make_weight("fp8", D, I, (), 0.1)
    x = torch.randn(T, D, generator=gen) * 2
    logits = torch.randn(T, E, generator=gen)
    logits[:, 0] += 8   # every token routes to expert 0: more pairs than one block holds
    w, ids = ref.route(logits, torch.zeros(E), k, 1.5)
    assert int(ids.flatten().bincount().max()) > policy.mma_n(1)
    want = ref.moe(x, ids, w, w13, w2, LIMIT, shared=shared)
    got = dispatch.moe(x, ids, w, w13, w2, LIMIT, fallback=refuse, shared=shared, scratch=Scratch())
    assert any(c.get("BLOCKS") for c in kernel_calls) and rel_err(got, want) < 1e-6
    kernel_calls.clear()
    past = dispatch.moe(x, ids, w, w13, w2, LIMIT, fallback=refuse, shared=shared, scratch=Scratch(),
                    block_tokens=(T + 1, 64))
    assert not any(c.get("BLOCKS") for c in kernel_calls) and rel_err(past, want) < 1e-2


@pytest.mark.parametrize("fmt,shared_fmt,split", [("nvfp4", "fp8", 2), ("mxfp4", None, 1)])
def test_expert_block_pair_in_one_launch_gives_the_bits_of_two(kernel_calls, fmt, shared_fmt, split):
    """`launch_pair(blocks=..., fused=True)`: a gate/up block unit counts its tiles into the h row of each of its
    pairs and a down block unit waits for all of them (under the interpreter the wait asserts that every count is
    there); h and out are bit for bit the two launches', with the shared expert first or last, and the flags re-arm."""
    E, k, D, I, T = 5, 2, 256, 128, 6
    gen = torch.Generator().manual_seed(5 + split)
    w13, w2 = make_weight(fmt, I, D, (E, 2), 0.5), make_weight(fmt, D, I, (E,), 0.1)
    shared = (make_weight(shared_fmt, I, D, (2,), 0.5), make_weight(shared_fmt, D, I, (), 0.1)) if shared_fmt else None
    x = torch.randn(T, D, generator=gen) * 2
    w, ids = ref.route(torch.randn(T, E, generator=gen), torch.zeros(E), k, 1.5)
    table = tmoe.expert_blocks(ids, E)
    assert int(table[:, 1].max()) > 1   # a block of several pairs
    cfg, scratch = GemvConfig(split=split), Scratch()
    runs = []
    for fused, x_ready in ((False, False), (True, False), (True, True)):
        runs.append(pair_into_nan(x, w13, w2, ids, w, shared, cfg, scratch, x_ready=x_ready, fused=fused,
                                  blocks=table))
        assert kernel_calls[-1]["kernel"] == ("pair" if fused else "gemv") and kernel_calls[-1]["BLOCKS"]
    assert not kernel_calls[-1]["PAIR_ORDER"]
    assert rel_err(runs[0][1], ref.moe(x, ids, w, w13, w2, LIMIT, shared=shared)) < 1e-6
    for h, out in runs[1:]:
        assert torch.equal(h, runs[0][0]) and torch.equal(out, runs[0][1])
    assert int(scratch.counters(x.device, 1).abs().sum()) == 0


def test_expert_blocks_must_fit_the_launch():
    """Expert blocks run over the pairs' table (int32 [1..pairs, 2 + MP]), with the shared expert (if any) as token
    columns."""
    E, k, D, I, T = 4, 2, 256, 128, 2
    w13 = make_weight("nvfp4", I, D, (E, 2))
    w, ids = ref.route(torch.randn(T, E), torch.zeros(E), k, 1.0)
    table = tmoe.expert_blocks(ids, E)
    shared = make_weight("nvfp4", I, D, (2,))   # 2 tokens: a row block per token, not token columns
    with pytest.raises(ValueError, match="expert blocks"):
        gemv_launch.launch(torch.randn(T, D), w13, torch.empty(T * k + T, I), GemvConfig(), M=T * k + T,
                    rows=policy.ROWS_PAIR, R=T * k + T, gated=True, x_div=k, limit=LIMIT, shared=shared, pairs=T * k,
                    blocks=table)
    for bad in (torch.cat([table, table]), table[:, :-1], table.long()):   # more rows than pairs, columns, dtype
        with pytest.raises(ValueError, match="expert blocks"):
            gemv_launch.launch(torch.randn(T * k, D), w13, torch.empty(T * k, I), GemvConfig(), M=T * k,
                        rows=policy.ROWS_PAIR, R=T * k, gated=True, x_div=k, limit=LIMIT, pairs=T * k, blocks=bad)


@pytest.mark.parametrize("split,shared_fmt", [(2, "nvfp4"), (3, None), (4, "fp8")])
def test_down_projection_sums_many_partials(kernel_calls, split, shared_fmt):
    """The down projection's output tiles sum top-k x K-split partials (plus the shared expert's): 10-24 of them
    here (the MoE down projection has 14-16 at 1 token), every one counted."""
    E, k, D, I, T = 8, 5, 64, 1024, 2
    w2 = make_weight("nvfp4", D, I, (E,), 0.1)
    s2 = make_weight(shared_fmt, D, I, (), 0.1) if shared_fmt else None
    w, ids = ref.route(torch.randn(T, E), torch.zeros(E), k, 1.5)
    h = torch.randn(T * k + (T if s2 else 0), I)
    out = torch.empty(T, D)
    gemv_launch.launch(h, w2, out, GemvConfig(split=split), M=T, rows=policy.ROWS_TOKEN, R=T, topk=k, ids=ids,
                rw=w.reshape(-1), shared=s2, pairs=T * k, scratch=Scratch())
    parts = kernel_calls[-1]["SPLIT"] * k + (kernel_calls[-1]["SPLIT_S"] if s2 else 0)
    assert parts > 8, parts
    experts = w2.dequantize(torch.float64)[ids.reshape(-1)]                    # [T * k, D, I]
    want = torch.einsum("pdi,pi,p->pd", experts, h[:T * k].double(), w.reshape(-1).double()).view(T, k, D).sum(1)
    if s2:
        want += h[T * k:].double() @ s2.dequantize(torch.float64).T
    assert rel_err(out, want) < 1e-6


def test_pair_runs_in_one_launch_where_the_down_projection_takes_more_than_one_wave(monkeypatch, kernel_calls):
    """`launch_pair(fused=None)`: one launch where the down projection's units exceed the CTAs that fit at once
    (round nine: 2-5 % faster at 4-8 tokens), two launches where both stages are single waves (1 token). In two
    launches gate/up streams with 3 pipeline stages up to `policy.THREE_STAGE_UP_TOKENS` tokens (`up_alone`), down and
    the one-launch pair with 2."""
    E, k, D, I = 5, 2, 256, 128
    w13, w2 = make_weight("nvfp4", I, D, (E, 2), 0.5), make_weight("nvfp4", D, I, (E,), 0.1)
    assert policy.THREE_STAGE_UP_TOKENS == 2
    for sms, T, kernels, stages in ((1024, 1, ["gemv"] * 2, [3, 2]), (1024, 2, ["gemv"] * 2, [3, 2]),
                                    (1024, 3, ["gemv"] * 2, [2, 2]), (4, 1, ["pair"], [2]), (4, 3, ["pair"], [2])):
        monkeypatch.setattr(gemv_launch, "num_sms", lambda device: sms)
        x = torch.randn(T, D)
        w, ids = ref.route(torch.randn(T, E), torch.zeros(E), k, 1.5)
        kernel_calls.clear()
        y = dispatch.moe(x, ids, w, w13, w2, LIMIT, fallback=refuse, scratch=Scratch())
        assert [c["kernel"] for c in kernel_calls] == kernels, (sms, T)
        assert [c["num_stages"] for c in kernel_calls] == stages, (sms, T)
        assert rel_err(y, ref.moe(x, ids, w, w13, w2, LIMIT)) < 1e-6


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_large_experts_stream_their_down_projection_in_128_rows_up_to_2_tokens(fmt):
    """`moe.pair_configs`: V4-Pro's experts (12.4 MB NVFP4 / 11.7 MB MXFP4 of w2 each) run the pair as two launches
    with 128-row down units and 3-stage gate/up at 1-2 tokens (run 109: 2-16 % faster there, mostly slower at 3-4);
    V4-Flash's (4.7 / 4.5 MB) and 3+ tokens keep the defaults."""
    pro = stored_weight(fmt, 7168, 3072, (2,)).nbytes() / 2
    flash = stored_weight(fmt, 4096, 2048, (2,)).nbytes() / 2
    assert flash < policy.WIDE_DOWN_EXPERT_BYTES <= pro
    assert policy.WIDE_DOWN_TOKENS == 2 and policy.WIDE_DOWN.BN == 128
    for overlap in (False, True):
        default, three = GemvConfig(pdl=overlap), GemvConfig(pdl=overlap, num_stages=3)
        plain_down = GemvConfig(pdl=False)
        assert policy.DOWN_PDL_TOKENS == 2 and not policy.WIDE_DOWN.pdl
        for T in (1, 2):   # the 64-row down launch under PDL where gate/up streams the shared expert under it
            assert policy.pair_configs(T, pro, overlap) == (three, policy.WIDE_DOWN, None, False)
            assert policy.pair_configs(T, flash, overlap) == (default, GemvConfig(pdl=overlap), three, None)
        for T in (3, 4, 8):
            assert policy.pair_configs(T, pro, overlap) == policy.pair_configs(T, flash, overlap) == \
                (default, plain_down, None, None)


@pytest.mark.parametrize("fmt,shared_fmt", [("nvfp4", "fp8"), ("mxfp4", None)])
def test_moe_with_128_row_down_units_matches_reference(monkeypatch, kernel_calls, fmt, shared_fmt):
    """The 128-row down projection through `moe.moe` (the byte threshold lowered to reach it at toy sizes): two
    launches, gate/up 64 rows with 3 stages, down 128 rows (3 units over D = 384), the shared expert in both;
    against the reference at 1-2 tokens, and the defaults again at 3."""
    monkeypatch.setattr(policy, "WIDE_DOWN_EXPERT_BYTES", 0)
    monkeypatch.setattr(gemv_launch, "num_sms", lambda device: 1024)   # single waves: two launches at 3 tokens too
    E, k, D, I = 5, 2, 384, 256
    w13, w2 = make_weight(fmt, I, D, (E, 2), 0.5), make_weight(fmt, D, I, (E,), 0.1)
    shared = (make_weight(shared_fmt, I, D, (2,), 0.5), make_weight(shared_fmt, D, I, (), 0.1)) if shared_fmt else None
    for T, bns, stages in ((1, [64, 128], [3, 2]), (2, [64, 128], [3, 2]), (3, [64, 64], [2, 2])):
        x = torch.randn(T, D) * 2
        w, ids = ref.route(torch.randn(T, E), torch.zeros(E), k, 1.5)
        kernel_calls.clear()
        y = dispatch.moe(x, ids, w, w13, w2, LIMIT, fallback=refuse, shared=shared, scratch=Scratch())
        assert [c["kernel"] for c in kernel_calls] == ["gemv", "gemv"], T
        assert [c["BN"] for c in kernel_calls] == bns and [c["num_stages"] for c in kernel_calls] == stages, T
        assert rel_err(y, ref.moe(x, ids, w, w13, w2, LIMIT, shared=shared)) < 1e-6, T


def test_pair_refuses_a_two_launch_gate_up_of_another_tile_height():
    """`launch_pair(up_alone=...)` shares gate/up's split-K counters, sized by `up.BN`: another BN is refused."""
    E, k, D, I, T = 4, 2, 128, 128, 1
    w13, w2 = make_weight("nvfp4", I, D, (E, 2)), make_weight("nvfp4", D, I, (E,))
    w, ids = ref.route(torch.randn(T, E), torch.zeros(E), k, 1.5)
    with pytest.raises(ValueError, match="up_alone.BN 128"):
        moe_pair.launch_pair(torch.randn(T, D), w13, torch.empty(T * k, I), w2, torch.empty(T, D),
                             GemvConfig(), GemvConfig(), tokens=T, topk=k, ids=ids, rw=w.reshape(-1),
                             limit=LIMIT, up_alone=GemvConfig(BN=128))


def test_one_launch_pair_needs_the_ptx_build_on_a_gpu(monkeypatch):
    """On a GPU the one-launch pair's down units wait for their h rows with PTX acquire loads, which the plain-Triton
    build (`GemvConfig(asm=False)`) leaves out: asked for, one launch is refused before anything runs."""
    monkeypatch.setattr(moe_pair, "interpreting", lambda: False)
    E, k, D, I, T = 4, 2, 128, 128, 1
    w13, w2 = make_weight("nvfp4", I, D, (E, 2)), make_weight("nvfp4", D, I, (E,))
    w, ids = ref.route(torch.randn(T, E), torch.zeros(E), k, 1.5)
    with pytest.raises(ValueError, match="GemvConfig.asm"):
        moe_pair.launch_pair(torch.randn(T, D), w13, torch.empty(T * k, I), w2, torch.empty(T, D),
                             GemvConfig(asm=False), GemvConfig(asm=False), tokens=T, topk=k, ids=ids,
                             rw=w.reshape(-1), limit=LIMIT, fused=True)


def test_fused_pair_down_order_is_a_permutation_in_h_row_order():
    """`_pair_down_unit` maps the fused pair's v-th down unit to the down launch's own unit numbering: every unit
    exactly once, in the order gate/up completes h rows (pair by pair; the shared expert's rows first when its
    gate/up units come first)."""
    import triton
    import triton.language as tl

    @triton.jit
    def order(out_ptr, R, num_n, splits, SPLIT, SPLIT_S, TOPK, N_UNITS, SHARED: tl.constexpr,
              FIRST: tl.constexpr, COLS: tl.constexpr):
        for v in range(0, N_UNITS):
            tl.store(out_ptr + v, moe_pair._pair_down_unit(v, R, num_n, splits, SPLIT, SPLIT_S, TOPK, SHARED, FIRST,
                                                           COLS))

    R, num_n, SPLIT, SPLIT_S, TOPK = 3, 4, 2, 3, 2
    for shared, first, cols in ((True, True, False), (True, False, False), (False, False, False), (True, True, True),
                                (True, False, True)):
        splits = SPLIT * TOPK + (SPLIT_S if shared else 0)
        n_shared = (1 if cols else R) * num_n * SPLIT_S if shared else 0
        n = R * num_n * SPLIT * TOPK + n_shared
        got = torch.empty(n, dtype=torch.int32)
        order[(1,)](got, R, num_n, splits, SPLIT, SPLIT_S, TOPK, n, SHARED=shared, FIRST=first, COLS=cols)
        assert sorted(got.tolist()) == list(range(n)), (shared, first, cols)
        # the h row each down unit reads (ROWS_TOKEN: token r = tile // num_n, slot j // SPLIT; slot TOPK = shared;
        # cols: the shared units first in the launch, one block for all tokens, then SPLIT * TOPK per routed tile)
        if cols:
            routed_u = got - n_shared
            tile, slot = routed_u // (SPLIT * TOPK), (routed_u % (SPLIT * TOPK)) // SPLIT
            hrow = torch.where(got < n_shared, R * TOPK, (tile // num_n) * TOPK + slot)
        else:
            tile, j = got // splits, got % splits
            slot = torch.clamp(j // SPLIT, max=TOPK)
            hrow = torch.where(slot == TOPK, R * TOPK + tile // num_n, (tile // num_n) * TOPK + slot)
        routed = hrow[hrow < R * TOPK]
        assert torch.equal(routed, routed.sort().values)   # pair by pair
        if shared:
            where = (hrow >= R * TOPK).nonzero().flatten()
            assert where.tolist() == (list(range(len(where))) if first else list(range(n - len(where), n)))


@pytest.mark.parametrize("sms", [256, 4])
def test_fp8_shared_expert_beside_fp4_experts_gets_twice_the_splits_within_one_wave(monkeypatch, kernel_calls, sms):
    """A sub-step is 64 bytes of a row in every format, so an FP8 shared expert has twice the sub-steps of FP4
    experts of the same shape. Where all units still fit in one wave (256 SMs here) it gets twice the K
    splits, so each of its units streams as many bytes as a routed one; with more waves (4 SMs) it keeps the
    routed split. An FP4 shared expert always keeps it. Results are the reference's either way."""
    monkeypatch.setattr(gemv_launch, "num_sms", lambda device: sms)
    E, k, D, I, T = 5, 2, 512, 256, 2
    for shared_fmt, ratio in (("fp8", 2 if sms == 256 else 1), ("nvfp4", 1)):
        w13, w2 = make_weight("nvfp4", I, D, (E, 2), 0.5), make_weight("nvfp4", D, I, (E,), 0.1)
        shared = make_weight(shared_fmt, I, D, (2,), 0.5), make_weight(shared_fmt, D, I, (), 0.1)
        x = torch.randn(T, D)
        w, ids = ref.route(torch.randn(T, E), torch.zeros(E), k, 1.5)
        kernel_calls.clear()
        y = dispatch.moe(x, ids, w, w13, w2, LIMIT, fallback=refuse, shared=shared, scratch=Scratch())
        assert rel_err(y, ref.moe(x, ids, w, w13, w2, LIMIT, shared=shared)) < 1e-6
        assert len(stages(kernel_calls)) == 2
        assert [a["kernel"] for a in kernel_calls] == (["pair"] if sms == 4 else ["gemv"] * 2)
        for a in stages(kernel_calls):
            assert a["SPLIT_S"] == ratio * a["SPLIT"], (shared_fmt, a["SPLIT"], a["SPLIT_S"])
            if ratio == 2:
                assert a["CHUNK_S"] == a["CHUNK"], (shared_fmt, a["CHUNK"], a["CHUNK_S"])


@pytest.mark.parametrize("fmt,shared_fmt,T", [("nvfp4", "fp8", 5), ("mxfp4", "nvfp4", 8)])
def test_shared_expert_as_token_columns(monkeypatch, kernel_calls, fmt, shared_fmt, T):
    """From SHARED_COLS_TOKENS tokens the shared expert is one row block whose MMA columns are the tokens
    (`COLS`): its gate/up units write h rows P .. P + T - 1 at once, and each down unit's partial counts into
    every token's output tile, the last arrival summing that tile. The result is the reference's, in two
    launches and in one (the same bits, the shared units first or last, the down units in either order),
    with forced K splits, and the semaphores and row flags re-arm. An FP8 shared expert gets twice the FP4
    experts' splits even over several waves (4 SMs here)."""
    monkeypatch.setattr(gemv_launch, "num_sms", lambda device: 4)
    E, k, D, I = 6, 2, 512, 256
    w13, w2 = make_weight(fmt, I, D, (E, 2), 0.5), make_weight(fmt, D, I, (E,), 0.1)
    shared = make_weight(shared_fmt, I, D, (2,), 0.5), make_weight(shared_fmt, D, I, (), 0.1)
    x = torch.randn(T, D) * 2
    w, ids = ref.route(torch.randn(T, E), torch.zeros(E), k, 1.5)
    want = ref.moe(x, ids, w, w13, w2, LIMIT, shared=shared)
    assert rel_err(dispatch.moe(x, ids, w, w13, w2, LIMIT, fallback=refuse, shared=shared, scratch=Scratch()),
                   want) < 1e-6
    assert kernel_calls and all(a["COLS"] for a in kernel_calls)
    if shared_fmt == "fp8" and fmt != "fp8":
        assert all(a["SPLIT_S"] == 2 * a["SPLIT"] and a["CHUNK_S"] == a["CHUNK"] for a in stages(kernel_calls))
    scratch, cfg = Scratch(), GemvConfig(split=2)
    runs = []
    for fused, x_ready, order in ((False, False, True), (True, False, True), (True, True, False), (False, True, True)):
        kernel_calls.clear()
        runs.append(pair_into_nan(x, w13, w2, ids, w, shared, cfg, scratch, x_ready=x_ready, fused=fused,
                                  pair_order=order))
        # gate/up has 4 K steps here, so the forced split of 2 holds
        assert kernel_calls[-1]["COLS"] and stages(kernel_calls)[0]["SPLIT"] == 2
    assert rel_err(runs[0][1], want) < 1e-6
    for h, out in runs[1:]:
        assert torch.equal(h, runs[0][0]) and torch.equal(out, runs[0][1])
    assert int(scratch.counters(x.device, 1).abs().sum()) == 0


@pytest.mark.parametrize("fmt,shared_fmt,T", [("nvfp4", "fp8", 12), ("mxfp4", "nvfp4", 16)])
def test_shared_expert_as_token_columns_of_several_row_blocks(kernel_calls, fmt, shared_fmt, T):
    """From 9 tokens the shared expert's token columns are row blocks of 8 tokens (`COLS_TOKENS`), in the same
    launches as the routed experts over expert blocks (`moe` at 9-16 tokens): block g's gate/up units write h rows
    P + 8 g .. P + 8 g + 7 and count into the flag of h row P + g, its down units wait there and count into its
    tokens' output tiles. Against the reference; in one launch and two, with the shared units first or last, the
    same bits, over expert blocks and without them (the pair's own order; the shared expert's h rows are the same
    bits either way); the semaphores re-arm."""
    E, k, D, I = 6, 2, 256, 128
    gen = torch.Generator().manual_seed(T)
    w13, w2 = make_weight(fmt, I, D, (E, 2), 0.5), make_weight(fmt, D, I, (E,), 0.1)
    shared = make_weight(shared_fmt, I, D, (2,), 0.5), make_weight(shared_fmt, D, I, (), 0.1)
    x = torch.randn(T, D, generator=gen) * 2
    w, ids = ref.route(torch.randn(T, E, generator=gen), torch.zeros(E), k, 1.5)
    want = ref.moe(x, ids, w, w13, w2, LIMIT, shared=shared)
    got = dispatch.moe(x, ids, w, w13, w2, LIMIT, fallback=refuse, shared=shared, scratch=Scratch())
    assert rel_err(got, want) < 1e-6
    assert kernel_calls and all(a["COLS"] and a["BLOCKS"] for a in kernel_calls)
    if T > 12:
        return   # (the launch modes once, at 12 tokens: two row blocks, the second part-filled)
    scratch, cfg = Scratch(), GemvConfig(split=2)
    table = tmoe.expert_blocks(ids, E)
    runs = []
    for fused, x_ready, blocks in ((False, False, table), (True, True, table), (True, False, None),
                                   (True, True, None), (False, False, None)):
        kernel_calls.clear()
        runs.append(pair_into_nan(x, w13, w2, ids, w, shared, cfg, scratch, x_ready=x_ready, fused=fused,
                                  blocks=blocks))
        assert kernel_calls[-1]["COLS"]
    P = T * k
    for first, rest in ((runs[0], runs[1:2]), (runs[2], runs[3:])):   # over expert blocks, then without
        assert rel_err(first[1], want) < 1e-6
        for h, out in rest:
            assert torch.equal(h, first[0]) and torch.equal(out, first[1])
        assert torch.equal(first[0][P:], runs[0][0][P:])
    assert int(scratch.counters(x.device, 1).abs().sum()) == 0


def test_shared_expert_keeps_a_row_block_per_token_below_four_tokens_and_without_the_pair(kernel_calls):
    """`shared_cols`: the per-token layout at 1-3 tokens (measured faster there), in dense launches and without
    a shared expert; the token columns from 4 to SHARED_COLS_MAX (16) tokens, 8 per row block."""
    s13 = make_weight("fp8", 128, 256, (2,))
    assert policy.SHARED_COLS_MAX == 16
    for rows, R, pairs, want in ((policy.ROWS_PAIR, 3 * 3, 3 * 2, False), (policy.ROWS_PAIR, 4 * 3, 4 * 2, True),
                                 (policy.ROWS_TOKEN, 16, 32, True), (policy.ROWS_TOKEN, 17, 34, False),
                                 (policy.ROWS_DENSE, 4, 0, False)):
        assert policy.shared_cols(rows, R, pairs, s13) == want, (rows, R)
        assert not policy.shared_cols(rows, R, pairs, None)
    E, k, D, I, T = 4, 2, 256, 128, 3
    w13, w2 = make_weight("nvfp4", I, D, (E, 2), 0.5), make_weight("nvfp4", D, I, (E,), 0.1)
    x = torch.randn(T, D)
    w, ids = ref.route(torch.randn(T, E), torch.zeros(E), k, 1.5)
    dispatch.moe(x, ids, w, w13, w2, LIMIT, fallback=refuse, shared=(s13, make_weight("fp8", D, I)),
             scratch=Scratch())
    assert kernel_calls and not any(a["COLS"] for a in kernel_calls)


def test_large_fp4_weights_stream_with_three_stages():
    """`default_config`: 3 pipeline stages for FP4 weights from THREE_STAGE_FP4_BYTES (V4-Pro wq_b / wo_b), with
    units of 128 rows from 9 rows; the plain config for smaller ones and for FP8 (measured: bench/RESULTS.md, runs
    51-53, 70 and 100-101)."""
    def default_config(w, rows=1):   # the dense GEMV's configuration for this weight
        return policy.gemv_config(w.fmt, w.nbytes(), rows)

    pro_wq_b = stored_weight("nvfp4", 65536, 1536)
    assert pro_wq_b.nbytes() >= policy.THREE_STAGE_FP4_BYTES
    assert default_config(pro_wq_b) == default_config(pro_wq_b, 8) == GemvConfig(num_stages=3)
    assert default_config(pro_wq_b, 9) == default_config(pro_wq_b, 16) == \
        GemvConfig(BN=128, maxnreg=0, num_stages=3)   # MMA N = 16: half the x traffic per weight byte
    assert default_config(stored_weight("nvfp4", 8192, 4096)) == GemvConfig()   # V4-Flash wq_b, 19 MB
    assert default_config(stored_weight("fp8", 65536, 1536)) == GemvConfig()


H200_SLOTS = 132 * 8   # SMs x resident CTAs of the default GEMV


@pytest.mark.parametrize("case,args,want", [
    # V4-Flash gate/up at 1 token: FP4 experts split 4, the FP8 shared expert 8: every unit 8 sub-steps
    ("flash up T=1", (policy.ROWS_PAIR, 7, 6, 6, 32, 32, 64), (1024, 8, 4, 8, 8, 8)),
    # V4-Pro gate/up: split 3 leaves 40-step shared units, balanced 3 / 6 needs two waves: 2 / 4 wins
    ("pro up T=1", (policy.ROWS_PAIR, 7, 6, 6, 48, 56, 112), (768, 4, 2, 28, 4, 28)),
    ("flash down T=1", (policy.ROWS_TOKEN, 1, 1, 6, 64, 16, 32), (1024, 16, 2, 8, 4, 8)),
    ("pro down T=1", (policy.ROWS_TOKEN, 1, 1, 6, 112, 24, 48), (896, 8, 1, 24, 2, 24)),
    # more than one wave: the shared expert keeps the routed split (balancing measured slower there)
    ("pro down T=4", (policy.ROWS_TOKEN, 4, 4, 6, 112, 24, 48), (3136, 7, 1, 24, 1, 48)),
    ("flash up T=8", (policy.ROWS_PAIR, 56, 48, 6, 32, 32, 64), (1792, 1, 1, 32, 1, 64)),
])
def test_split_plans_at_v4_shapes(case, args, want):
    """(units, partials, split, chunk, split_s, chunk_s) at V4 MoE shapes on an H200's 1056 slots."""
    assert policy.plan_splits(*args, H200_SLOTS) == want


def test_split_plans_with_the_shared_expert_as_token_columns():
    """`cols`: one shared row block for all tokens, and an FP8 shared expert always split twice as finely as the
    FP4 experts, so that its units are as long as theirs. V4-Flash gate/up at 8 tokens: 49 row blocks instead
    of 56 per N tile, so the routed split is 2 (3 waves of 16 steps) instead of 1 (2 waves of 32)."""
    assert policy.plan_splits(policy.ROWS_PAIR, 56, 48, 6, 32, 32, 64, H200_SLOTS, cols=True) == (3200, 4, 2, 16, 4, 16)
    assert policy.plan_splits(policy.ROWS_TOKEN, 4, 4, 6, 112, 24, 48, H200_SLOTS, cols=True) == \
        (2912, 8, 1, 24, 2, 24)
    # an FP4 shared expert keeps the routed split; a forced split is taken by both
    assert policy.plan_splits(policy.ROWS_TOKEN, 8, 8, 6, 64, 16, 16, H200_SLOTS, cols=True)[2:5:2] == (1, 1)
    assert policy.plan_splits(policy.ROWS_TOKEN, 8, 8, 6, 64, 16, 32, H200_SLOTS, forced=2, cols=True) == \
        (64 * (48 * 2 + 2), 14, 2, 8, 2, 16)


def test_split_plans_over_expert_blocks_count_the_table_rows():
    """`blocks`: the routed row blocks are the expert-block table's rows (`moe.block_rows`), in gate/up and down.
    V4-Flash NVFP4 at 64 tokens (gate/up 32 N tiles of 32 sub-steps, down 64 of 16): 272 rows for 384 pairs, so
    112 rows' units fewer, the split (1) the same; with twice the sub-steps gate/up would split in 2."""
    rows = tmoe.block_rows(384, 256)
    assert rows == 272
    assert policy.plan_splits(policy.ROWS_PAIR, 384, 384, 1, 32, 32, 0, H200_SLOTS) == (384 * 32, 1, 1, 32, 1, 2)
    assert policy.plan_splits(policy.ROWS_PAIR, 384, 384, 1, 32, 32, 0, H200_SLOTS, blocks=rows) == \
        (rows * 32, 1, 1, 32, 1, 2)
    assert policy.plan_splits(policy.ROWS_TOKEN, 64, 64, 6, 64, 16, 0, H200_SLOTS) == (384 * 64, 6, 1, 16, 1, 2)
    assert policy.plan_splits(policy.ROWS_TOKEN, 64, 64, 6, 64, 16, 0, H200_SLOTS, blocks=rows) == \
        (rows * 64, 6, 1, 16, 1, 2)
    assert policy.plan_splits(policy.ROWS_PAIR, 384, 384, 1, 32, 64, 0, H200_SLOTS, blocks=rows)[:3] == (rows * 64, 2, 2)


def test_split_plans_without_a_shared_expert_or_with_a_forced_split():
    assert policy.plan_splits(policy.ROWS_DENSE, 1, 1, 1, 1024, 12, 0, H200_SLOTS)[:4] == (1024, 1, 1, 12)
    assert policy.plan_splits(policy.ROWS_DENSE, 1, 1, 1, 64, 32, 0, H200_SLOTS)[2] == \
        policy.choose_split(64, 32, H200_SLOTS)
    # forced: the shared expert takes the same split, nothing is balanced
    assert policy.plan_splits(policy.ROWS_PAIR, 7, 6, 6, 32, 32, 64, H200_SLOTS, forced=2) == (448, 2, 2, 16, 2, 32)


def test_moe_with_an_unfit_shared_expert_adds_the_mlp(launches):
    """A shared expert the GEMV pair cannot take (9 tokens here: the sorted path) runs as the table's MLP."""
    E, k, D, I, T = 4, 2, 128, 128, 9
    w13, w2 = make_weight("nvfp4", I, D, (E, 2), 0.1), make_weight("nvfp4", D, I, (E,), 0.1)
    shared = make_weight("fp8", I, D, (2,), 0.1), make_weight("fp8", D, I, (), 0.1)
    x = torch.randn(T, D)
    w, ids = ref.route(torch.randn(T, E), torch.zeros(E), k, 1.5)
    ops = Ops.triton(strict=True)
    y = ops.moe(x, ids, w, w13, w2, LIMIT, shared=shared)
    assert rel_err(y, ref.moe(x, ids, w, w13, w2, LIMIT, shared=shared)) < 1e-6


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 (default mode): output byte i is byte sel[i] & 7 of {b, a}, or that byte's sign bit
    replicated when sel[i] & 8."""
    pool = (b << 32 | a).to_bytes(8, "little")
    out = 0
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = pool[nib & 7]
        out |= ((0xFF if byte & 0x80 else 0) if nib & 8 else byte) << (8 * i)
    return out


def _bf16_mul(a_bits: int, b_bits: int) -> int:
    """mul.rn.bf16x2 on one half, for products that are exact in bf16 (asserted)."""
    a, b = (torch.tensor([v << 16], dtype=torch.int64).to(torch.int32).view(torch.float32).double()
            for v in (a_bits, b_bits))
    p = (a * b).float()
    bits = int(p.view(torch.int32)) & 0xFFFFFFFF
    assert bits & 0xFFFF == 0 and float(p) == float(a * b)
    return bits >> 16


def test_nvfp4_group_multiplier_asm_is_exact_for_every_scale_byte():
    """The PTX sequence of `decode._group_multipliers` (prmt mode 8, << 4, mask, x 2^120, x 2^117), emulated on
    all 256 scale bytes in every byte position of a scale word: both halves hold bf16(e4m3 * 2^117) exactly,
    subnormals, zero and negative scales included (the NaN bytes 0x7F / 0xFF excepted)."""
    for v in range(256):
        if v & 0x7F == 0x7F:
            continue
        want = torch.tensor([v], dtype=torch.uint8).view(torch.float8_e4m3fn).double() * 2.0 ** 117
        want_bits = int(want.float().bfloat16().view(torch.int16)) & 0xFFFF
        assert float(want.float().bfloat16()) == float(want)
        for j in range(4):
            word = (v << (8 * j)) | (0x5A5A5A5A & ~(0xFF << (8 * j)))      # other bytes hold garbage
            sel = ((j | 8) * 0x1010 + j * 0x0101)
            t = (_prmt(word, 0, sel) << 4) & 0x87F087F0
            for half in (t & 0xFFFF, t >> 16):
                assert _bf16_mul(_bf16_mul(half, 0x7B80), 0x7A00) == want_bits, (v, j)


_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
_BF16_ONE = 0x3F803F80


def _run_ptx(asm: str, args: list[int]) -> list[int]:
    """Runs the PTX subset of the decoders (mov, shl, shr, xor, and, shf.l.wrap, prmt, mul.rn.bf16x2 on .b32
    registers) on Python ints; operands $0.. are outputs then `args`, as in tl.inline_asm_elementwise."""
    regs, outs = {}, {}
    nout = len(set(re.findall(r"[a-z0-9.]+\s+\$(\d+),", asm)))   # operands an instruction writes
    for i, v in enumerate(args):
        regs[f"${nout + i}"] = v

    def val(tok):
        return regs[tok] if tok in regs else int(tok, 0)

    for ins in (i.strip() for i in asm.replace("{", ";").replace("}", ";").split(";")):
        if not ins or ins.startswith(".reg"):
            continue
        op, rest = ins.split(None, 1)
        d, *src = [t.strip() for t in rest.split(",")]
        if op == "mov.b32":
            r = val(src[0])
        elif op == "shl.b32":
            r = (val(src[0]) << val(src[1])) & 0xFFFFFFFF
        elif op == "shr.b32":
            r = val(src[0]) >> val(src[1])
        elif op == "xor.b32":
            r = val(src[0]) ^ val(src[1])
        elif op == "shf.l.wrap.b32":   # the high word of {b, a} << n
            r = ((((val(src[1]) << 32) | val(src[0])) << (val(src[2]) & 31)) >> 32) & 0xFFFFFFFF
        elif op == "and.b32":
            r = val(src[0]) & val(src[1])
        elif op == "prmt.b32":
            r = _prmt(val(src[0]), val(src[1]), val(src[2]))
        elif op == "mul.rn.bf16x2":
            a, b = val(src[0]), val(src[1])
            r = _bf16_mul(a & 0xFFFF, b & 0xFFFF) | _bf16_mul(a >> 16, b >> 16) << 16
        else:
            raise AssertionError(f"unexpected PTX {ins!r}")
        (outs if d.startswith("$") else regs)[d] = r
    return [outs[f"${i}"] for i in range(nout)]


def _coded(word: int) -> int:
    """A plain FP4 word as tiled weights store it (`formats.wordcode`)."""
    signed = torch.tensor([word - (1 << 32) if word >> 31 else word], dtype=torch.int32)
    return int(code_words(signed)) & 0xFFFFFFFF


def _bf16_value(half: int) -> float:   # a bf16 bit pattern, exactly
    return float(torch.tensor([half << 16], dtype=torch.int64).to(torch.int32).view(torch.float32))


def _nibble_value(n: int) -> float:
    """e2m1 code n as the decoders leave it before their multiplier: e2m1 * 2^-126."""
    return (-1.0 if n & 8 else 1.0) * _E2M1[n & 7] * 2.0 ** -126


@pytest.mark.parametrize("coded", [False, True])
def test_fp4_decoder_asm_gives_each_byte_as_a_natural_order_pair(coded):
    """The PTX of `decode._fp4_decode` (`tiles.FP4_PTX`, or `FP4_CODED_PTX` on the coded words of tiled weights),
    run by `_run_ptx` on every byte value in every byte position of a word (other bytes hold garbage), multiplier
    1: output i holds byte i's low nibble in its low half and the high nibble in its high half, each
    e2m1 * 2^-126 as bf16."""
    asm = (tiles.FP4_CODED_PTX if coded else decode.FP4_PTX).value
    assert coded == ("prmt" not in asm)   # a coded pair is a shift and a LOP3
    for v in range(256):
        want = [_nibble_value(v & 15), _nibble_value(v >> 4)]
        for i in range(4):
            word = (v << (8 * i)) | (0xA5C3A5C3 & ~(0xFF << (8 * i)))
            t = _run_ptx(asm, [_coded(word) if coded else word, _BF16_ONE])[i]
            assert [_bf16_value(t & 0xFFFF), _bf16_value(t >> 16)] == want, (v, i)


@pytest.mark.parametrize("coded", [False, True])
def test_raw_fp4_decoder_asm_is_the_decoder_without_its_multiply(coded):
    """`FP4_PTX_RAW` / `FP4_CODED_PTX_RAW` (the group-column path) give the decoder's pairs with multiplier 1:
    e2m1 * 2^-126 as bf16, natural order, on every byte value in every byte position."""
    asm = (tiles.FP4_CODED_PTX_RAW if coded else decode.FP4_PTX_RAW).value
    assert "mul" not in asm
    for v in range(256):
        want = [_nibble_value(v & 15), _nibble_value(v >> 4)]
        for i in range(4):
            word = (v << (8 * i)) | (0xA5C3A5C3 & ~(0xFF << (8 * i)))
            t = _run_ptx(asm, [_coded(word) if coded else word])[i]
            assert [_bf16_value(t & 0xFFFF), _bf16_value(t >> 16)] == want, (v, i)


@pytest.mark.parametrize("coded", [False, True])
def test_tile_fp4_decoder_asm_splits_low_and_high_nibbles(coded):
    """The PTX of the fused tiles' `tiles._fp4_tile` (`FP4_HALVES_PTX` / `FP4_CODED_HALVES_PTX`), run the same way:
    outputs 0 / 1 hold the low nibbles of bytes (0, 1) / (2, 3), outputs 2 / 3 their high nibbles; each output
    pair takes its own multiplier operand."""
    asm = (tiles.FP4_CODED_HALVES_PTX if coded else tiles.FP4_HALVES_PTX).value
    for v in range(256):
        for i in range(4):
            word = (v << (8 * i)) | (0xA5C3A5C3 & ~(0xFF << (8 * i)))
            out = _run_ptx(asm, [_coded(word) if coded else word, _BF16_ONE, _BF16_ONE])
            nibbles = [(word >> (8 * j)) & 15 for j in range(4)] + [(word >> (8 * j + 4)) & 15 for j in range(4)]
            got = [_bf16_value(h) for t in out for h in (t & 0xFFFF, t >> 16)]
            assert got == [_nibble_value(n) for n in nibbles], (v, i)
    two = 0x40004000   # bf16 2.0 in both halves: $5 scales outputs 0 and 2, $6 outputs 1 and 3
    word = _coded(0x22222222) if coded else 0x22222222
    out = _run_ptx(asm, [word, two, _BF16_ONE])
    assert [_bf16_value(t & 0xFFFF) for t in out] == [2 * _nibble_value(2), _nibble_value(2)] * 2


def test_large_shared_expert_runs_beside_the_pair_from_four_tokens(monkeypatch, kernel_calls):
    """With the table's `moe.Side`, a shared expert of at least SIDE_SHARED_BYTES leaves the GEMV pair from
    SIDE_FROM_TOKENS tokens: the pair streams the routed experts alone and the shared expert runs as its own two
    launches (on CUDA on the side stream; here one after the other), their outputs added as `ref.moe` adds them.
    Below four tokens it stays in the pair."""
    E, k, D, I = 4, 2, 128, 128
    w13, w2 = make_weight("nvfp4", I, D, (E, 2), 0.1), make_weight("nvfp4", D, I, (E,), 0.1)
    shared = make_weight("fp8", I, D, (2,), 0.1), make_weight("fp8", D, I, (), 0.1)
    monkeypatch.setattr(policy, "SIDE_SHARED_BYTES", sum(w.nbytes() for w in shared))
    ops = Ops.triton(strict=True)
    for T, beside in ((3, False), (4, True)):
        kernel_calls.clear()
        x = torch.randn(T, D)
        w, ids = ref.route(torch.randn(T, E), torch.zeros(E), k, 1.5)
        y = ops.moe(x, ids, w, w13, w2, LIMIT, shared=shared)
        assert rel_err(y, ref.moe(x, ids, w, w13, w2, LIMIT, shared=shared)) < 1e-5
        moe_rows = [c for c in kernel_calls if c["ROWS"] != policy.ROWS_DENSE]
        dense = [c for c in kernel_calls if c["ROWS"] == policy.ROWS_DENSE]
        assert moe_rows and all(c["SHARED"] == (not beside) for c in moe_rows)   # the pair: one launch or two
        assert len(dense) == (2 if beside else 0)


def test_side_rule_keeps_small_shared_experts_in_the_pair_and_takes_every_one_it_cannot_carry():
    """`moe.beside_pair`: V4-Pro's FP8 shared expert (66 MB) beside the pair from four tokens, V4-Flash's (25 MB) in
    it; any shared expert the pair does not carry beside it."""
    def shared(n_bytes):   # only the byte count matters: two FP8 weights of 128 x n columns, one scale each
        cols = n_bytes // 2 // 128
        half = QWeight("fp8", torch.empty(128, cols, dtype=torch.float8_e4m3fn),
                       torch.ones(1, -(-cols // 128)))
        return half, half
    pro, flash = (sum(w.nbytes() for w in shared(n)) for n in (66_000_000, 25_100_000))
    assert [policy.beside_pair(t, pro, True) for t in (1, 3, 4, 16)] == [False, False, True, True]
    assert [policy.beside_pair(t, flash, True) for t in (1, 4, 16)] == [False] * 3
    assert policy.beside_pair(1, flash, False) and policy.beside_pair(32, flash, False)
