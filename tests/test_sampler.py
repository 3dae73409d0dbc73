"""Sampler against an independent float64 NumPy model of vLLM's rules; statistics use fixed seeds."""
import numpy as np
import pytest
import torch

from dsv4.runtime.params import SamplingParams
from dsv4.runtime.sampler import SamplingBatch, make_generator, sample

P = np.array([0.40, 0.27, 0.17, 0.10, 0.06])   # a hand-made distribution over 5 tokens
LOGITS = np.log(P)


def reference(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """vLLM order: temperature, min-p, top-k (ties with the k-th kept), top-p (mass <= 1 - p dropped from the
    bottom, top token always kept); returns the renormalised distribution."""
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
        order = np.argsort(q, kind="stable")
        below = np.cumsum(q[order]) <= 1.0 - top_p
        below[-1] = False
        keep[order[below]] = False
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def draw_many(logits, params, n=20000):
    batch = SamplingBatch.build([params] * n, [None] * n, vocab_size=len(logits))
    x = torch.tensor(logits, dtype=torch.float32).expand(n, -1).contiguous()
    return np.bincount(sample(x, batch).token_ids.numpy(), minlength=len(logits)) / n


@pytest.mark.parametrize("kwargs", [
    {}, {"temperature": 0.5}, {"temperature": 2.0}, {"top_k": 2}, {"top_p": 0.8}, {"top_p": 0.5}, {"min_p": 0.4},
    {"temperature": 1.5, "top_k": 4, "top_p": 0.9, "min_p": 0.2},
])
def test_distribution_matches_reference(kwargs):
    expected = reference(LOGITS, **kwargs)
    freq = draw_many(LOGITS, SamplingParams(**kwargs))
    assert np.all((expected == 0) == (freq == 0)), (expected, freq)     # exact support
    sigma = np.sqrt(expected * (1 - expected) / 20000)
    assert np.all(np.abs(freq - expected) <= 5 * sigma + 1e-9), (expected, freq)


def test_reference_support_is_what_the_rules_say():
    # Guard the oracle itself on hand-checked cases.
    assert np.count_nonzero(reference(LOGITS, top_k=2)) == 2
    assert np.count_nonzero(reference(LOGITS, top_p=0.8)) == 3    # 0.06 + 0.10 <= 0.2 dropped, 0.17 kept
    assert np.count_nonzero(reference(LOGITS, min_p=0.4)) == 3    # >= 0.16 kept
    assert np.count_nonzero(reference([1.0, 2.0, 2.0, 2.0, 0.0], top_k=2)) == 3   # ties at the k-th value stay


def test_top_k_keeps_ties():
    freq = draw_many([1.0, 2.0, 2.0, 2.0, 0.0], SamplingParams(top_k=2), n=3000)
    assert freq[0] == freq[4] == 0 and np.all(freq[1:4] > 0.25)


def test_tiny_top_p_keeps_the_top_token():
    # In fp32 1 - 1e-9 == 1, so every cumulative mass is "<= 1 - top_p": the top token must be exempt.
    assert draw_many(LOGITS[::-1].copy(), SamplingParams(top_p=1e-9), n=500)[4] == 1.0


def test_greedy_is_argmax_with_lowest_id_on_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 1.0, 1.0], [0.0, 0.0, 0.0, 2.0]])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, seed=3),
              SamplingParams(temperature=1e-6)]
    batch = SamplingBatch.build(params, [None, None, None], vocab_size=4)
    assert sample(logits, batch).token_ids.tolist() == [1, 0, 3]


def test_greedy_rows_in_a_sampled_batch():
    logits = torch.tensor([[0.0, 4.0, 1.0], [0.0, 0.0, 0.0]]).repeat(100, 1)
    params = [SamplingParams(temperature=0.0), SamplingParams()] * 100
    out = sample(logits, SamplingBatch.build(params, [None] * 200, vocab_size=3)).token_ids
    assert out[0::2].eq(1).all() and len(set(out[1::2].tolist())) == 3


def test_seed_gives_the_same_tokens_in_any_batch():
    V, steps = 1000, 6
    g = torch.Generator().manual_seed(7)
    mine = [torch.randn(V, generator=g) * 3 for _ in range(steps)]       # the seeded request's logits
    noise = [torch.randn(4, V, generator=g) * 3 for _ in range(steps)]   # its batch neighbours'
    target = SamplingParams(seed=42, top_k=50, temperature=0.8)
    neighbours = [SamplingParams(temperature=0.0), SamplingParams(seed=1, top_p=0.9), SamplingParams(min_p=0.1),
                  SamplingParams()]

    def tokens(params, others=(), row=0):
        rows = [*others[:row], params, *others[row:]]
        gens = [make_generator(p.seed) if p.seed is not None else None for p in rows]
        batch = SamplingBatch.build(rows, gens, vocab_size=V)
        out = []
        for s in range(steps):
            x = torch.cat([noise[s][:row], mine[s][None], noise[s][row:len(others)]])
            out.append(sample(x, batch).token_ids[row].item())
        return out

    alone = tokens(target)
    assert len(set(alone)) > 1
    assert tokens(target, neighbours, row=2) == alone    # also exercises the sort path (a top-p neighbour)
    assert tokens(target, neighbours[:1], row=1) == alone
    assert tokens(SamplingParams(seed=43, top_k=50, temperature=0.8)) != alone


def test_raw_logprobs_and_ranks():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 50, generator=g) * 2
    params = [SamplingParams(temperature=1.3, top_k=10, logprobs=3) if i % 2 else SamplingParams(top_p=0.5)
              for i in range(64)]
    out = sample(logits, SamplingBatch.build(params, [None] * 64, vocab_size=50))
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
    batch = SamplingBatch.build([SamplingParams()], [None], vocab_size=4)
    with pytest.raises(ValueError, match="float32"):
        sample(torch.zeros(1, 4, dtype=torch.bfloat16), batch)
    with pytest.raises(ValueError, match="vocab"):
        sample(torch.zeros(1, 5), batch)
    with pytest.raises(ValueError, match="rows"):
        sample(torch.zeros(2, 4), batch)
    with pytest.raises(ValueError, match="generator"):
        SamplingBatch.build([SamplingParams(seed=1)], [None], vocab_size=4)
