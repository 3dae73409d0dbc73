"""Sampler: its rules against an independent float64 NumPy model of vLLM's and a brute-force integer one, the Triton
kernel (under the interpreter) against the PyTorch reference (the same tokens on adversarial and random rows), the
frequencies of the draw, and the draw's (seed, counter) key, words and integer arithmetic against Python's. Statistics use fixed seeds and counters, so they
are deterministic."""
import dataclasses
import math

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsv4.kernels import ref
from dsv4.kernels.sampling import CANDIDATES, sample_tokens
from dsv4.runtime.params import SamplingParams
from dsv4.runtime.sampler import (GOLDEN_GAMMA, SAMPLE_MASS_BITS, SamplingBatch, row_keys, sample, sample_reference,
                                  sampling_probs)

P = np.array([0.40, 0.27, 0.17, 0.10, 0.06])   # a hand-made distribution over 5 tokens
LOGITS = np.log(P)
DYADIC = [math.log(8), math.log(4), math.log(2), 0.0, 0.0]   # softmax: exactly 1/2, 1/4, 1/8, 1/16, 1/16 in fp32


def reference(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """vLLM order: temperature, min-p, top-k (ties with the k-th kept), top-p (the low tail of mass <= 1 - p dropped,
    ties together, the top token always kept); returns the renormalised distribution."""
    x = np.asarray(logits, np.float64) / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    keep = p >= min_p * p.max()
    if top_k:
        kth = np.sort(np.where(keep, x, -np.inf))[::-1][top_k - 1]
        keep &= x >= kth
    if top_p < 1.0:
        q = np.where(keep, p, 0.0)
        q /= q.sum()
        tail = np.array([q[q <= v].sum() for v in q])
        keep &= ~((tail <= 1.0 - top_p) & (q < q.max()))
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def build(params, counters=None, vocab_size=5, **kwargs):
    counters = range(len(params)) if counters is None else counters
    return SamplingBatch.build(params, list(counters), vocab_size=vocab_size, **kwargs)


def draw_many(logits, params, n=20000, rows=1000):
    """Frequencies of n draws of one row, in batches of `rows` rows (counters 0..n-1 of the unseeded stream)."""
    x = torch.tensor(logits, dtype=torch.float32).expand(rows, -1).contiguous()
    tokens = [sample(x, build([params] * rows, range(start, start + rows), vocab_size=len(logits))).token_ids
              for start in range(0, n, rows)]
    return np.bincount(torch.cat(tokens).numpy(), minlength=len(logits)) / n


def assert_frequencies(freq, expected, n=20000):
    """Exact support, and Pearson's chi-square over the support below a bound that a correct sampler exceeds with
    probability < 1e-6 (chi-square with df <= 11 degrees of freedom)."""
    assert np.all((expected == 0) == (freq == 0)), (expected, freq)
    support = expected > 0
    chi2 = n * np.sum((freq[support] - expected[support]) ** 2 / expected[support])
    assert chi2 < 50.0, (chi2, expected, freq)


@pytest.mark.parametrize("kwargs", [
    {}, {"temperature": 0.5}, {"temperature": 2.0}, {"top_k": 2}, {"top_p": 0.8}, {"top_p": 0.5}, {"min_p": 0.4},
    {"temperature": 1.5, "top_k": 4, "top_p": 0.9, "min_p": 0.2},
])
def test_distribution_matches_reference(kwargs):
    assert_frequencies(draw_many(LOGITS, SamplingParams(**kwargs)), reference(LOGITS, **kwargs))


def test_frequencies_match_the_sorted_filters_distribution():
    logits = torch.randn(12, generator=torch.Generator().manual_seed(3)) * 2
    for params in [SamplingParams(temperature=0.7, top_k=6, top_p=0.9), SamplingParams(min_p=0.05, top_p=0.97),
                   SamplingParams(temperature=1.3, top_k=9, top_p=0.8, min_p=0.02)]:
        probs = sampling_probs(logits[None], build([params], vocab_size=12))[0].double().numpy()
        assert_frequencies(draw_many(logits.tolist(), params, n=10000), probs / probs.sum(), n=10000)


def test_reference_support_is_what_the_rules_say():
    # Guard the oracle itself on hand-checked cases.
    assert np.count_nonzero(reference(LOGITS, top_k=2)) == 2
    assert np.count_nonzero(reference(LOGITS, top_p=0.8)) == 3    # 0.06 + 0.10 <= 0.2 dropped, 0.17 kept
    assert np.count_nonzero(reference(LOGITS, min_p=0.4)) == 3    # >= 0.16 kept
    assert np.count_nonzero(reference([1.0, 2.0, 2.0, 2.0, 0.0], top_k=2)) == 3   # ties at the k-th value stay


def test_top_k_keeps_ties():
    freq = draw_many([1.0, 2.0, 2.0, 2.0, 0.0], SamplingParams(top_k=2), n=3000, rows=500)
    assert freq[0] == freq[4] == 0 and np.all(freq[1:4] > 0.25)


def test_tiny_top_p_keeps_the_top_token():
    # 1 - 1e-9 in mass units may be more than the fp32 probabilities weigh in all: the top token must be exempt.
    assert draw_many(LOGITS[::-1].copy(), SamplingParams(top_p=1e-9), n=500, rows=500)[4] == 1.0


# ------------------------------------------------------------------ the kernel == the reference; the kept sets
def kernel_tokens(x, batch, chunks=None, candidates=CANDIDATES):
    """The Triton kernels' tokens for a batch (under the interpreter on the CPU); chunks: programs a row's chunked
    passes split into (by default the plan's, one here for most batches: the interpreter counts 4 SMs); candidates:
    draws a top-p row checks before finding its kept set."""
    return sample_tokens(x, batch.inv_temperature, batch.greedy, batch.min_p, batch.top_k, batch.drop_share,
                         batch.seeds, batch.counters, chunks=chunks, candidates=candidates)


def reference_tokens(x, batch, candidates=CANDIDATES):
    return ref.sample_tokens(x, batch.inv_temperature, batch.greedy, batch.min_p, batch.top_k, batch.drop_share,
                             batch.seeds, batch.counters, candidates=candidates)


def kept_mask(x, batch):
    return ref.sample_kept(x, batch.inv_temperature, batch.min_p, batch.top_k, batch.drop_share)


def brute_force_kept(x, params):
    """The kept tokens of one row by the rules, token by token with Python integers (torch's exp for the masses)."""
    v = (x * (1.0 / torch.tensor(params.temperature, dtype=torch.float32))).tolist()
    xs = torch.tensor(v)
    e = torch.exp(xs - xs.max()).tolist()
    keep = [ei >= params.min_p for ei in e]
    if params.top_k:
        kth = sorted(v, reverse=True)[min(params.top_k, len(v)) - 1]
        keep = [k and vi >= kth for k, vi in zip(keep, v)]
    if params.top_p < 1.0:
        m = [math.ceil(ei * 2.0**SAMPLE_MASS_BITS) if k else 0 for ei, k in zip(e, keep)]
        total = sum(m)
        limit = total - math.floor(float(total) * (1.0 - params.top_p))
        keep = [k and sum(mj for vj, mj in zip(v, m) if vj > vi) < limit for k, vi in zip(keep, v)]
    return {i for i, k in enumerate(keep) if k}


ADVERSARIAL = [  # (logits, params, the tokens that must survive, or None where only the agreement is checked)
    ([1.0, 2.0, 2.0, 2.0, 0.0], SamplingParams(top_k=2), {1, 2, 3}),             # ties at the k-th value
    ([1.0, 2.0, 2.0, 2.0, 0.0], SamplingParams(top_k=1), {1, 2, 3}),
    ([3.0, 3.0, 3.0, 3.0, 3.0], SamplingParams(top_k=2, top_p=0.1), {0, 1, 2, 3, 4}),   # one tie group: all stay
    (DYADIC, SamplingParams(top_p=0.875), {0, 1, 2}),        # the two 1/16 weigh exactly 1 - top_p: dropped
    (DYADIC, SamplingParams(top_p=0.75), {0, 1}),            # 1/16 + 1/16 + 1/8 == 1 - top_p: dropped
    (DYADIC, SamplingParams(top_p=0.9375), {0, 1, 2, 3, 4}),  # the tie group straddles 1 - top_p: both stay
    (DYADIC, SamplingParams(top_p=0.5), {0}),
    (DYADIC, SamplingParams(top_k=4, top_p=0.875), {0, 1, 2}),         # top-k keeps the tie, top-p drops it
    (DYADIC, SamplingParams(top_k=3, top_p=0.86), {0, 1, 2}),   # 1/8 renormalised to 1/7 > 1 - top_p: stays
    (DYADIC, SamplingParams(min_p=0.25, top_k=3, top_p=0.8), {0, 1}),  # min-p, top-k and top-p together
    (DYADIC, SamplingParams(min_p=0.125, top_k=5, top_p=0.99), {0, 1, 2, 3, 4}),
    (DYADIC, SamplingParams(min_p=0.13), {0, 1, 2}),
    ([0.0, -math.inf, 5.0, -math.inf, 5.0], SamplingParams(top_k=3, top_p=0.6), {2, 4}),   # -inf logits
    ([-math.inf, -math.inf, 1.0, -math.inf, -math.inf], SamplingParams(top_k=2, top_p=0.3), {2}),   # one survivor
    ([0.0, 1.0, 2.0, 3.0, 30.0], SamplingParams(top_p=0.999), {4}),
    ([0.0, 1.0, 2.0, 3.0, 4.0], SamplingParams(temperature=1e-4, top_p=0.9), {4}),   # tiny temperature
    ([0.0, 1.0, 2.0, 3.0, 4.0], SamplingParams(temperature=1e4, top_p=0.9), {0, 1, 2, 3, 4}),   # huge: flat
    ([0.0, 1.0, 2.0, 3.0, 4.0], SamplingParams(temperature=1e4, top_k=2), {3, 4}),
    ([-0.0, 0.0, -1.0, 1.0, 0.0], SamplingParams(top_k=3), {0, 1, 3, 4}),   # -0.0 ties with 0.0
    ([-1e-40, -3e-39, 1e-40, 0.0, -2e-40], SamplingParams(top_k=2), {2, 3}),   # subnormals
    ([-200.0, 0.0, -150.0, -1.0, -300.0], SamplingParams(top_p=1.0, top_k=4), None),   # underflowing tokens
    ([1.0, 1.0, 1.0, 1.0, 1.0 + 1e-7], SamplingParams(top_p=0.3), None),
]


@pytest.mark.parametrize("all_filters", [False, True])
def test_adversarial_rows_keep_what_the_rules_say_and_the_kernel_draws_the_references_tokens(all_filters):
    x = torch.tensor([row for row, _, _ in ADVERSARIAL], dtype=torch.float32)
    for i, (row, params, survivors) in enumerate(ADVERSARIAL):
        kept = set(kept_mask(x[i:i + 1], build([params], all_filters=all_filters))[0].nonzero().flatten().tolist())
        assert kept == brute_force_kept(x[i], params), (row, params)
        if survivors is not None:
            assert kept == survivors, (row, params)
    for start in (0, 1000, 2000):                # three draws per row
        batch = build([p for _, p, _ in ADVERSARIAL], range(start, start + len(ADVERSARIAL)), all_filters=all_filters)
        assert torch.equal(kernel_tokens(x, batch), sample_reference(x, batch).token_ids)


@pytest.mark.parametrize("vocab", [7, 300, 5000])
def test_random_rows_the_kernel_draws_the_references_tokens(vocab):
    g = torch.Generator().manual_seed(vocab)
    rows = 64
    scale = torch.rand(rows, 1, generator=g) * 4 + 0.05
    x = (torch.randn(rows, vocab, generator=g) * 3 / scale).round() * scale     # coarse values: many ties
    x[:rows // 2] = torch.randn(rows // 2, vocab, generator=g) * 4             # half of them without ties
    x[torch.rand(rows, vocab, generator=g) < 0.05] = float("-inf")
    x[:, 0] = 0.0

    def pick(options):
        return options[int(torch.randint(len(options), (), generator=g))]

    params = [SamplingParams(temperature=pick([1e-4, 0.3, 0.8, 1.0, 1.7, 100.0]),
                             top_k=pick([0, 1, 2, 5, 40, vocab - 1, vocab, vocab + 3]),
                             top_p=pick([1.0, 0.999, 0.95, 0.9, 0.5, 0.1, 1e-6]),
                             min_p=pick([0.0, 0.0, 0.01, 0.3])) for _ in range(rows)]
    for all_filters in (False, True):
        batch = build(params, vocab_size=vocab, all_filters=all_filters)
        want = sample_reference(x, batch).token_ids
        assert torch.equal(kernel_tokens(x, batch), want)
        if vocab > 2048:                                  # the first pass over 3 chunks (2048, 2048, 904 logits)
            assert torch.equal(kernel_tokens(x, batch, chunks=3), want)
        kept = kept_mask(x, batch)
        assert bool(kept.gather(1, want[:, None]).all())                     # the token is one the filters keep
    for i in range(0, rows, 8):
        assert set(kept[i].nonzero().flatten().tolist()) == brute_force_kept(x[i], params[i]), params[i]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_logits_in_place_draw_what_their_fp32_copy_draws(dtype):
    """The model's bf16 / fp16 logits, a slice of wider rows as the engine passes them (padded vocabulary rows left
    out): the kernels read them in place and draw, token for token, what the fp32 copy draws, by the kernels and by
    the reference; logprobs come from the same values."""
    g = torch.Generator().manual_seed(7)
    rows, vocab = 24, 3000
    wide = (torch.randn(rows, vocab + 5, generator=g) * 3).to(dtype)
    wide[:, 11] = wide[:, 12]                                      # a tie
    x = wide[:, :vocab]
    params = [SamplingParams(temperature=[0.0, 0.7, 1.0, 1.3][i % 4], top_k=[0, 40][i % 2],
                             top_p=[1.0, 0.9, 0.5][i % 3], min_p=[0.0, 0.05][i % 2], logprobs=2 if i % 5 == 0 else None)
              for i in range(rows)]
    for all_filters in (False, True):
        batch = build(params, vocab_size=vocab, all_filters=all_filters)
        want = sample_reference(x.float(), batch)
        assert torch.equal(kernel_tokens(x, batch), want.token_ids)
        assert torch.equal(kernel_tokens(x, batch, chunks=2), want.token_ids)
        got = sample_reference(x, batch)
        assert torch.equal(got.token_ids, want.token_ids)
        assert torch.equal(got.logprobs, want.logprobs) and torch.equal(got.logprob_ids, want.logprob_ids)
        assert torch.equal(sampling_probs(x, batch), sampling_probs(x.float(), batch))


def test_flat_and_peaked_rows_give_the_references_tokens():
    """Rows whose draws fall in the dropped tail again and again (many near-equal logits, a small kept set: the
    bracket finds the kept set), and peaked rows (a spike of +40 in the first block, in the last)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(10, 5000, generator=g) * 1e-3
    x[3:6] = torch.linspace(0, 1, 5000)
    x[6:] = torch.randn(4, 5000, generator=g) * 2
    x[6:8, 10] = 40.0
    x[8:, 4990] = 40.0
    params = ([SamplingParams(top_p=p) for p in (0.01, 1e-4, 0.5)] * 2
              + [SamplingParams(), SamplingParams(top_p=0.9)] * 2)
    batch = build(params, range(100, 110), vocab_size=5000)
    want = sample_reference(x, batch).token_ids
    assert want[6:].tolist() == [10, 10, 4990, 4990]
    for chunks, candidates in ((1, CANDIDATES), (2, CANDIDATES), (3, CANDIDATES), (3, 1), (2, 2), (1, 8)):
        assert torch.equal(kernel_tokens(x, batch, chunks, candidates), reference_tokens(x, batch, candidates))


def test_top_k_and_min_p_rows_whose_draws_are_all_dropped():
    """Flat rows under top-k or min-p with top-p, most of whose draws top-p drops, so that they find their kept sets
    in their own programs: the reference's tokens, with top-k's radix passes counting key by key and by histogram
    (counted_keys 0)."""
    g = torch.Generator().manual_seed(17)
    x = torch.randn(12, 5000, generator=g) * 1e-3
    x[:, 7] = float("-inf")
    params = ([SamplingParams(top_k=k, top_p=p) for k in (5, 40, 3000) for p in (0.9, 0.3)]
              + [SamplingParams(min_p=m, top_p=p) for m in (0.9995, 0.998) for p in (0.9, 0.3)]
              + [SamplingParams(top_k=40, min_p=0.999, top_p=0.5), SamplingParams(top_k=40)])
    batch = build(params, range(200, 212), vocab_size=5000)
    for chunks, candidates, counted_keys in ((1, 1, 0), (3, 1, 5000), (3, CANDIDATES, 0), (3, CANDIDATES, 5000)):
        got = sample_tokens(x, batch.inv_temperature, batch.greedy, batch.min_p, batch.top_k, batch.drop_share,
                            batch.seeds, batch.counters, chunks=chunks, candidates=candidates,
                            counted_keys=counted_keys)
        assert torch.equal(got, reference_tokens(x, batch, candidates)), (chunks, candidates, counted_keys)


def test_a_dropped_draw_gives_way_to_the_next_and_the_last_to_the_kept_set():
    """A row of 5000 tokens: 4 heavy ones (the kept set under top-p 0.5) and a tail of equal light ones weighing
    about as much as the heavy ones together, so that a draw lands in the tail about half of the time. Over many
    counters the reference takes its first kept draw (the draws found here from the words with Python's integers),
    rows whose first, second, ... draw is the first kept one all occur, and so do rows whose draws all land in the
    tail (then the token is a heavy one); the kernel draws the reference's tokens over 1-3 chunks."""
    V = 5000
    x = torch.zeros(V)
    heavy = [17, 2100, 2101, 4999]
    x[heavy] = math.log(V / 4)
    rows = 160
    batch = build([SamplingParams(top_p=0.5)] * rows, range(rows), vocab_size=V)
    xs = x.expand(rows, -1).contiguous()
    masses = ref.sample_masses(xs, batch.inv_temperature, torch.ones(rows, V, dtype=torch.bool))
    words = ref.draw_words(row_keys(batch.seeds, batch.counters), CANDIDATES)
    want = reference_tokens(xs, batch)
    firsts = []
    for i in range(rows):
        m = masses[i].tolist()
        total = sum(m)
        draws = []
        for r in range(CANDIDATES):
            u = ((int(words[i, r]) & MASK64) * total) >> 64
            running, t = 0, 0
            while running + m[t] <= u:
                running += m[t]
                t += 1
            draws.append(t)
        kept = [r for r, t in enumerate(draws) if t in heavy]
        firsts.append(kept[0] if kept else CANDIDATES)
        if kept:
            assert want[i].item() == draws[kept[0]]
        else:
            assert want[i].item() in heavy
    assert set(firsts) == set(range(CANDIDATES + 1)), sorted(firsts)
    for chunks in (1, 2, 3):
        assert torch.equal(kernel_tokens(xs, batch, chunks), want)


def test_chunks_combine_to_the_lowest_id_of_equal_maxima():
    """The first pass split over chunks: a greedy row whose largest logit is in three chunks takes the lowest id (a
    top-k 1 row keeps the three tied tokens and draws one); a chunk of only -inf logits loses; a row of only -inf
    draws token 0, as the reference's argmax does."""
    x = torch.randn(4, 5000, generator=torch.Generator().manual_seed(3))
    x[:2, [4500, 2100, 3000]] = 9.0
    x[2, :4096] = float("-inf")
    x[3] = float("-inf")
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0)]
    batch = build(params, range(4), vocab_size=5000)
    want = sample_reference(x, batch).token_ids
    assert want[0] == 2100 and want[1] in (2100, 3000, 4500) and want[3] == 0
    for chunks in (1, 2, 3):
        assert torch.equal(kernel_tokens(x, batch, chunks), want)


def test_top_p_at_every_cumulative_boundary():
    """drop_share placed so that the budget falls on each tail's mass, one unit under and over it: the reference's kept
    sets are the brute-force ones; between the boundaries the kernel draws the reference's tokens."""
    x = (torch.randn(40, generator=torch.Generator().manual_seed(5)) * 2).round() / 2     # tie groups
    e = torch.exp(x - x.max())
    m = torch.ceil(e * 2.0**SAMPLE_MASS_BITS).long()
    total = int(m.sum())
    tails = sorted({int(m[x <= v].sum()) for v in x.tolist()})
    shares = [(t + d) / total for t in tails for d in (-1, 0, 1) if 0 <= t + d < total]
    params = [SamplingParams(top_p=1.0 - s) if s > 0 else SamplingParams() for s in shares]
    batch = dataclasses.replace(build(params, vocab_size=40, all_filters=True),
                                drop_share=torch.tensor(shares, dtype=torch.float64))
    xs = x.expand(len(shares), -1).contiguous()
    kept = kept_mask(xs, batch)
    for i, share in enumerate(shares):
        limit = total - math.floor(total * share)
        assert set(kept[i].nonzero().flatten().tolist()) == {j for j in range(40) if int(m[x > x[j]].sum()) < limit}
    survivors = kept.sum(dim=-1).tolist()
    assert survivors == sorted(survivors, reverse=True) and survivors[0] == 40 and survivors[-1] >= 1
    assert len(set(survivors)) == len(tails)    # each tie group goes at its own boundary, not a unit earlier
    # The kernel's exp may differ from torch's in the last bit, which moves a mass by up to 2^16 units: its tokens are
    # compared with budgets halfway between the tails (the boundaries themselves: the dyadic rows above).
    shares = [(a + b) / 2 / total for a, b in zip(tails, tails[1:])]
    batch = dataclasses.replace(build([SamplingParams(top_p=0.5)] * len(shares), range(len(shares)), vocab_size=40),
                                drop_share=torch.tensor(shares, dtype=torch.float64))
    xs = x.expand(len(shares), -1).contiguous()
    assert torch.equal(kernel_tokens(xs, batch), sample_reference(xs, batch).token_ids)


# ------------------------------------------------------------------ greedy
def test_greedy_is_argmax_with_lowest_id_on_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 1.0, 1.0], [0.0, 0.0, 0.0, 2.0]])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, seed=3),
              SamplingParams(temperature=1e-6)]
    for all_filters in (False, True):
        batch = build(params, vocab_size=4, all_filters=all_filters)
        assert sample(logits, batch).token_ids.tolist() == [1, 0, 3] == kernel_tokens(logits, batch).tolist()


