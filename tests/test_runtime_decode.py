"""Cached decoding at the model level: the runtime's KVCache views + SeqBatch steps against the stateless prefill.

The stateless prefill (`model.logits`) is itself exact against transformers (test_load_transformers.py), so
here it is the reference. Tolerance: relative error (max |diff| / max |ref|) below 1e-4, as there; the paths
differ only in summation order (ring + chunk keys instead of the whole sequence). Sequences of 300 tokens
pass both HCA boundaries (128, 256) and the window (128); see runtime_fixtures for the two model variants
that keep indexer tie-breaking out of the comparison.
"""

from dataclasses import replace

import pytest
import torch

import dsv4
import runtime_fixtures as rf
from dsv4.kernels.ref import ring_positions
from dsv4.model.state import SeqBatch
from dsv4.runtime.cache import KVCache, cache_bytes, page_bytes
from oracle import rel_err

TOL = 1e-4
N = 300


@pytest.fixture(scope="module")
def models():
    return {name: dsv4.load(rf.variant(name)) for name in rf.VARIANTS}


@pytest.fixture(scope="module")
def ids():
    return torch.tensor([rf.prompt_ids(N, seed=1)])


def pages_of(slot: int, per_slot: int = 2) -> tuple[int, ...]:
    """The test's page table for a slot: its own pages, in an order unlike the positions' (pages are shared)."""
    return tuple(reversed(range(slot * per_slot, (slot + 1) * per_slot)))


def run_chunks(model, cache, ids, chunks, slot=0):
    """Feed one sequence through `cache` slot in the given chunk sizes; logits at every position."""
    out, start = [], 0
    with torch.inference_mode():
        for n in chunks:
            batch = SeqBatch((slot,), (start,), (n,), (pages_of(slot),))
            streams = model(ids[:, start:start + n], batch.positions()[None], cache.layers, batch)
            out.append(model.head_logits(streams)[0])
            start += n
    assert start == ids.shape[1]
    return torch.cat(out)


@pytest.mark.parametrize("name", ["wide", "sharp"])
def test_step_by_step_decoding_equals_prefill_at_every_position(name, models, ids, monkeypatch):
    model = models[name]
    gaps = rf.TopkGaps(monkeypatch)
    ref = model.logits(ids)[0]
    cache = KVCache(model.config, 3, 6, torch.float32)
    got = run_chunks(model, cache, ids, [1] * N, slot=2)
    err = rel_err(got, ref)
    print(f"\n  {name}: step-by-step vs prefill, max rel err {err:.2e}; smallest top-k gap {gaps.min():.1e}")
    assert err < TOL
    assert_no_tie_decides(name, gaps)


def assert_no_tie_decides(name, gaps):
    if name == "wide":          # index_topk > #entries: every visible entry is picked, nothing is chosen
        assert not gaps.gaps
    else:                       # index_topk 4: the picks are decided by clear margins, not by ties
        assert gaps.gaps and gaps.min() > 1e-5


# Chunk ends at 3 (mid CSA window), 8, 128 (HCA window and ring full), 129, 133, 263 (a chunk longer than
# the ring), 264, 300.
CHUNKS = [3, 5, 120, 1, 4, 130, 1, 36]


@pytest.mark.parametrize("name", ["wide", "sharp"])
def test_chunked_prefill_equals_one_shot(name, models, ids, monkeypatch):
    model = models[name]
    gaps = rf.TopkGaps(monkeypatch)
    ref = model.logits(ids)[0]
    got = run_chunks(model, KVCache(model.config, 1, 2, torch.float32), ids, CHUNKS)
    err = rel_err(got, ref)
    print(f"\n  {name}: chunks {CHUNKS} vs one shot, max rel err {err:.2e}")
    assert err < TOL
    assert_no_tie_decides(name, gaps)


def test_ragged_batch_equals_sequences_alone(models):
    """Three sequences in one cache, prefill chunks and decode tokens mixed in the same steps, one of them in
    a slot another sequence used before; each must match itself run alone."""
    model = models["wide"]
    seqs = [torch.tensor([rf.prompt_ids(n, seed=10 + i)]) for i, n in enumerate((260, 140, 70))]
    slots = (1, 3, 0)
    # Per step: tokens fed per sequence (0 = not in this step).
    steps = [(100, 140, 0), (150, 0, 30), (5, 0, 40)] + [(1, 0, 0)] * 5
    cache = KVCache(model.config, 4, 8, torch.float32)
    run_chunks(model, cache, torch.tensor([rf.prompt_ids(50, seed=99)]), [50], slot=0)   # a previous tenant
    cache.reset(0)
    starts, outs = [0, 0, 0], [[], [], []]
    with torch.inference_mode():
        for step in steps:
            members = [i for i, n in enumerate(step) if n]
            batch = SeqBatch(tuple(slots[i] for i in members), tuple(starts[i] for i in members),
                             tuple(step[i] for i in members), tuple(pages_of(slots[i]) for i in members))
            ids = torch.cat([seqs[i][:, starts[i]:starts[i] + step[i]] for i in members], dim=1)
            logits = model.head_logits(model(ids, batch.positions()[None], cache.layers, batch))[0]
            for i, off in zip(members, batch.offsets):
                outs[i].append(logits[off:off + step[i]])
                starts[i] += step[i]
    assert starts == [260, 140, 70]
    for i, seq in enumerate(seqs):
        alone = model.logits(seq)[0]
        err = rel_err(torch.cat(outs[i]), alone)
        print(f"\n  sequence of {seq.shape[1]} in a ragged batch vs alone: max rel err {err:.2e}")
        assert err < TOL


