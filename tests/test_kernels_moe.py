"""Triton routing, sorting and MoE stages against `kernels.ref`, under TRITON_INTERPRET=1 at small shapes."""

import pytest
import torch

from dsv4.formats import QWeight
from dsv4.kernels import dispatch, gemm, ops_for, policy, ref
from dsv4.kernels import moe as tmoe
from dsv4.kernels.host import Scratch, device_info
from dsv4.kernels.policy import TileConfig
from kernel_util import refuse, rel_err, stacked_weight, strict_ops


LIMIT = 10.0


def stacked(fmt: str, lead: tuple, n: int, k: int, scale: float = 0.1) -> QWeight:
    """A stacked QWeight whose shards each carry their own scales (magnitudes differ per shard)."""
    return stacked_weight(fmt, n, k, lead, scale, spread="shard")


@pytest.fixture(scope="module")
def ops():
    return strict_ops()


@pytest.mark.parametrize("T", [1, 3, 16, 17, 70])        # past ROUTER_TOKENS, the tensor-core launch (K = 200:
@pytest.mark.parametrize("K", [1536, 200])                 # no multiple of its block, the reference's GEMM)
def test_router_logits_match_the_fp32_product(ops, T, K):
    """The router's logits from bf16 x and a bf16-valued fp32 weight (exact products, fp32 sums) against
    F.linear in fp64; an expert count no program size divides; x's dtype read as it is."""
    E = 25
    g = torch.Generator().manual_seed(T * K)
    x = torch.randn(T, K, generator=g).to(torch.bfloat16)
    w = (torch.randn(E, K, generator=g) * 0.05).to(torch.bfloat16).float()
    got = ops.router_logits(x, w)
    want = torch.nn.functional.linear(x.double(), w.double())
    assert got.dtype == torch.float32 and got.shape == (T, E)
    assert rel_err(got, want) < 1e-6
    assert torch.equal(ops.router_logits(x[None], w)[0], got)          # leading dims kept
    assert torch.equal(ops.router_logits(x, w.bfloat16()), got)         # a bf16 weight: the same products
    if T > tmoe.ROUTER_TOKENS and K % tmoe.ROUTER_BLOCK:
        assert torch.equal(got, ref.router_logits(x, w))


def test_router_logits_of_an_fp32_weight_on_the_tensor_cores(ops):
    """Past ROUTER_TOKENS an fp32 weight multiplies bf16 x as three exact bf16 pieces (`kernels.pieces`): the fp32
    product within fp32 rounding (a missing piece moves the logits by about 2^-16 of their size); fp32 x takes the
    reference's fp32 GEMM."""
    T, K, E = 40, 1536, 70
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, K, generator=g).to(torch.bfloat16)
    w = torch.randn(E, K, generator=g) * 0.05
    got = ops.router_logits(x, w)
    assert rel_err(got, torch.nn.functional.linear(x.double(), w.double())) < 1e-6
    assert torch.equal(ops.router_logits(x.float(), w), ref.router_logits(x.float(), w))


def test_route_biased_topk(ops):
    T, E, k = 7, 24, 4
    logits = torch.randn(T, E) * 3
    bias = torch.randn(E) * 0.5
    w, ids = ops.route(logits, bias, k, 1.5)
    rw, rids = ref.route(logits, bias, k, 1.5)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    order, rorder = ids.argsort(1), rids.argsort(1)
    assert torch.equal(ids.gather(1, order), rids.gather(1, rorder))
    torch.testing.assert_close(w.gather(1, order), rw.gather(1, rorder), rtol=1e-5, atol=1e-6)
    # the bias only selects: the weights are the unbiased scores, normalised, times the scaling
    assert torch.allclose(w.sum(1), torch.full((T,), 1.5), rtol=1e-5)