def test_greedy_rows_in_a_sampled_batch():
    logits = torch.tensor([[0.0, 4.0, 1.0], [0.0, 0.0, 0.0]]).repeat(100, 1)
    params = [SamplingParams(temperature=0.0), SamplingParams()] * 100
    out = sample(logits, build(params, vocab_size=3)).token_ids
    assert out[0::2].eq(1).all() and len(set(out[1::2].tolist())) == 3


# ------------------------------------------------------------------ the draw
MASK64 = (1 << 64) - 1


def splitmix64(seed: int, counter: int) -> int:
    """The counter-th output of the splitmix64 stream that starts at mix(seed), as an int64: in Python."""
    def mix(z):
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    z = mix((mix(seed & MASK64) + counter * (GOLDEN_GAMMA & MASK64)) & MASK64)
    return z - (1 << 64) if z >= 1 << 63 else z


def test_row_keys_and_words_are_splitmix64():
    seeds = [0, 1, -1, 42, 2**63 - 1, -2**63, 123456789123]
    counters = [0, 1, 2, 7, 10**6, 2**40]
    s, c = torch.tensor([a for a in seeds for _ in counters]), torch.tensor(counters * len(seeds))
    keys = row_keys(s, c)
    assert keys.tolist() == [splitmix64(a, b) for a in seeds for b in counters]
    words = ref.draw_words(keys, 5)
    for row in (0, 5, 17, 41):
        key = keys[row].item() & MASK64
        for r in range(5):      # the stream continues: mix(key + (r + 1) gamma)
            z = (key + (r + 1) * (GOLDEN_GAMMA & MASK64)) & MASK64
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
            assert words[row, r].item() & MASK64 == z ^ (z >> 31)