class LateStream:
    """`Ops.beside` as a second stream that runs its work as late as it may: in the order started, at the first
    join that needs it. A result is read beside (`Pending.value`) only by later work, which runs after it."""

    def __init__(self):
        self.queue, self.started, self.table = [], 0, None

    def __call__(self, x, work):
        self.started += 1
        done = {}
        self.queue.append((work, done))

        def join():
            while "out" not in done:
                w, d = self.queue.pop(0)
                d["out"] = w(self.table)
            return done["out"]
        return _Beside(done), join


class _Beside:
    """A LateStream work's result as later work reads it (its work has run by then)."""

    def __init__(self, done):
        self.done = done

    def __getitem__(self, i):
        return self.done["out"][i]


@pytest.mark.parametrize("fuse_queries", [False, True])
def test_work_started_beside_joins_before_its_results_are_read(monkeypatch, fuse_queries):
    """A cached step's compressors and (where the indexer's query product is its own) picks start beside the query
    products (`Ops.start`, a second stream on CUDA). Run as late as that stream may (at the join), they give the
    logits they give run at once, bit for bit, through prefill chunks and decode steps across CSA and HCA window
    closes: nothing reads their states or results before the join, and nothing they read changes before it."""
    model = dsv4.load(rf.variant("wide"))
    layers = [layer.attn for layer in model.layers if layer.attn.compressor is not None]
    csa = sum(1 for attn in layers if attn.indexer is not None)
    assert csa and all(attn.fuse_projections_() for attn in layers)
    if fuse_queries:
        assert all(attn.fuse_queries_() for attn in layers if attn.indexer is not None)
    ids = torch.tensor([rf.prompt_ids(140, seed=3)])
    chunks = [7, 1, 1, 1, 2, 110] + [1] * 18                          # decode steps across 124, 128, 132, ...
    at_once = run_chunks(model, KVCache(model.config, 1, 2, torch.float32), ids, chunks)
    late = LateStream()
    late.table = replace(layers[0].ops, beside=late)
    for attn in layers:
        monkeypatch.setattr(attn, "ops", late.table)
    got = run_chunks(model, KVCache(model.config, 1, 2, torch.float32), ids, chunks)
    assert late.started == (len(layers) + (0 if fuse_queries else csa)) * len(chunks) and not late.queue
    assert torch.equal(got, at_once)


def test_ring_positions():
    for start in (0, 1, 5, 127, 128, 129, 300):
        want = [max((p for p in range(start) if p % 128 == r), default=-1) for r in range(128)]
        assert ring_positions(start, 128).tolist() == want


def test_cache_layout_and_capacity(models):
    cfg = models["wide"].config
    cache = KVCache(cfg, 2, 3, torch.float32)
    csa, hca = cache.layers[2], cache.layers[3]
    assert cache.layers[0].compressor is None and hca.indexer is None
    assert csa.compressor.entries.shape == (3, 64, cfg.head_dim) and csa.indexer.entries.shape == (3, 64, 32)
    assert hca.compressor.entries.shape == (3, 2, cfg.head_dim) and hca.compressor.open_kv.shape == (2, 128, 64)
    assert csa.compressor.open_score.dtype == torch.float32 and bool((csa.compressor.prev_score == -torch.inf).all())
    assert cache.nbytes == cache_bytes(cfg, 2, 3, torch.float32) == sum(
        p.numel() * p.element_size() for p in cache.pools.values())
    assert cache_bytes(cfg, 2, 3, torch.float32) - cache_bytes(cfg, 2, 2, torch.float32) == page_bytes(cfg, torch.float32)
    # Views, not copies: what the model writes lands in the runtime's pools.
    assert csa.window.untyped_storage().data_ptr() == cache.pools["window"].untyped_storage().data_ptr()
    with pytest.raises(ValueError, match="the sequence's 2 cache pages hold 128 entries of ratio 4"):
        run_chunks(models["wide"], cache, torch.tensor([rf.prompt_ids(520, seed=3)]), [520])


def test_entries_land_in_the_sequences_own_pages(models):
    """A sequence writes entries only into its page table's pages, entry j at row j mod E of page j // E."""
    model = models["wide"]
    cache = KVCache(model.config, 2, 5, torch.float32)
    run_chunks(model, cache, torch.tensor([rf.prompt_ids(300, seed=4)]), [300], slot=1)   # page table (3, 2)
    csa, hca = cache.layers[2].compressor.entries, cache.layers[3].compressor.entries
    used = lambda pool: {p for p in range(5) if pool[p].abs().sum() > 0}  # noqa: E731
    assert used(csa) == {3, 2} and used(hca) == {3}
    # 75 CSA entries: 64 on the table's first page, 11 on its second; 2 HCA entries (the third is still open)
    assert (csa[2, :11].abs().sum(-1) > 0).all() and csa[2, 11:].abs().sum() == 0
    assert (hca[3].abs().sum(-1) > 0).all()
