"""Batched token sampling with per-row parameters, in vLLM's order and semantics, without a sort or a host sync.

For logits [B, V] fp32 (one row per sequence, V = the tokenizer's vocab; slice off padded embedding rows
first), each row is processed as vLLM's V1 sampler does:

1. logprobs, when requested, are the *raw* model distribution log_softmax(logits), before temperature or
   any truncation (vLLM's default logprobs_mode "raw_logprobs"), with the row's top-n by `topk`;
2. greedy rows (temperature < 1e-5) take argmax(logits), ties to the lowest id;
3. other rows: logits / temperature, then min-p (drop tokens with p < min_p * p_max), then top-k (keep the k
   largest values and every token tied with the k-th), then top-p (drop the low tail whose mass is <= 1 - top_p,
   never the most likely token), then one draw from what is left.

Top-p counts mass exactly, so that the tokens it keeps do not depend on the order of a sum: a probability p
weighs ceil(p * 2^MASS_BITS) units (a token of nonzero probability at least one), and a row drops every token
of probability <= v for the largest v whose tokens (those of probability <= v) weigh at most
floor((1 - top_p) * 2^MASS_BITS) units. Tokens of equal probability are dropped or kept together (vLLM's sort
may split such a group at the boundary), and the tokens of the largest probability always stay.

`sample` finds the top-k and top-p thresholds by a radix search over the values' 32-bit keys (`first_kept_key`):
three rounds, each a per-row histogram of the keys that share the prefix found so far by their next 11 bits,
weighted by 1 (top-k) or by the mass (top-p), whose cumulative sum gives the next digit of the threshold.
`sample_reference` finds them by sorting each row. Both keep the same tokens and draw them the same way, so
they return the same token ids.

The draw is inverse-transform sampling with one uniform number per row: u = `uniform(seed, counter)`, a
counter-based hash (splitmix64's mixer in int64 ops), and the token is the first whose cumulative probability
(fp64) exceeds u times the row's total. A request with a seed draws its n-th token with (its seed, n), so its
tokens depend neither on the other rows nor on its own row's position, and are the same in every run; rows
without a seed draw with the caller's `unseeded_seed` and distinct counters the caller gives them. Nothing in
`sample` reads a device value back to the host, and a batch built with `all_filters=True` runs the same kernels
whatever its rows ask for, as a CUDA graph needs.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dsv4.runtime.params import Logprob, SamplingParams

MASS_BITS = 52                                # top-p masses are integers, in units of 2^-MASS_BITS
UNIFORM_BITS = 40                             # uniform() takes values k / 2^UNIFORM_BITS
RADIX_ROUNDS = ((21, 11), (10, 11), (0, 10))  # (shift, bits) of each digit of a 32-bit key, high to low


def _as_int64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


GOLDEN_GAMMA = _as_int64(0x9E3779B97F4A7C15)  # splitmix64's increment and mixer constants
MIX_1 = _as_int64(0xBF58476D1CE4E5B9)
MIX_2 = _as_int64(0x94D049BB133111EB)


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row parameters as device tensors. A filter's tensor is None when no row uses it (unless the batch is built
    with all_filters); every host field is fixed when the batch is built."""
    temperature: torch.Tensor                # [B] fp32, 1.0 on greedy rows
    greedy: torch.Tensor                     # [B] bool
    min_p: torch.Tensor | None               # [B] fp32
    top_k: torch.Tensor | None               # [B] int64 in [1, V], V where disabled
    top_p_budget: torch.Tensor | None        # [B] int64: mass units a row may drop, floor((1 - top_p) 2^MASS_BITS)
    seeds: torch.Tensor                      # [B] int64: the request's seed, or the batch's unseeded_seed
    counters: torch.Tensor                   # [B] int64: which draw of that seed the row makes
    num_logprobs: int | None                 # max top-n over rows; None if no row asked for logprobs
    all_greedy: bool
    vocab_size: int

    @classmethod
    def build(cls, params: Sequence[SamplingParams], counters: Sequence[int], vocab_size: int,
              device: torch.device | str = "cpu", *, unseeded_seed: int = 0,
              all_filters: bool = False) -> SamplingBatch:
        """counters[i]: for a row with a seed, how many tokens its request has drawn so far; for a row without one, a
        number no other draw with `unseeded_seed` uses. all_filters: every filter runs on every row (neutral values
        where a row does not use it) and greedy rows are drawn too, so the kernels `sample` launches depend only on
        B, V and num_logprobs."""
        if len(params) != len(counters):
            raise ValueError(f"{len(params)} SamplingParams but {len(counters)} counters")

        def col(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        num_logprobs = [min(p.logprobs, vocab_size) for p in params if p.logprobs is not None]
        top_k = [min(p.top_k, vocab_size) if p.top_k else vocab_size for p in params]
        budget = [math.floor((1.0 - p.top_p) * 2.0**MASS_BITS) for p in params]
        return cls(
            temperature=col([1.0 if p.greedy else p.temperature for p in params], torch.float32),
            greedy=col([p.greedy for p in params], torch.bool),
            min_p=col([p.min_p for p in params], torch.float32)
            if all_filters or any(p.min_p > 0.0 for p in params) else None,
            top_k=col(top_k, torch.int64) if all_filters or any(p.top_k for p in params) else None,
            top_p_budget=col(budget, torch.int64) if all_filters or any(p.top_p < 1.0 for p in params) else None,
            seeds=col([unseeded_seed if p.seed is None else p.seed for p in params], torch.int64),
            counters=col(list(counters), torch.int64),
            num_logprobs=max(num_logprobs) if num_logprobs else None,
            all_greedy=not all_filters and all(p.greedy for p in params),
            vocab_size=vocab_size,
        )


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: torch.Tensor                  # [B] int64
    logprob_ids: torch.Tensor | None         # [B, 1 + n]: column 0 the sampled token, then the raw top-n
    logprobs: torch.Tensor | None            # [B, 1 + n] fp32 raw log-probabilities of logprob_ids
    ranks: torch.Tensor | None               # [B] int64, 1-based rank of the sampled token

    def host_logprobs(self, params: Sequence[SamplingParams]) -> list[dict[int, Logprob] | None]:
        """Per row: {token id: Logprob} with the sampled token and the row's own top-n (one host sync)."""
        if self.logprob_ids is None:
            return [None] * len(params)
        ids, lps, ranks = self.logprob_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()
        rows = []
        for p, row_ids, row_lps, rank in zip(params, ids, lps, ranks):
            if p.logprobs is None:
                rows.append(None)
                continue
            entry = {row_ids[0]: Logprob(row_lps[0], rank)}
            for j in range(min(p.logprobs, len(row_ids) - 1)):
                entry.setdefault(row_ids[1 + j], Logprob(row_lps[1 + j], j + 1))
            rows.append(entry)
        return rows


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """One token per row, thresholds by radix search: no sort, no host sync."""
    return _sample(logits, batch, reference=False)


def sample_reference(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """`sample` with the top-k and top-p thresholds found by sorting each row: the same tokens, more work."""
    return _sample(logits, batch, reference=True)


def sampling_probs(logits: torch.Tensor, batch: SamplingBatch, reference: bool = False) -> torch.Tensor:
    """[B, V] fp32: what each row draws from, softmax(logits / temperature) after min-p and top-k, with 0 on the
    tokens top-p drops (not renormalised). Zero exactly where a token cannot be drawn."""
    x = logits / batch.temperature[:, None]
    if batch.min_p is not None:
        probs = x.softmax(dim=-1)
        x = x.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * batch.min_p[:, None], float("-inf"))
    if batch.top_k is not None:
        x = x.masked_fill((_top_k_drop_sorted if reference else _top_k_drop)(x, batch.top_k), float("-inf"))
    probs = x.softmax(dim=-1)
    if batch.top_p_budget is not None:
        probs = probs.masked_fill((_top_p_drop_sorted if reference else _top_p_drop)(probs, batch.top_p_budget), 0.0)
    return probs


def uniform(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """fp64 in [0, 1 - 2^-UNIFORM_BITS], one per (seed, counter) pair: splitmix64's output for the counter-th step
    of the stream that starts at mix(seed)."""
    z = _mix64(_mix64(seeds) + counters * GOLDEN_GAMMA)
    return _shift_right(z, 64 - UNIFORM_BITS).double() * 2.0**-UNIFORM_BITS


def first_kept_key(keys: torch.Tensor, weights: torch.Tensor | None, budget: torch.Tensor) -> torch.Tensor:
    """Per row of keys [B, N] (int32), the smallest key c such that the keys <= c weigh more than budget [B]
    (int64 weights [B, N], or 1 each when None): keys < c are the heaviest low tail that weighs at most the budget.
    Returns int32 [B]; when the whole row weighs at most the budget, 2^31 - 1.

    A radix search: round r histograms the keys whose digits above the r-th equal the prefix found so far, by the
    r-th digit, with one bin for the keys below that range (at most the budget, by the earlier rounds) and one for
    those above; the first digit at which the cumulative weight passes the budget extends the prefix."""
    rows, device = keys.shape[0], keys.device
    if weights is None:
        weights = torch.ones((), dtype=torch.int64, device=device).expand_as(keys)
    keys = keys.long()                       # scatter_add_ takes int64 bins
    bins = torch.empty_like(keys)
    prefix = None
    for shift, bits in RADIX_ROUNDS:
        if prefix is None:   # the first digit is signed: key >> shift starts at -2^(31 - shift)
            low = torch.full((rows, 1), -(1 << (31 - shift)), dtype=torch.int64, device=device)
        else:
            low = prefix << bits
        torch.bitwise_right_shift(keys, shift, out=bins)
        bins.sub_(low - 1).clamp_(0, (1 << bits) + 1)
        hist = torch.zeros(rows, (1 << bits) + 2, dtype=torch.int64, device=device).scatter_add_(1, bins, weights)
        light = hist.cumsum(dim=-1)[:, 1:-1] <= budget[:, None]   # digit d: the keys up to it weigh <= budget
        prefix = low + light.sum(dim=-1, keepdim=True).clamp_(max=(1 << bits) - 1)
    return prefix.squeeze(1).int()


# ------------------------------------------------------------------ internals
def _sample(logits: torch.Tensor, batch: SamplingBatch, reference: bool) -> SamplerOutput:
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"logits must be [B, V] float32, got {tuple(logits.shape)} {logits.dtype}")
    if logits.shape[0] != batch.temperature.shape[0]:
        raise ValueError(f"logits have {logits.shape[0]} rows but the batch has {batch.temperature.shape[0]}")
    if logits.shape[1] != batch.vocab_size:
        raise ValueError(f"logits have {logits.shape[1]} columns but the batch was built for vocab {batch.vocab_size}")

    greedy_ids = logits.argmax(dim=-1)       # first maximum: ties go to the lowest id
    if batch.all_greedy:
        token_ids = greedy_ids
    else:
        drawn = _draw(sampling_probs(logits, batch, reference), uniform(batch.seeds, batch.counters))
        token_ids = torch.where(batch.greedy, greedy_ids, drawn)
    return _with_logprobs(logits, token_ids, batch.num_logprobs)


def _top_k_drop(x: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    keys = _ordered_keys(x)                  # drops the longest low tail of at most V - k tokens: ties of the k-th stay
    return keys < first_kept_key(keys, None, x.shape[-1] - top_k)[:, None]


def _top_k_drop_sorted(x: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    kth = x.sort(dim=-1).values.gather(1, (x.shape[-1] - top_k)[:, None])
    return x < kth


def _top_p_drop(probs: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
    keys = probs.view(torch.int32)           # p >= 0: its bits order like its value
    cut = torch.minimum(first_kept_key(keys, _masses(probs), budget), keys.amax(dim=-1))
    return keys < cut[:, None]


def _top_p_drop_sorted(probs: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
    ps, order = probs.sort(dim=-1)           # ascending
    tail = _masses(ps).cumsum(dim=-1)        # a tie group weighs as one: the tail up to its last member
    tail = tail.gather(1, torch.searchsorted(ps, ps, right=True) - 1)
    drop = (tail <= budget[:, None]) & (ps < ps[:, -1:])
    return drop.scatter(1, order, drop)


def _masses(probs: torch.Tensor) -> torch.Tensor:
    return (probs * 2.0**MASS_BITS).ceil_().long()


def _ordered_keys(x: torch.Tensor) -> torch.Tensor:
    """int32 keys that order like the float32 values of x (-0.0 and 0.0 equal)."""
    bits = (x + 0.0).view(torch.int32)       # + 0.0 makes -0.0 into 0.0
    return (bits >> 31).bitwise_and_(0x7FFFFFFF).bitwise_xor_(bits)   # negatives: the magnitude bits flipped


def _draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative probability exceeds u times the row's total: a token of zero
    probability never is (its cumulative sum equals its predecessor's), and u < 1 keeps the index below V."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    return torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's mixer on int64 (products wrap modulo 2^64)."""
    z = (z ^ _shift_right(z, 30)) * MIX_1
    z = (z ^ _shift_right(z, 27)) * MIX_2
    return z ^ _shift_right(z, 31)


def _shift_right(z: torch.Tensor, n: int) -> torch.Tensor:
    """Logical (unsigned) right shift of int64, whose >> is arithmetic."""
    return (z >> n) & ((1 << (64 - n)) - 1)


def _with_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, n: int | None) -> SamplerOutput:
    if n is None:
        return SamplerOutput(token_ids, None, None, None)
    raw = logits.log_softmax(dim=-1)
    sampled = raw.gather(1, token_ids[:, None])
    ranks = (raw >= sampled).sum(dim=-1)     # vLLM's convention: ties count against the token
    ids, lps = token_ids[:, None], sampled
    if n > 0:
        top = raw.topk(n, dim=-1)
        ids, lps = torch.cat([ids, top.indices], dim=1), torch.cat([lps, top.values], dim=1)
    return SamplerOutput(token_ids, ids, lps, ranks)