def test_the_drawn_integer_and_token_are_pythons():
    """mulhi64 against Python's integers at the edges of its range, and draw_by_mass against a loop."""
    g = torch.Generator().manual_seed(4)
    w = [0, 1, 2**32 - 1, 2**32, 2**63, 2**64 - 1] + torch.randint(0, 2**62, (40,), generator=g).tolist()
    t = [1, 2, 2**32 - 1, 2**32 + 1, 2**40, 2**57 + 12345, 2**62 - 1] + \
        torch.randint(1, 2**61, (40,), generator=g).tolist()
    words = torch.tensor([a - (1 << 64) if a >= 1 << 63 else a for a in w for _ in t])
    totals = torch.tensor([b for _ in w for b in t])
    assert ref.mulhi64(words, totals).tolist() == [(a * b) >> 64 for a in w for b in t]
    masses = torch.tensor([[0, 3, 0, 5, 1], [7, 0, 0, 0, 0], [0, 0, 0, 0, 0]])
    words = torch.tensor([[0, -1, 1 << 62], [0, -1, 1 << 62], [0, -1, 5]])
    drawn = ref.draw_by_mass(masses, words)
    for row, (m, ws) in enumerate(zip(masses.tolist(), words.tolist())):
        for col, word in enumerate(ws):
            u = ((word & MASK64) * sum(m)) >> 64
            assert drawn[row, col].item() == next((i for i in range(5) if sum(m[:i + 1]) > u), 5)