def test_route_ties_take_the_lower_expert_id_in_kernel_and_reference(ops):
    """Exactly equal scores + bias (bf16 gate logits and equal biases make them possible): kernel and reference pick
    the same experts in the same order, descending score and the lower id first; `torch.topk` leaves this open."""
    T, E, k = 6, 24, 4
    logits = torch.randint(-2, 2, (T, E)).float()        # four distinct values: ties everywhere, at the k-th too
    logits[0] = 0.5                                       # all equal: experts 0..k-1
    bias = torch.zeros(E)
    bias[1::2] = 0.25                                     # one more distinct value, shared by half the experts
    for b in (torch.zeros(E), bias):
        w, ids = ops.route(logits, b, k, 1.5)
        rw, rids = ref.route(logits, b, k, 1.5)
        assert torch.equal(ids, rids), (ids, rids)
        torch.testing.assert_close(w, rw, rtol=1e-6, atol=0)
        sel = torch.sqrt(torch.nn.functional.softplus(logits)) + b
        for t in range(T):   # selection order: descending score, ties by ascending id
            expect = sorted(range(E), key=lambda e: (-float(sel[t, e]), e))[:k]
            assert rids[t].tolist() == expect
        assert rids[0].tolist() == ([1, 3, 5, 7] if b.any() else [0, 1, 2, 3])   # the all-equal row


def test_route_hash_layer(ops):
    T, E, k, vocab = 5, 16, 3, 11
    logits = torch.randn(T, E)
    tid2eid = torch.stack([torch.randperm(E)[:k] for _ in range(vocab)])
    input_ids = torch.randint(0, vocab, (T,))
    w, ids = ops.route(logits, None, k, 2.5, tid2eid, input_ids)
    rw, rids = ref.route(logits, None, k, 2.5, tid2eid, input_ids)
    assert torch.equal(ids, rids)  # hash layers keep tid2eid's order
    torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6)


def test_route_extreme_logits_match_softplus(ops):
    logits = torch.tensor([[-40.0, -15.0, 0.0, 3.0, 25.0, -90.0, 19.0, 21.0]])
    w, ids = ops.route(logits, torch.zeros(8), 8, 1.0)
    rw, rids = ref.route(logits, torch.zeros(8), 8, 1.0)
    torch.testing.assert_close(w.gather(1, ids.argsort(1)), rw.gather(1, rids.argsort(1)), rtol=1e-5, atol=0)


@pytest.mark.parametrize("hashed", [False, True])
def test_route_held_experts_of_expert_parallel(ops, hashed):
    """Routing of one expert-parallel rank (experts 8..15 of 24): the kernel gives the reference's local ids and
    weights; picks held elsewhere weigh 0 and name the token's first held pick (local 0 where none is held)."""
    T, E, k, vocab, held = 9, 24, 4, 13, range(8, 16)
    logits = torch.randn(T, E) * 3
    tid2eid = torch.stack([torch.randperm(E)[:k] for _ in range(vocab)]) if hashed else None
    input_ids = torch.randint(0, vocab, (T,)) if hashed else None
    bias = None if hashed else torch.randn(E) * 0.5
    if not hashed:
        logits[0, :] = -5.0
        logits[0, :4] = 5.0                      # token 0 picks experts 0-3: none held here
    gw, gids = ref.route(logits, bias, k, 1.5, tid2eid, input_ids)
    w, ids = ops.route(logits, bias, k, 1.5, tid2eid, input_ids, held)
    rw, rids = ref.route(logits, bias, k, 1.5, tid2eid, input_ids, held)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6)
    for t in range(T):                           # the rule, from the global routing
        mine = [j for j in range(k) if int(gids[t, j]) in held]
        stand_in = int(gids[t, mine[0]]) - held.start if mine else 0
        for j in range(k):
            on = j in mine
            assert int(rids[t, j]) == (int(gids[t, j]) - held.start if on else stand_in)
            assert float(rw[t, j]) == (float(gw[t, j]) if on else 0.0)
    assert hashed or (rw[0] == 0).all() and (rids[0] == 0).all()


