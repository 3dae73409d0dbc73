"""Batched token sampling with per-row parameters, in vLLM's order and semantics.

For logits [B, V] fp32 (one row per sequence, V = the tokenizer's vocab; slice off padded embedding rows
first), each row is processed as vLLM's V1 sampler does:

1. logprobs, when requested, are the *raw* model distribution log_softmax(logits), before temperature or
   any truncation (vLLM's default logprobs_mode "raw_logprobs");
2. greedy rows (temperature < 1e-5) take argmax(logits), ties to the lowest id;
3. other rows: logits / temperature, then min-p (drop tokens with p < min_p * p_max), then top-k (ties
   with the k-th value are kept), then top-p (drop the low tail whose mass is <= 1 - top_p, never the top
   token), then one draw by the exponential race argmax(p / q), q ~ Exp(1) i.i.d. (= sampling from p).

A row with a seed draws its q from its own torch.Generator (the caller keeps one per request for the
request's lifetime), so its tokens do not depend on what else is in the batch. Rows without one share the
global default generator.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dsv4.runtime.params import Logprob, SamplingParams


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row parameters as device tensors; build once per batch composition, reuse across steps."""
    temperature: torch.Tensor                # [B] fp32, 1.0 on greedy rows
    greedy: torch.Tensor                     # [B] bool
    top_k: torch.Tensor | None               # [B] int64, V where disabled; None if no row uses it
    top_k_max: int                           # host copy of max(top_k), so top-k needs no device sync
    top_p: torch.Tensor | None               # [B] fp32; None if no row uses it
    min_p: torch.Tensor | None               # [B] fp32; None if no row uses it
    generators: tuple[torch.Generator | None, ...]
    num_logprobs: int | None                 # max top-n over rows; None if no row asked for logprobs
    all_greedy: bool
    vocab_size: int

    @classmethod
    def build(cls, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
              vocab_size: int, device: torch.device | str = "cpu") -> SamplingBatch:
        if len(params) != len(generators):
            raise ValueError(f"{len(params)} SamplingParams but {len(generators)} generators")
        for i, (p, g) in enumerate(zip(params, generators)):
            if g is not None and torch.device(g.device).type != torch.device(device).type:
                raise ValueError(f"row {i}: generator on {g.device} but sampling on {device}")
            if p.seed is not None and g is None and not p.greedy:
                raise ValueError(f"row {i}: SamplingParams.seed={p.seed} needs its generator "
                                 "(make_generator(seed), kept for the request's lifetime)")

        def col(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        num_logprobs = [min(p.logprobs, vocab_size) for p in params if p.logprobs is not None]
        top_k = [min(p.top_k, vocab_size) if p.top_k else vocab_size for p in params]
        return cls(
            temperature=col([1.0 if p.greedy else p.temperature for p in params], torch.float32),
            greedy=col([p.greedy for p in params], torch.bool),
            top_k=col(top_k, torch.int64) if any(p.top_k for p in params) else None,
            top_k_max=max(top_k, default=vocab_size),
            top_p=col([p.top_p for p in params], torch.float32) if any(p.top_p < 1.0 for p in params) else None,
            min_p=col([p.min_p for p in params], torch.float32) if any(p.min_p > 0.0 for p in params) else None,
            generators=tuple(generators),
            num_logprobs=max(num_logprobs) if num_logprobs else None,
            all_greedy=all(p.greedy for p in params),
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
        x = logits / batch.temperature[:, None]
        if batch.min_p is not None:
            x = _apply_min_p(x, batch.min_p)
        x = _apply_top_k_top_p(x, batch.top_k, batch.top_k_max, batch.top_p)
        token_ids = torch.where(batch.greedy, greedy_ids, _draw(x.softmax(dim=-1), batch))
    return _with_logprobs(logits, token_ids, batch.num_logprobs)


def _apply_min_p(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = x.softmax(dim=-1)
    too_small = probs < probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return x.masked_fill(too_small, float("-inf"))


def _apply_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor | None, top_k_max: int,
                       top_p: torch.Tensor | None) -> torch.Tensor:
    if top_k is None and top_p is None:
        return x
    if top_p is None:                        # top-k alone: one topk instead of a full sort
        kth = x.topk(top_k_max, dim=-1).values.gather(1, (top_k - 1)[:, None])
        return x.masked_fill(x < kth, float("-inf"))
    xs, order = x.sort(dim=-1)               # ascending
    if top_k is not None:
        kth = xs.gather(1, (xs.shape[-1] - top_k)[:, None])
        xs = xs.masked_fill(xs < kth, float("-inf"))
    tail_mass = xs.softmax(dim=-1).cumsum(dim=-1)
    drop = tail_mass <= 1.0 - top_p[:, None]
    drop[:, -1] = False                      # the most likely token always survives
    xs = xs.masked_fill(drop, float("-inf"))
    return xs.scatter(1, order, xs)


def _draw(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    q = torch.empty_like(probs)
    if any(g is None for g in batch.generators):
        q.exponential_()
    for i, g in enumerate(batch.generators):
        if g is not None:
            q[i].exponential_(generator=g)
    # q == 0 would turn a masked token's 0/0 into NaN, which argmax would pick.
    return (probs / q.clamp_min_(torch.finfo(q.dtype).tiny)).argmax(dim=-1)


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