def test_seed_gives_the_same_tokens_in_any_batch():
    V, steps = 1000, 6
    g = torch.Generator().manual_seed(7)
    mine = [torch.randn(V, generator=g) * 3 for _ in range(steps)]       # the seeded request's logits
    noise = [torch.randn(4, V, generator=g) * 3 for _ in range(steps)]   # its batch neighbours'
    target = SamplingParams(seed=42, top_k=50, top_p=0.95, temperature=0.8)
    neighbours = [SamplingParams(temperature=0.0), SamplingParams(seed=1, top_p=0.9), SamplingParams(min_p=0.1),
                  SamplingParams()]

    def tokens(params, others=(), row=0, **kwargs):
        rows = [*others[:row], params, *others[row:]]
        out = []
        for s in range(steps):   # step s: the seeded request's s-th draw; the others' counters are anything
            batch = build(rows, [s if p.seed is not None else 100 + 10 * s + i for i, p in enumerate(rows)],
                          vocab_size=V, unseeded_seed=9, **kwargs)
            x = torch.cat([noise[s][:row], mine[s][None], noise[s][row:len(others)]])
            out.append(sample(x, batch).token_ids[row].item())
        return out

    alone = tokens(target)
    assert len(set(alone)) > 1
    assert tokens(target, neighbours, row=2) == alone
    assert tokens(target, neighbours, row=4) == alone
    assert tokens(target, neighbours[:1], row=1, all_filters=True) == alone
    assert tokens(SamplingParams(seed=43, top_k=50, top_p=0.95, temperature=0.8)) != alone


