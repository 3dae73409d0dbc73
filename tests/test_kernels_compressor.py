"""The batched compressor, indexer and ring kernels (`kernels.compressor`, `kernels.indexer`,
`kernels.attention.write_ring`) under the interpreter against their references (`ref.compress`, `ref.index_picks`,
`ref.write_ring`, which loop over the sequences with the model's per-sequence math), over several consecutive ragged
steps so that what one step leaves in the state feeds the next: decode tokens and prefill chunks, windows closing
inside a chunk and across chunk boundaries, fresh sequences, entries spread over scrambled pages."""

import pytest
import torch

from dsv4.kernels import compressor, indexer, norm_rope, ref
from dsv4.kernels.attention import write_ring
from dsv4.kernels.steps import StepTokens
from dsv4.model.state import CompressorState

PAGE = 256                                   # positions per page (runtime.cache.PAGE_TOKENS)


def fresh_state(slots, pages, ratio, hd, g):
    overlap = ratio == 4
    width = hd * (2 if overlap else 1)
    prev = (torch.zeros(slots, ratio, hd), torch.full((slots, ratio, hd), float("-inf"))) if overlap else (None, None)
    return CompressorState(torch.randn(slots, ratio, width, generator=g), torch.randn(slots, ratio, width, generator=g),
                           *prev, torch.zeros(pages, PAGE // ratio, hd))


def clone(state):
    c = lambda t: None if t is None else t.clone()  # noqa: E731
    return CompressorState(c(state.open_kv), c(state.open_score), c(state.prev_kv), c(state.prev_score),
                           c(state.entries))


def ragged_steps(runs, tables, done):
    """One ragged step after another of `runs`: yields (step, its live (slot, tokens), its StepTokens, its token
    count), `done` (slot -> tokens so far) already advanced past it."""
    for step in range(max(len(lengths) for _, lengths in runs)):
        live = [(slot, lengths[step]) for slot, lengths in runs if step < len(lengths)]
        steps = StepTokens.build(tuple(s for s, _ in live), tuple(done[s] for s, _ in live),
                                 tuple(n for _, n in live), tuple(tables[s] for s, _ in live), "cpu")
        for s, n in live:
            done[s] += n
        yield step, live, steps, sum(n for _, n in live)


def compress_runs(runs, tables, mine, theirs, ratio, ape, weight, done, g):
    """`ragged_steps` of `runs` (random rows) through the kernel into `mine` and the reference into `theirs`; yields
    (step, its live (slot, tokens)) after each."""
    width = mine.open_kv.shape[-1]
    for step, live, steps, N in ragged_steps(runs, tables, done):
        kv, score = torch.randn(N, width, generator=g), torch.randn(N, width, generator=g) * 2
        angle = torch.rand(N, 8, generator=g) * 6
        compressor.compress(kv, score, ape, steps, mine, ratio, angle.cos(), angle.sin(), weight, 1e-6)
        ref.compress(kv, score, ape, steps, theirs, ratio, angle.cos(), angle.sin(), weight, 1e-6)
        yield step, live


def launch_grids(monkeypatch) -> list:
    """The grid of every `_compress_kernel` launch from now on, in order."""
    grids = []

    class Counting:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            grids.append(grid)
            return self.kernel[grid]

    monkeypatch.setattr(compressor, "_compress_kernel", Counting(compressor._compress_kernel))
    return grids


# Each sequence: (slot, lengths of its successive steps); a step takes every sequence that still has one.
RUNS = {
    4: [(1, (1, 1, 1, 1, 1, 2)), (3, (7, 1, 1, 5, 9)), (0, (13, 3, 1, 1, 6)), (2, (1, 6, 1, 1, 1, 1))],
    128: [(1, (130, 1, 1, 126, 2)), (0, (1, 1, 1, 1, 1)), (2, (255, 1, 1, 1, 300))],
}


@pytest.mark.parametrize("ratio, hd", [(4, 32), (4, 64), (128, 64)])
def test_compress_matches_the_reference_step_after_step(ratio, hd):
    g = torch.Generator().manual_seed(ratio + hd)
    runs = RUNS[ratio]
    slots, num_pages = 4, 16
    perm = torch.randperm(num_pages, generator=g).tolist()
    tables = {slot: tuple(perm[4 * i:4 * i + 4]) for i, (slot, _) in enumerate(runs)}
    mine = fresh_state(slots, num_pages, ratio, hd, g)
    theirs = clone(mine)
    weight = torch.rand(hd, generator=g) + 0.5
    ape = torch.randn(ratio, mine.open_kv.shape[-1], generator=g)
    done = {slot: 0 for slot, _ in runs}
    for step, live in compress_runs(runs, tables, mine, theirs, ratio, ape, weight, done, g):
        for name in ("entries", "prev_kv", "prev_score"):
            a, b = getattr(mine, name), getattr(theirs, name)
            if a is not None:
                assert torch.allclose(a, b, atol=2e-5, rtol=1e-5), (step, name)
        for s, _ in live:                        # the open rows that are live (row p mod ratio, p in the open window)
            rows = done[s] % ratio
            assert torch.equal(mine.open_kv[s, :rows], theirs.open_kv[s, :rows]), (step, s)
            assert torch.equal(mine.open_score[s, :rows], theirs.open_score[s, :rows]), (step, s)
    emitted = sum(done[s] // ratio for s in done)
    assert int((theirs.entries.abs().sum(-1) > 0).sum()) == emitted > 0


def test_decode_step_is_one_launch_and_a_longer_step_two(monkeypatch):
    """A step where no sequence can close two windows (tokens <= ratio) pools and keeps the state in one launch; the
    state of both kinds of step is the reference's (the step-after-step test above runs both kinds too)."""
    grids = launch_grids(monkeypatch)
    g = torch.Generator().manual_seed(7)
    ratio, hd = 4, 32
    tables = {0: (3, 1), 1: (0, 2)}
    mine = fresh_state(2, 4, ratio, hd, g)
    theirs = clone(mine)
    weight, ape = torch.rand(hd, generator=g) + 0.5, torch.randn(ratio, 2 * hd, generator=g)
    done = {0: 0, 1: 0}
    runs = [(0, (3, 1, 1)), (1, (9, 1, 1))]            # prefill, then two decode steps (slot 0 closes a window)
    for step, live in compress_runs(runs, tables, mine, theirs, ratio, ape, weight, done, g):
        assert len(grids) == (2 if step == 0 else step + 2), grids
        for name in ("entries", "prev_kv", "prev_score"):
            assert torch.allclose(getattr(mine, name), getattr(theirs, name), atol=2e-5, rtol=1e-5), (step, name)
    assert grids[2:] == [(2, 1, 1), (2, 1, 1)]


def test_two_compressors_step_in_the_same_launches(monkeypatch):
    """A CSA layer's two compressors (the attention's and the indexer's: other head dims, the indexer's keys in fp8)
    stepped together (`second`) leave the states that two reference steps leave, over prefill chunks and decode
    steps; a decode step is one launch of both (a third grid axis of 2)."""
    grids = launch_grids(monkeypatch)
    g = torch.Generator().manual_seed(11)
    ratio, runs, slots, num_pages = 4, RUNS[4], 4, 16
    perm = torch.randperm(num_pages, generator=g).tolist()
    tables = {slot: tuple(perm[4 * i:4 * i + 4]) for i, (slot, _) in enumerate(runs)}
    big = fresh_state(slots, num_pages, ratio, 64, g)
    small = fresh_state(slots, num_pages, ratio, 32, g)
    small = CompressorState(small.open_kv, small.open_score, small.prev_kv, small.prev_score,
                            torch.zeros(num_pages, PAGE // ratio, 32, dtype=torch.float8_e4m3fn),
                            torch.zeros(num_pages, PAGE // ratio))
    mine = (big, small)
    theirs = (clone(big), CompressorState(*(t.clone() for t in (small.open_kv, small.open_score, small.prev_kv,
                                                                small.prev_score, small.entries, small.entry_scales))))
    weights = (torch.rand(64, generator=g) + 0.5, torch.rand(32, generator=g) + 0.5)
    apes = (torch.randn(ratio, 128, generator=g), torch.randn(ratio, 64, generator=g))
    done = {slot: 0 for slot, _ in runs}
    for step, live, steps, N in ragged_steps(runs, tables, done):
        rows = [(torch.randn(N, w, generator=g), torch.randn(N, w, generator=g) * 2) for w in (128, 64)]
        angle = torch.rand(N, 8, generator=g) * 6
        before = len(grids)
        compressor.compress(*rows[0], apes[0], steps, mine[0], ratio, angle.cos(), angle.sin(), weights[0], 1e-6,
                            second=ref.SecondCompressor(*rows[1], apes[1], mine[1], weights[1], 1e-5))
        windows = (N - 1) // ratio + 1               # the default bound on the windows a sequence closes
        assert grids[before:] == ([(len(live), 1, 2)] if windows == 1 else
                                  [(len(live), windows, 2), (len(live), 1, 2)]), (step, grids)
        for i, eps in ((0, 1e-6), (1, 1e-5)):
            ref.compress(*rows[i], apes[i], steps, theirs[i], ratio, angle.cos(), angle.sin(), weights[i], eps)
        for i in (0, 1):
            for name in ("prev_kv", "prev_score"):
                assert torch.allclose(getattr(mine[i], name), getattr(theirs[i], name), atol=2e-5, rtol=1e-5)
            for s, _ in live:
                rows_open = done[s] % ratio
                assert torch.equal(mine[i].open_kv[s, :rows_open], theirs[i].open_kv[s, :rows_open]), (step, i)
        assert torch.allclose(mine[0].entries, theirs[0].entries, atol=2e-5, rtol=1e-5), step
        a = mine[1].entries.float() * mine[1].entry_scales[..., None]
        b = theirs[1].entries.float() * theirs[1].entry_scales[..., None]
        assert torch.allclose(a, b, atol=1e-6, rtol=0.07), step
    assert int((theirs[1].entry_scales > 0).sum()) == sum(done[s] // ratio for s in done) > 0
    with pytest.raises(ValueError, match="second compressor has 2 rows, the first 3"):
        compressor.compress(rows[0][0][:3], rows[0][1][:3], apes[0], steps, mine[0], ratio, angle.cos()[:3],
                            angle.sin()[:3], weights[0], 1e-6,
                            second=ref.SecondCompressor(rows[1][0][:2], rows[1][1][:2], apes[1], mine[1],
                                                        weights[1], 1e-5))


def test_index_picks_match_the_reference():
    g = torch.Generator().manual_seed(5)
    H, hd, E, topk = 3, 32, 8, 5
    starts, lengths = (0, 40, 3, 77), (9, 1, 30, 2)
    perm = torch.randperm(24, generator=g).tolist()
    pages = tuple(tuple(perm[6 * i:6 * i + 6]) for i in range(4))
    steps = StepTokens.build((0, 1, 2, 3), starts, lengths, pages, "cpu")
    N = sum(lengths)
    q, w = torch.randn(N, H, hd, generator=g), torch.randn(N, H, generator=g)
    entries = torch.randn(24, E, hd, generator=g)
    got = indexer.index_picks(q, w, entries, steps, topk, 4, hd ** -0.5, max_keys=(77 + 2) // 4)
    want = ref.index_picks(q, w, entries, steps, topk, 4, hd ** -0.5)
    assert got.shape == want.shape == (N, topk)
    assert torch.equal(got.sort(dim=1).values, want.sort(dim=1).values)
    # raw bf16 head weights, scaled in fp32 as they are read: the picks of the pre-scaled fp32 weights
    raw = (w * 3).bfloat16()
    scaled = indexer.index_picks(q, raw, entries, steps, topk, 4, hd ** -0.5, (77 + 2) // 4, weight_scale=0.5)
    halved = ref.index_picks(q, raw.float() * 0.5, entries, steps, topk, 4, hd ** -0.5)
    assert torch.equal(scaled.sort(dim=1).values, halved.sort(dim=1).values)
    assert torch.equal(ref.index_picks(q, raw, entries, steps, topk, 4, hd ** -0.5, weight_scale=0.5), halved)
    assert bool((want[0] == -1).all()) and int((want >= 0).sum(1).max()) == topk     # none visible / a full row
    # scores past each token's visible keys are -inf, and the bound may exceed every sequence's keys
    scores = indexer.index_scores(q, w, entries, steps, 4, hd ** -0.5, 40)
    visible = (steps.pos + 1) // 4
    assert bool(torch.isinf(scores[torch.arange(40)[None] >= visible[:, None]]).all())
    wide = indexer.index_picks(q, w, entries, steps, topk, 4, hd ** -0.5, max_keys=40)
    assert torch.equal(wide.sort(dim=1).values, want.sort(dim=1).values)


def test_index_scores_over_several_key_blocks():
    """Rows of 100 keys, two blocks of 64 (two programs a token): the scores of `ref.index_scores` over each sequence's
    visible keys, -inf past them."""
    g = torch.Generator().manual_seed(9)
    H, hd, E = 3, 32, 8
    starts, lengths = (398, 100, 0), (2, 1, 3)
    perm = torch.randperm(40, generator=g).tolist()
    pages = (tuple(perm[:13]), tuple(perm[13:26]), tuple(perm[26:39]))
    steps = StepTokens.build((0, 1, 2), starts, lengths, pages, "cpu")
    N = sum(lengths)
    q, w = torch.randn(N, H, hd, generator=g), torch.randn(N, H, generator=g)
    entries = torch.randn(40, E, hd, generator=g)
    got = indexer.index_scores(q, w, entries, steps, 4, hd ** -0.5, 100)
    for t in range(N):
        b, visible = int(steps.seq[t]), (int(steps.pos[t]) + 1) // 4
        keys = entries[list(pages[b])].flatten(0, 1)[:visible]
        want = ref.index_scores(q[None, t:t + 1], w[None, t:t + 1], keys[None], hd ** -0.5)[0, 0]
        assert torch.allclose(got[t, :visible], want, atol=1e-5, rtol=1e-5), t
        assert bool(torch.isinf(got[t, visible:]).all())


def test_write_ring_matches_the_reference():
    g = torch.Generator().manual_seed(6)
    W, D = 16, 32
    steps = StepTokens.build((2, 0, 1), (5, 0, 30), (20, 3, 1), (), "cpu")
    kv = torch.randn(24, D, generator=g)
    mine, theirs = torch.randn(3, W, D, generator=g), None
    theirs = mine.clone()
    write_ring(mine, kv, steps)
    ref.write_ring(theirs, kv, steps)
    assert torch.equal(mine, theirs)


def test_compress_reads_row_strided_views():
    """The step's rows may be column slices of one wider product (the fused projections): no copy needed, the same
    state as from contiguous rows."""
    g = torch.Generator().manual_seed(9)
    ratio, hd = 4, 32
    steps = StepTokens.build((0, 1), (3, 0), (2, 9), ((1, 0), (2, 3)), "cpu")
    a = fresh_state(2, 4, ratio, hd, g)
    b = clone(a)
    wide = torch.randn(11, 5 * hd, generator=g)
    kv, score = wide[:, :2 * hd], wide[:, 3 * hd:]
    ape = torch.randn(ratio, 2 * hd, generator=g)
    angle = torch.rand(11, 8, generator=g)
    compressor.compress(kv, score, ape, steps, a, ratio, angle.cos(), angle.sin(), torch.ones(hd), 1e-6)
    compressor.compress(kv.contiguous(), score.contiguous(), ape, steps, b, ratio, angle.cos(), angle.sin(),
                        torch.ones(hd), 1e-6)
    for name in ("entries", "prev_kv", "prev_score", "open_kv", "open_score"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize("chunks, tail", [(None, 0), (3, 0), (None, 256)])
@pytest.mark.parametrize("n, topk", [(1500, 64), (40, 64), (2048, 512), (3000, 1), (4100, 512), (9000, 512),
                                     (100, 5), (2049, 512)])
def test_topk_kernel_picks_the_largest_scores_lowest_ids_on_ties(n, topk, chunks, tail):
    """The indexer's top-k against a stable sort by (score descending, id): rows with negative and positive scores,
    exact ties across the threshold (ReLU zeros), -inf tails (keys not visible) and rows with fewer finite scores
    than topk; picks in ascending id order, -1 after them. The radix select on rows of one block and of several, in
    one program a row (rows up to 8192 wide by default) and over chunks of whole blocks (ties spanning chunks); one
    program a row with a tail block for the remainder past the whole blocks (ties spanning the two)."""
    g = torch.Generator().manual_seed(n + topk)
    rows = [torch.randn(n, generator=g),
            torch.randn(n, generator=g).clamp(min=0),                      # many exact zeros: ties at T
            torch.randint(-3, 3, (n,), generator=g).float(),               # few distinct values
            torch.randn(n, generator=g) * 1e-30,                           # tiny magnitudes, both signs
            torch.full((n,), float("-inf")),                               # nothing visible
            torch.cat((torch.randn(n // 3, generator=g), torch.full((n - n // 3,), float("-inf"))))]
    scores = torch.stack(rows)
    got = indexer.index_picks_of_scores(scores, topk, chunks=chunks, tail=tail, block=1024 if tail else None)
    assert got.dtype == torch.long and got.shape == (len(rows), topk)
    for row, picks in zip(scores, got):
        order = sorted(range(n), key=lambda j: (-row[j].item(), j))
        want = sorted(j for j in order[:topk] if row[j] > float("-inf"))
        assert picks[:len(want)].tolist() == want
        assert bool((picks[len(want):] == -1).all())


@pytest.mark.parametrize("n, chunks, tail", [(700, None, 0), (700, 4, 0), (9000, None, 0), (9000, 4, 0),
                                             (700, None, 64), (1100, None, 128)])
def test_topk_kernel_reads_each_row_only_to_its_tokens_visible_entries(n, chunks, tail):
    """With the tokens' positions, row t takes its picks among its first (pos + 1) // ratio scores only: finite
    values past them (which `index_scores` never leaves there) do not enter, so they prove the bound is applied;
    a position beyond the row's width reads the whole row; chunks past a row's visible scores take nothing."""
    g = torch.Generator().manual_seed(n)
    scores = torch.randn(4, n, generator=g)
    positions = torch.tensor([0, 4 * 300 + 2, 4 * (n // 2) - 1, 4 * n + 40], dtype=torch.int32)
    shape = dict(chunks=chunks, tail=tail, block=256 if tail else None)    # tails of rows of 300, 550, 1100 scores
    got = indexer.index_picks_of_scores(scores, 128, positions, 4, **shape)
    plain = indexer.index_picks_of_scores(scores, 128, **shape)
    for row, picks, p, every in zip(scores, got, positions.tolist(), plain):
        visible = min(n, (p + 1) // 4)
        order = sorted(range(visible), key=lambda j: (-row[j].item(), j))
        want = sorted(order[:128])
        assert picks[:len(want)].tolist() == want and bool((picks[len(want):] == -1).all())
    assert torch.equal(got[3], plain[3]) and not torch.equal(got[2], plain[2])


def test_fp8_key_codes_are_exact_powers_of_two_scales_without_saturation():
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(64, 128, generator=g) * torch.logspace(-30, 30, 64)[:, None]
    keys[0] = 0.0
    keys[1, :] = 448.0                                  # max / 448 = 1: the scale is exactly 1
    codes, scales = ref.fp8_key_codes(keys)
    assert codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    mantissa, _ = torch.frexp(scales)
    assert bool((mantissa == 0.5).all())                # powers of two
    assert scales[1] == 1.0 and scales[0] == 2.0**-126
    amax = keys.abs().amax(-1)
    assert bool((scales >= amax / 448).all()) and bool((scales[2:] < amax[2:] / 448 * 2).all())
    back = codes.float() * scales[:, None]
    assert bool(torch.isfinite(back).all()) and float(codes.float().abs().max()) <= 448
    assert bool(((back - keys).abs() <= keys.abs() * 2**-4 + scales[:, None] * 2**-9).all())   # e4m3 rounding


@pytest.mark.parametrize("hd", [32, 64])
def test_fp8_indexer_keys_match_the_reference(hd):
    """The compressor writing fp8 codes and scales (the indexer's cache in kv_cache_dtype "fp8-indexer") and the scoring
    kernel reading them, against the references, over the ratio-4 runs."""
    g = torch.Generator().manual_seed(hd)
    ratio, runs, slots, num_pages = 4, RUNS[4], 4, 16
    perm = torch.randperm(num_pages, generator=g).tolist()
    tables = {slot: tuple(perm[4 * i:4 * i + 4]) for i, (slot, _) in enumerate(runs)}
    base = fresh_state(slots, num_pages, ratio, hd, g)

    def fp8_state():
        return CompressorState(base.open_kv.clone(), base.open_score.clone(), base.prev_kv.clone(),
                               base.prev_score.clone(), torch.zeros(num_pages, PAGE // ratio, hd,
                                                                    dtype=torch.float8_e4m3fn),
                               torch.zeros(num_pages, PAGE // ratio))
    mine, theirs = fp8_state(), fp8_state()
    weight, ape = torch.rand(hd, generator=g) + 0.5, torch.randn(ratio, 2 * hd, generator=g)
    done = {slot: 0 for slot, _ in runs}
    for _ in compress_runs(runs, tables, mine, theirs, ratio, ape, weight, done, g):
        pass
    a, b = mine.entries.float() * mine.entry_scales[..., None], theirs.entries.float() * theirs.entry_scales[..., None]
    written = theirs.entry_scales > 0                  # 14 of the pool's 1024 entries: compare those, not the zeros
    assert int(written.sum()) == sum(done[s] // ratio for s in done) > 0
    assert torch.equal(mine.entry_scales > 0, written)
    assert float((mine.entry_scales[written] == theirs.entry_scales[written]).float().mean()) > 0.97
    assert float((mine.entries[written].float() == theirs.entries[written].float()).float().mean()) > 0.99  # ties apart
    assert torch.allclose(a, b, atol=1e-6, rtol=0.07)
    # the scoring kernel on fp8 keys picks what the reference picks from the same codes and scales
    H, topk = 3, 5
    steps = StepTokens.build(tuple(s for s, _ in runs), tuple(0 for _ in runs), tuple(done[s] for s, _ in runs),
                             tuple(tables[s] for s, _ in runs), "cpu")
    N = sum(done.values())
    q, w = torch.randn(N, H, hd, generator=g), torch.randn(N, H, generator=g)
    got = indexer.index_picks(q, w, theirs.entries, steps, topk, 4, hd ** -0.5, max_keys=64,
                              entry_scales=theirs.entry_scales)
    want = ref.index_picks(q, w, theirs.entries, steps, topk, 4, hd ** -0.5, entry_scales=theirs.entry_scales)
    assert torch.equal(got.sort(dim=1).values, want.sort(dim=1).values)
    dequant = theirs.entries.float() * theirs.entry_scales[..., None]
    assert torch.equal(want, ref.index_picks(q, w, dequant, steps, topk, 4, hd ** -0.5))


def test_e4m3_codes_round_as_torch_does():
    import triton
    import triton.language as tl

    @triton.jit
    def encode(v_ptr, out_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(v_ptr + i, mask=i < n, other=0.0)
        tl.store(out_ptr + i, norm_rope.e4m3_codes(v), mask=i < n)

    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].unique()                          # every e4m3 value, then the midpoints
    mids = (grid[1:] + grid[:-1]) / 2
    g = torch.Generator().manual_seed(0)
    values = torch.cat((grid, mids, mids.nextafter(grid[1:]), mids.nextafter(grid[:-1]), torch.tensor([-0.0]),
                        (torch.rand(4000, generator=g) * 2 - 1) * 448, torch.randn(1000, generator=g) * 2**-7))
    out = torch.empty(values.shape[0], dtype=torch.uint8)
    encode[(triton.cdiv(values.shape[0], 256),)](values, out, values.shape[0], 256)
    assert torch.equal(out, values.to(torch.float8_e4m3fn).view(torch.uint8))


def test_topk_takes_chunks_for_rows_wider_than_8192():
    """`indexer.topk_chunks`: one program a row up to TOPK_CHUNKED_KEYS scores (32K tokens of context), chunks of
    whole blocks beyond, as many as make two programs an SM (the picks: the tests above, with chunks given)."""
    assert indexer.topk_chunks(1, indexer.TOPK_CHUNKED_KEYS, 132) == 1
    assert indexer.topk_chunks(1, 32768, 132) == 32 and indexer.topk_chunks(64, 32768, 132) == 5
    assert indexer.topk_chunks(256, 16384, 132) == 2
