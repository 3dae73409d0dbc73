"""The cached attention kernel (`kernels.attention`) and its reference twin (`ref.sparse_attention`) under the
interpreter against per-sequence attention (`ref.attend` with the ring, window and entry masks the model builds), on
ragged steps: decode tokens and prefill chunks, starts before and after the ring fills, HCA (all visible entries) and
CSA (picks with -1 padding), entries spread over pages in any order."""

import pytest
import torch

from dsv4.kernels import ref
from dsv4.kernels.attention import AttentionPlan, sparse_attention
from dsv4.kernels.norm_rope import norm_rope
from dsv4.kernels.ref import attend, causal_entry_bias, picked_entry_bias, ring_positions, window_bias, write_ring
from dsv4.kernels.steps import StepTokens

W, D, H, E = 16, 32, 3, 8            # window, head_dim, heads, entries per page (ratio 4: 32 positions per page)


def make_step(seed, ratio, starts, lengths, pages_per_seq=6, num_pages=20, k=5, D=D):
    g = torch.Generator().manual_seed(seed)
    B, N = len(starts), sum(lengths)
    q = torch.randn(N, H, D, generator=g)
    kv = torch.randn(N, D, generator=g)
    ring = torch.randn(B + 1, W, D, generator=g)
    entries = torch.randn(num_pages, E, D, generator=g) if ratio else None
    perm = torch.randperm(num_pages, generator=g).tolist()
    pages = [tuple(perm[i * pages_per_seq:(i + 1) * pages_per_seq]) for i in range(B)]
    slots = tuple(range(1, B + 1))                                    # slot 0 unused
    steps = StepTokens.build(slots, starts, lengths, pages, "cpu")
    picks = None
    if ratio == 4:
        visible = (steps.pos + 1) // 4
        picks = torch.full((N, k), -1, dtype=torch.long)
        for t in range(N):
            n = int(visible[t])
            chosen = torch.randperm(n, generator=g)[:k] if n else torch.zeros(0, dtype=torch.long)
            picks[t, :len(chosen)] = chosen
    sinks = torch.randn(H, generator=g)
    return q, kv, ring, entries, picks, steps, pages, sinks