@pytest.mark.parametrize("path", ["pair", "tiles", "sorted"])
def test_moe_of_held_experts_is_the_routed_sum_of_those_experts(path):
    """An expert-parallel rank's MoE (its experts' stack, `held_picks` routing) equals the whole stack's reference
    MoE with the picks held elsewhere dropped (weight 0) on every path: the stand-in picks add nothing (the sorted
    path computes no row for them)."""
    E, k, D, I, held = 8, 3, 128, 128, range(4, 8)      # K multiples of 128: the GEMV pair takes them
    T = 11 if path == "sorted" else 5
    w13, w2 = stacked("nvfp4", (E, 2), I, D), stacked("nvfp4", (E,), D, I)
    x = torch.randn(T, D)
    logits = torch.randn(T, E)
    logits[0, :3] = 9.0                                   # token 0 routes to experts 0-2: none held
    w, ids = ref.route(logits, torch.zeros(E), k, 1.5)
    lw, lids = ref.held_picks(w, ids, held)
    assert (lw[0] == 0).all()
    part13, part2 = w13.index(slice(4, 8)), w2.index(slice(4, 8))
    whole = ref.moe(x, ids, torch.where((ids >= 4), w, 0.0), w13, w2, LIMIT)
    assert rel_err(ref.moe(x, lids, lw, part13, part2, LIMIT), whole) < 1e-6   # GEMMs of other row counts
    options = dict(pair=dict(decode="gemv"), tiles=dict(decode="tiles"),
                   sorted=dict(decode_tokens=0, block_tokens=None))[path]
    plan = policy.plan_moe(T, 4, k, dispatch._experts(part13, part2, x), None, device_info(x.device), **options)
    assert plan.routed.name == path.upper()
    got = dispatch.moe(x, lids, lw, part13, part2, LIMIT, fallback=refuse, **options)
    assert rel_err(got, whole) < 1e-6 and (got[0] == 0).all()