def test_counter_picks_the_draw():
    x = torch.zeros(1, 50)
    draws = [sample(x, build([SamplingParams(seed=5)], [n], vocab_size=50)).token_ids.item() for n in range(40)]
    again = [sample(x, build([SamplingParams(seed=5)], [n], vocab_size=50)).token_ids.item() for n in range(40)]
    assert draws == again and len(set(draws)) > 20
    unseeded = sample(x.expand(40, -1), build([SamplingParams()] * 40, vocab_size=50, unseeded_seed=5)).token_ids
    assert unseeded.tolist() == draws          # rows without a seed: the batch's unseeded_seed and their counters


class OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


HOST_READS = {"aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.masked_select", "aten.unique",
              "aten._unique2", "aten.repeat_interleave"}


def test_sample_launches_the_same_ops_for_any_rows_and_reads_nothing_back():
    """The CPU path (the reference) with all_filters runs the same ops whatever the rows ask for and reads nothing back;
    the CUDA path is one `sample_tokens` call whose arguments are the batch's tensors."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 300, generator=g)
    compositions = [
        [SamplingParams()] * 4,
        [SamplingParams(temperature=0.0)] * 4,
        [SamplingParams(seed=3, top_k=5), SamplingParams(temperature=0.0), SamplingParams(top_p=0.9, min_p=0.1),
         SamplingParams(temperature=0.5, top_k=40, top_p=0.5, seed=-7)],
    ]
    traces = []
    for params in compositions:
        with OpRecorder() as rec:
            sample(x, build(params, vocab_size=300, all_filters=True))
        traces.append(rec.ops)
    assert traces[0] == traces[1] == traces[2]
    assert not HOST_READS & set(traces[0]), sorted(set(traces[0]))


# ------------------------------------------------------------------ logprobs
def test_raw_logprobs_and_ranks():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 50, generator=g) * 2
    params = [SamplingParams(temperature=1.3, top_k=10, logprobs=3) if i % 2 else SamplingParams(top_p=0.5)
              for i in range(64)]
    out = sample(logits, build(params, vocab_size=50))
    ref = logits.double().numpy()
    ref = ref - ref.max(1, keepdims=True) - np.log(np.exp(ref - ref.max(1, keepdims=True)).sum(1, keepdims=True))
    rows = out.host_logprobs(params)
    for i, (p, row) in enumerate(zip(params, rows)):
        if p.logprobs is None:
            assert row is None
            continue
        t = out.token_ids[i].item()
        top = np.argsort(-ref[i])[:3]
        assert set(row) == {t, *top.tolist()}
        for tid, lp in row.items():   # raw distribution: temperature and top-k do not change the values
            assert lp.logprob == pytest.approx(ref[i, tid], abs=1e-5)
            assert lp.rank == 1 + int((ref[i] > ref[i, tid]).sum())


def test_bad_inputs():
    batch = build([SamplingParams()], vocab_size=4)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        sample(torch.zeros(1, 4, dtype=torch.float64), batch)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        sample(torch.zeros(4), batch)
    with pytest.raises(ValueError, match="vocab"):
        sample(torch.zeros(1, 5), batch)
    with pytest.raises(ValueError, match="rows"):
        sample(torch.zeros(2, 4), batch)
    with pytest.raises(ValueError, match="counters"):
        SamplingBatch.build([SamplingParams(seed=1)], [], vocab_size=4)