def reference(q, kv, ring, entries, picks, steps, pages, sinks, ratio, starts, lengths):
    out, off = [], 0
    for b, (start, n) in enumerate(zip(starts, lengths)):
        pos = torch.arange(start, start + n)
        keys = torch.cat((ring[b + 1], kv[off:off + n]))
        key_pos = torch.cat((ring_positions(start, W), pos))
        bias = window_bias(pos[None], key_pos[None], W)
        if ratio:
            per = -(-(start + n) // ratio)
            seq_entries = entries[list(pages[b])].flatten(0, 1)[:per]
            if ratio == 4:
                eb = picked_entry_bias(picks[off:off + n][None], per)
            else:
                eb = causal_entry_bias(pos[None], per, ratio)
            keys, bias = torch.cat((keys, seq_entries)), torch.cat((bias, eb), dim=-1)
        out.append(attend(q[None, off:off + n], keys[None], bias, sinks, D ** -0.5)[0])
        off += n
    return torch.cat(out)


CASES = [  # (ratio, starts, lengths)
    (0, (0, 5, 40), (3, 1, 1)),             # sliding only: fresh chunk, ring partly full, ring wrapped
    (128, (200, 0, 130), (1, 140, 5)),      # HCA: decode past two entries, a prefill chunk crossing 128
    (4, (7, 60, 0), (1, 25, 9)),            # CSA: picks with -1 padding, a chunk longer than the window
]


@pytest.mark.parametrize("ratio, starts, lengths", CASES)
@pytest.mark.parametrize("split", [0, None, 3, 9])       # one program per token; as planned; keys split in 4, 10
def test_matches_the_models_attention(ratio, starts, lengths, split):
    args = make_step(ratio + 1, ratio, starts, lengths)
    got = sparse_attention(*args[:5], args[5], ratio, args[7], D ** -0.5, split=split)
    want = reference(*args, ratio, starts, lengths)
    twin = ref.sparse_attention(*args[:5], args[5], ratio, args[7], D ** -0.5)   # the Ops reference table's
    assert got.shape == want.shape == twin.shape
    assert (got - want).abs().max() / want.abs().max() < 1e-5
    assert (twin - want).abs().max() / want.abs().max() < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", [0, 3, "wide"])
@pytest.mark.parametrize("ratio, starts, lengths", CASES[1:])
def test_queries_normalised_and_rotated_in_the_launch(ratio, starts, lengths, split, dtype):
    """rope and q_eps: the launch takes the queries as wq_b makes them, normalises (the unweighted RMS of each head)
    and rotates them, and rotates its output back (without a split in the attention launch, with one in the
    combine), as the two norm / rope launches around it did; a wide plan (64 heads a program) runs those two
    launches around it instead. The reference twin does the same with `ref.norm_rope`."""
    plan = AttentionPlan(64, 32, 8, 0) if split == "wide" else None
    split = None if plan else split
    q, kv, ring, entries, picks, steps, pages, sinks = make_step(ratio + 7, ratio, starts, lengths)
    g = torch.Generator().manual_seed(ratio)
    q = (q * 4).to(dtype)
    kv, ring = kv.to(dtype), ring.to(dtype)
    entries = entries.to(dtype) if entries is not None else None
    angle = torch.rand(q.shape[0], 4, generator=g) * 6
    rope = (angle.cos(), angle.sin())
    args = (kv, ring, entries, picks, steps, ratio, sinks, D ** -0.5)
    got = sparse_attention(q, *args, rope=rope, q_eps=1e-6, split=split, plan=plan)
    apart = norm_rope(sparse_attention(norm_rope(q, *rope, eps=1e-6), *args, split=split, plan=plan), *rope,
                      inverse=True)
    if plan:
        assert torch.equal(got, apart)
    twin = ref.sparse_attention(q, *args, rope=rope, q_eps=1e-6)
    want = ref.norm_rope(ref.sparse_attention(ref.norm_rope(q, *rope, eps=1e-6), *args), *rope, inverse=True)
    assert torch.equal(twin, want)
    assert got.dtype == dtype and got.shape == want.shape
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    assert float((got.float() - apart.float()).abs().max() / apart.float().abs().max()) < tol
    loose = 1e-5 if dtype == torch.float32 else 2 ** -5          # the reference rounds its products otherwise
    assert float((got.float() - want.float()).abs().max() / want.float().abs().max()) < loose
    rotated = sparse_attention(q, *args, rope=rope, split=split, plan=plan)     # the rotation alone
    rotated_apart = norm_rope(sparse_attention(norm_rope(q, *rope), *args, split=split, plan=plan), *rope,
                              inverse=True)
    assert float((rotated.float() - rotated_apart.float()).abs().max() / rotated_apart.float().abs().max()) < tol


@pytest.mark.parametrize("cos, sin", [(torch.ones(4, 17), torch.ones(4, 17)), (torch.ones(4, 8), torch.ones(4, 4)),
                                      (torch.ones(3, 8), torch.ones(3, 8))])
def test_rope_tables_that_do_not_fit_the_step_are_refused(cos, sin):
    """Angles for more channels than a head has, cos and sin of two shapes, or not a row per token: a clear error,
    not a launch reading past the tables."""
    args = make_step(3, 0, (0,), (4,))
    with pytest.raises(ValueError, match="rope tables"):
        sparse_attention(*args[:5], args[5], 0, args[7], D ** -0.5, rope=(cos, sin))


def test_the_key_split_takes_the_gpu_only_a_small_launch_leaves_idle():
    from dsv4.kernels.attention import attention_split
    assert attention_split(2, 640, 132) == 4            # a decode token of V4-Flash, CSA: the window + 512 picks
    assert attention_split(2, 168, 132) == 1            # few entries: two shares
    assert attention_split(128, 640, 132) == 1          # batch 64: within two programs per SM
    assert attention_split(132, 640, 132) == 0          # a full wave: no split
    assert attention_split(2, 128, 132) == 0            # sliding-only layers: the window in one share
    assert attention_split(2, 0, 132) == 0              # no keys


def test_plans_for_v4_flash_decode_steps():
    """plan_attention at V4-Flash's 64 heads of 512 on 132 SMs: (heads a program, keys a block, warps, split)."""
    from dsv4.kernels.attention import AttentionPlan, plan_attention
    assert plan_attention(1, 64, 512, 128, 512, False, 132) == AttentionPlan(16, 32, 4, 4)      # batch 1, CSA: split
    assert plan_attention(8, 64, 512, 128, 512, False, 132) == AttentionPlan(16, 32, 4, 4)      # 40 wide programs: few
    assert plan_attention(16, 64, 512, 128, 512, False, 132) == AttentionPlan(64, 32, 8, 4)     # 80 wide programs
    assert plan_attention(32, 64, 512, 128, 512, False, 132) == AttentionPlan(64, 32, 8, 3)     # within one wave: 128
    assert plan_attention(64, 64, 512, 128, 512, False, 132) == AttentionPlan(64, 32, 8, 1)     # ... 128
    assert plan_attention(128, 64, 512, 128, 512, False, 132) == AttentionPlan(64, 32, 8, 0)    # ... 128, no split
    assert plan_attention(32, 64, 512, 128, 64, False, 132) == AttentionPlan(16, 32, 4, 1)      # HCA at 8K: 64 wide
    assert plan_attention(64, 64, 512, 128, 64, False, 132) == AttentionPlan(64, 32, 8, 1)      # ... and 128
    assert plan_attention(256, 64, 512, 128, 512, False, 132) == AttentionPlan(64, 32, 8, 0)    # a full wave and more
    assert plan_attention(256, 64, 512, 128, 512, True, 132) == AttentionPlan(16, 16, 8, 0)     # packed fp8 entries
    assert plan_attention(1, 64, 512, 128, 512, True, 132) == AttentionPlan(16, 16, 8, 4)       # packed, batch 1: split
    assert plan_attention(256, 64, 512, 128, 0, False, 132) == AttentionPlan(64, 32, 8, 0)      # sliding only
    assert plan_attention(64, 64, 512, 128, 0, False, 132) == AttentionPlan(32, 64, 8, 0)       # ... 64 wide programs
    assert plan_attention(1, 64, 512, 128, 512, False, 132, split=0) == AttentionPlan(32, 64, 8, 0)   # split as given
    assert plan_attention(256, 64, 1024, 128, 512, False, 132) == AttentionPlan(16, 64, 8, 0)   # too wide a row for 64
    assert plan_attention(5, 3, 32, 16, 200, False, 132) == AttentionPlan(16, 32, 4, 1)     # toy: 16 heads at least


@pytest.mark.parametrize("ratio, starts, lengths", CASES)
@pytest.mark.parametrize("split", [0, 2])
def test_the_wide_plan_matches_the_models_attention(ratio, starts, lengths, split):
    """Every head of a token in one program (`WIDE_HEADS`, the plan of large decode batches), with and without a key
    split: the model's attention, as the default plans give it."""
    from dsv4.kernels.attention import WIDE_HEADS
    args = make_step(ratio + 7, ratio, starts, lengths)
    plan = AttentionPlan(WIDE_HEADS, 32, 8, split)
    got = sparse_attention(*args[:5], args[5], ratio, args[7], D ** -0.5, plan=plan)
    want = reference(*args, ratio, starts, lengths)
    assert got.shape == want.shape
    assert (got - want).abs().max() / want.abs().max() < 1e-5


def test_write_ring_keeps_each_sequences_last_window():
    starts, lengths = (3, 30, 0), (1, 20, 2)
    q, kv, ring, _, _, steps, _, _ = make_step(9, 0, starts, lengths)
    want = ring.clone()
    off = 0
    for b, (start, n) in enumerate(zip(starts, lengths)):
        for k in range(max(0, n - W), n):
            want[b + 1, (start + k) % W] = kv[off + k]
        off += n
    write_ring(ring, kv, steps)
    assert torch.equal(ring, want)


def test_the_model_runs_its_cached_attention_and_mhc_through_the_kernels(monkeypatch):
    """The tiny model on the Triton table (interpreted; the references of attention, compressor, indexer, ring and
    mHC made to fail, so the kernels really run) against the same model on the reference table: logits of a chunked
    prefill and decode steps that cross the window, CSA windows and the first HCA entry."""
    import dsv4
    import runtime_fixtures as rf
    from dsv4.kernels import Ops
    from dsv4.model.state import SeqBatch
    from dsv4.runtime.cache import KVCache

    def forbidden(*args, **kwargs):
        raise AssertionError("a kernel fell back to the reference")

    for name in ("sparse_attention", "write_ring", "compress", "index_picks", "norm_rope", "norm_ropes", "hc_pre",
                 "hc_post", "hc_head"):
        monkeypatch.setattr(ref, name, forbidden)
    kernel_model = dsv4.load(rf.variant("wide"), ops=Ops.triton())
    monkeypatch.undo()
    reference_model = dsv4.load(rf.variant("wide"))
    ids = torch.tensor([rf.prompt_ids(140, seed=2)])
    logits = []
    for model in (kernel_model, reference_model):
        cache, start, out = KVCache(model.config, 2, 4, torch.float32), 0, []
        with torch.inference_mode():
            for n in (100, 30, 1, 9):
                batch = SeqBatch((1,), (start,), (n,), ((3, 2),))
                streams = model(ids[:, start:start + n], batch.positions()[None], cache.layers, batch)
                out.append(model.head_logits(streams)[0])
                start += n
        logits.append(torch.cat(out))
    got, want = logits
    assert (got - want).abs().max() / want.abs().max() < 1e-4


@pytest.mark.parametrize("ratio", [0, 4, 128])
@pytest.mark.parametrize("split", [0, 2])
def test_a_decode_step_updates_the_rings_in_the_attention_launch(ratio, split):
    """update_ring on a decode step (one token per sequence; rings full, part full, empty): the same output as
    without it, and the rings `write_ring` leaves; the reference twin does the same."""
    starts, lengths = (150, 5, 0), (1, 1, 1)          # CSA: 37 of the 48 entries the pages hold
    q, kv, ring, entries, picks, steps, pages, sinks = make_step(40 + ratio, ratio, starts, lengths)
    how = dict(split=split)
    want = sparse_attention(q, kv, ring.clone(), entries, picks, steps, ratio, sinks, D ** -0.5, **how)
    want_ring = ring.clone()
    write_ring(want_ring, kv, steps)
    mine, theirs = ring.clone(), ring.clone()
    got = sparse_attention(q, kv, mine, entries, picks, steps, ratio, sinks, D ** -0.5, update_ring=True, **how)
    twin = ref.sparse_attention(q, kv, theirs, entries, picks, steps, ratio, sinks, D ** -0.5, update_ring=True)
    assert torch.equal(got, want) and torch.equal(mine, want_ring) and torch.equal(theirs, want_ring)
    assert (twin - want).abs().max() / want.abs().max() < 1e-5
    spaced = torch.randn(ring.shape[0], W + 3, D)[:, :W]                # slots further apart: written in place
    spaced.copy_(ring)
    got = sparse_attention(q, kv, spaced, entries, picks, steps, ratio, sinks, D ** -0.5, update_ring=True, **how)
    assert torch.equal(got, want) and torch.equal(spaced, want_ring)
    with pytest.raises(ValueError, match="rows must be contiguous"):
        sparse_attention(q, kv, torch.randn(ring.shape[0], W, 2 * D)[..., :D], entries, picks, steps, ratio, sinks,
                         D ** -0.5, update_ring=True)