def test_align_leaves_pairs_of_weight_zero_out():
    T, k, E, BM = 13, 3, 8, 4
    ids = torch.randint(0, E, (T, k))
    w = torch.rand(T, k) + 0.1
    w[torch.rand(T, k) < 0.4] = 0.0
    w[2] = 0.0
    rows, blk_e, nblk, nb_max = tmoe.align(ids, E, BM, w)
    P, kept = T * k, (w.flatten() != 0)
    counts = torch.bincount(ids.flatten()[kept], minlength=E)
    assert int(nblk) == int(((counts + BM - 1) // BM).sum())
    used = rows[: int(nblk) * BM]
    assert sorted(used[used < P].tolist()) == kept.nonzero().flatten().tolist()   # each kept pair once, no other
    assert (rows[int(nblk) * BM:] == P).all()
    for b in range(int(nblk)):
        block = used[b * BM:(b + 1) * BM]
        assert (ids.flatten()[block[block < P].long()] == blk_e[b]).all() and (block < P).any()


def test_align_groups_pairs_by_expert():
    T, k, E, BM = 13, 3, 8, 4
    ids = torch.randint(0, E, (T, k))
    ids[0] = torch.tensor([5, 5, 5])  # an expert over several blocks
    rows, blk_e, nblk, nb_max = tmoe.align(ids, E, BM, torch.rand(T, k) + 0.1)     # no weight 0: every pair
    P = T * k
    counts = torch.bincount(ids.flatten(), minlength=E)
    assert int(nblk) == int(((counts + BM - 1) // BM).sum()) <= nb_max
    used = rows[: int(nblk) * BM]
    real = used[used < P]
    assert sorted(real.tolist()) == list(range(P))  # every pair exactly once
    assert (rows[int(nblk) * BM:] == P).all()
    flat = ids.flatten()
    for b in range(int(nblk)):
        block = used[b * BM:(b + 1) * BM]
        assert (flat[block[block < P].long()] == blk_e[b]).all()
        assert (block < P).any()


@pytest.mark.parametrize("fmt13,fmt2", [("nvfp4", "nvfp4"), ("mxfp4", "mxfp4"), ("fp8", "fp8")])
@pytest.mark.parametrize("T", [3, 11])  # 3: decode path (pairs); 11: sorted grouped path
def test_moe_matches_reference(ops, fmt13, fmt2, T):
    E, k, D, I = 6, 3, 64, 32 if fmt13 != "fp8" else 48
    w13 = stacked(fmt13, (E, 2), I, D)
    w2 = stacked(fmt2, (E,), D, I)
    x = torch.randn(T, D)
    w, ids = ref.route(torch.randn(T, E), torch.zeros(E), k, 1.5)
    y = ops.moe(x, ids, w, w13, w2, LIMIT)
    r = ref.moe(x, ids, w, w13, w2, LIMIT)
    assert y.shape == (T, D) and rel_err(y, r) < 1e-6


def _moe_fp64(x, ids, w, w13, w2, limit):
    """The routed experts in float64 on the exactly dequantized weights (the formats layer's `QWeight.dequantize`,
    not the kernel reference's helpers), token by token and slot by slot."""
    def dq(q, index):
        return q.index(*index).dequantize().double()

    out = torch.zeros(x.shape[0], w2.out_features, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e, xt = int(ids[t, j]), x[t].double()
            gate = (dq(w13, (e, 0)) @ xt).clamp(max=limit)
            up = (dq(w13, (e, 1)) @ xt).clamp(-limit, limit)
            out[t] += float(w[t, j]) * (dq(w2, (e,)) @ (torch.nn.functional.silu(gate) * up))
    return out


def test_moe_clamps_and_bf16(ops):
    E, k, D, I, T = 4, 2, 64, 32, 5
    w13 = stacked("nvfp4", (E, 2), I, D, scale=1.0)  # large pre-activations: both clamps engage
    w2 = stacked("nvfp4", (E,), D, I)
    x = torch.randn(T, D) * 3
    w, ids = ref.route(torch.randn(T, E), torch.zeros(E), k, 1.0)
    for limit in (LIMIT, 0.5):
        # fp32 against a float64 evaluation: kernel and reference each land ~1e-6 off here (up to 1.9e-6 over 20
        # seeds; the outputs cancel), so against each other they can differ by 2e-6 in fp32 rounding alone
        truth = _moe_fp64(x, ids, w, w13, w2, limit)
        assert rel_err(ops.moe(x, ids, w, w13, w2, limit), truth) < 4e-6
        assert rel_err(ref.moe(x, ids, w, w13, w2, limit), truth) < 4e-6
    xb = x.bfloat16()
    assert rel_err(ops.moe(xb, ids, w, w13, w2, LIMIT), ref.moe(xb, ids, w, w13, w2, LIMIT)) < 2e-2


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_shared_expert_mlp(ops, fmt):
    D, I = 64, 128 if fmt == "fp8" else 32
    w13 = stacked(fmt, (2,), I, D, scale=0.5)
    w2 = stacked(fmt, (), D, I)
    for T in (1, 9):
        x = torch.randn(T, D)
        assert rel_err(ops.mlp(x, w13, w2, LIMIT), ref.mlp(x, w13, w2, LIMIT)) < 1e-6


def test_moe_decode_tiles_path():
    """K = 64 does not suit the GEMV (K a multiple of 128), so decode runs the decode tiles: gate/up over the
    pairs, the routed down projection over the pairs, then the row sum."""
    E, k, D, I, T = 5, 3, 64, 32, 4
    w13 = stacked("mxfp4", (E, 2), I, D)
    w2 = stacked("nvfp4", (E,), D, I)
    x = torch.randn(T, D)
    w, ids = ref.route(torch.randn(T, E), torch.zeros(E), k, 2.5)
    r = ref.moe(x, ids, w, w13, w2, LIMIT)
    assert rel_err(dispatch.moe(x, ids, w, w13, w2, LIMIT, fallback=refuse), r) < 1e-6
    assert rel_err(dispatch.moe(x, ids, w, w13, w2, LIMIT, fallback=refuse, decode="tiles"), r) < 1e-6


def test_split_k_in_every_row_mode():
    """Split-K (one launch, semaphores) for the gated pair rows, the routed pair rows, the sorted rows and the
    shared expert's dense gated rows; the same Scratch twice, so the semaphores must re-arm."""

    E, k, D, I = 5, 2, 128, 64
    w13 = stacked("nvfp4", (E, 2), I, D)
    w2 = stacked("mxfp4", (E,), D, I)
    scratch = Scratch()
    split = (TileConfig(16, 32, 32, split_k=3), TileConfig(16, 32, 32, split_k=2))   # (up, down)
    for T in (3, 11):  # pair rows (decode) and sorted rows
        x = torch.randn(T, D)
        w, ids = ref.route(torch.randn(T, E), torch.zeros(E), k, 1.5)
        r = ref.moe(x, ids, w, w13, w2, LIMIT)
        for _ in range(2):
            y = dispatch.moe(x, ids, w, w13, w2, LIMIT, fallback=refuse, tiles=split, scratch=scratch)
            assert rel_err(y, r) < 1e-6
    s13, s2 = stacked("fp8", (2,), 256, D), stacked("fp8", (), D, 256)
    x = torch.randn(2, D)
    y = dispatch.mlp(x, s13, s2, LIMIT, fallback=refuse, linear=ops_for("cpu", "triton").linear,
                 config=TileConfig(16, 32, 32, split_k=4), scratch=scratch)
    assert rel_err(y, ref.mlp(x, s13, s2, LIMIT)) < 1e-6
    assert int(scratch.counters(x.device, 1).abs().sum()) == 0


def test_sorted_path_caps_the_fp4_gate_up_registers_at_16_rows(monkeypatch):
    """`sorted_configs`: FP4 gate/up tiles of 16 rows carry SORTED_UP_MAXNREG_FP4 (4 CTAs per SM instead of 2 on
    an H200), FP8 gate/up, 32-row tiles and the down tiles none; `gemm.launch` hands the cap to the compiler on a
    GPU (not to the interpreter, which has no registers) and the path still matches the reference."""
    cap = policy.SORTED_UP_MAXNREG_FP4
    E, k, D, I = 8, 2, 256, 128
    for fmt, pairs, want in (("nvfp4", 12 * E, cap), ("mxfp4", 16 * E, cap), ("fp8", 12 * E, 0),
                             ("nvfp4", 17 * E, 0)):
        up, down = policy.sorted_configs(pairs, E, I, D, D, fmt, fmt)
        assert (up.BM, up.maxnreg, down.maxnreg) == (16 if pairs <= 16 * E else 32, want, 0), (fmt, pairs)
    w13, w2 = stacked("nvfp4", (E, 2), I, D), stacked("mxfp4", (E,), D, I)
    T = 40
    x = torch.randn(T, D)
    w, ids = ref.route(torch.randn(T, E), torch.zeros(E), k, 2.5)
    got = dispatch.moe(x, ids, w, w13, w2, LIMIT, fallback=refuse, decode_tokens=0, block_tokens=None)
    assert rel_err(got, ref.moe(x, ids, w, w13, w2, LIMIT)) < 1e-6

    launched = []

    class Recording:   # the launch's keyword arguments, nothing run
        def __getitem__(self, grid):
            return lambda *args, **kw: launched.append(kw)

    monkeypatch.setattr(gemm, "_qgemm_kernel", Recording())
    monkeypatch.setattr(gemm, "interpreting", lambda: False)   # as on a GPU; these tensors stay on the CPU
    dispatch.moe(x, ids, w, w13, w2, LIMIT, fallback=refuse, decode_tokens=0, block_tokens=None)
    assert [kw.get("maxnreg") for kw in launched] == [cap, None]   # gate/up, then down
