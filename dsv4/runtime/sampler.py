"""Batched token sampling with per-row parameters, in vLLM's order and semantics, without a sort or a host sync.

For logits [B, V] (one row per sequence, V = the tokenizer's vocab; a slice that leaves out padded embedding rows
is read in place), fp32 or the model's bf16 / fp16 (their values, widened to fp32: no copy is made on CUDA), each row
is processed as vLLM's V1 sampler does:

1. logprobs, when requested, are the *raw* model distribution log_softmax(logits), before temperature or
   any truncation (vLLM's default logprobs_mode "raw_logprobs"), with the row's top-n by `topk`;
2. greedy rows (temperature < 1e-5) take argmax(logits), ties to the lowest id;
3. other rows: x = logits * (1 / temperature), then min-p (drop tokens with exp(x - max x) < min_p, i.e.
   p < min_p * p_max), then top-k (keep the k largest values and every token tied with the k-th), then top-p
   (drop the low tail whose mass is <= 1 - top_p, never the most likely token), then one draw from what is left.

Top-p counts mass exactly, so that the tokens it keeps do not depend on the order of a sum: a token weighs
ceil(exp(x - max x) * 2^SAMPLE_MASS_BITS) integer units (the same units for the whole row: its probability times a
constant), and a token stays iff the tokens with a larger x weigh less than T - floor(T * (1 - top_p)), T the
weight of all the tokens min-p and top-k leave. Tokens of equal x are dropped or kept together (vLLM's sort may
split such a group at the boundary), and the tokens of the largest x always stay.

The draw is by mass: the tokens' masses (those of the top-p rule, over the tokens min-p and top-k leave) laid end
to end in token order, the row's random 64-bit word w picks the token that holds floor(w T / 2^64), T the masses'
sum (`kernels.ref.draw_by_mass`): token i with probability m_i / T, softmax(x) to within 2^-40 of the largest
probability per token. A top-p row draws over what min-p and top-k leave and takes the first of four draws that
top-p keeps, else one draw over the kept tokens (rejection sampling: the same distribution as drawing over the kept
tokens). The words are the splitmix64 stream of the row key (`kernels.ref.draw_words`); the row key is splitmix64 of
(seed, counter) (`kernels.ref.row_keys`): a request with a seed draws its n-th token with (its seed, n), so its
tokens depend neither on the other rows nor on its own row's position, and are the same in every run; rows without a
seed draw with the caller's `unseeded_seed` and distinct counters the caller gives them.

`sample` runs Triton kernels on CUDA (`kernels/sampling.py`: the kept set found by rejection, no sort) and the
PyTorch reference elsewhere (`kernels.ref.sample_tokens`: the kept set found by sorting each row), which
`sample_reference` runs everywhere; they keep the same tokens and draw the same token up to the last bit of exp
(sums of integers do not depend on their order). Nothing in `sample` reads a device value back to the host, and a
batch built with `all_filters=True` launches the same kernels whatever its rows ask for, as a CUDA graph needs.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dsv4.kernels import ref
from dsv4.kernels.ref import GOLDEN_GAMMA, SAMPLE_MASS_BITS, row_keys  # noqa: F401  (re-exported)
from dsv4.runtime.params import Logprob, SamplingParams

LOGITS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)   # what `sample` takes; fp32 values all


def device_column(values: Sequence, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A host list as a tensor on `device`, copied without waiting for the device: from pinned memory, non-blocking
    (a copy from pageable memory waits for every kernel queued before it, e.g. the decode step being sampled)."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row parameters as device tensors. A filter's tensor is None when no row uses it (unless the batch is built
    with all_filters); every host field is fixed when the batch is built."""
    temperature: torch.Tensor                # [B] fp32, 1.0 on greedy rows
    inv_temperature: torch.Tensor            # [B] fp32: 1 / temperature (x = logits * this)
    greedy: torch.Tensor                     # [B] bool
    min_p: torch.Tensor | None               # [B] fp32
    top_k: torch.Tensor | None               # [B] int64 in [1, V], V where disabled
    drop_share: torch.Tensor | None          # [B] fp64: 1 - top_p, the share of the mass top-p may drop
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
        number no other draw with `unseeded_seed` uses. all_filters: every filter's tensor is there (neutral values
        where a row does not use it), so the kernels `sample` launches depend only on B, V and num_logprobs."""
        if len(params) != len(counters):
            raise ValueError(f"{len(params)} SamplingParams but {len(counters)} counters")

        def col(values, dtype):
            return device_column(values, dtype, device)

        num_logprobs = [min(p.logprobs, vocab_size) for p in params if p.logprobs is not None]
        top_k = [min(p.top_k, vocab_size) if p.top_k else vocab_size for p in params]
        temperature = col([1.0 if p.greedy else p.temperature for p in params], torch.float32)
        return cls(
            temperature=temperature,
            inv_temperature=1.0 / temperature,
            greedy=col([p.greedy for p in params], torch.bool),
            min_p=col([p.min_p for p in params], torch.float32)
            if all_filters or any(p.min_p > 0.0 for p in params) else None,
            top_k=col(top_k, torch.int64) if all_filters or any(p.top_k for p in params) else None,
            drop_share=col([1.0 - p.top_p for p in params], torch.float64)
            if all_filters or any(p.top_p < 1.0 for p in params) else None,
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
    ready: torch.cuda.Event | None = None    # a host copy's (`to_host`): recorded after its copies

    def to_host(self) -> SamplerOutput:
        """These tensors copied into pinned host memory without waiting (on CUDA; elsewhere self), with an event
        after the copies: reading them (`wait`, then `tolist`) waits for this sampler's work only, not for work
        launched after it on the stream (a decode step launched ahead)."""
        if self.token_ids.device.type != "cuda":
            return self

        def pinned(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            return host
        ready = torch.cuda.Event()
        out = SamplerOutput(pinned(self.token_ids), pinned(self.logprob_ids), pinned(self.logprobs),
                            pinned(self.ranks), ready)
        ready.record(torch.cuda.current_stream(self.token_ids.device))
        return out

    def wait(self) -> None:
        """Wait for a host copy's copies (`to_host`); nothing to wait for otherwise."""
        if self.ready is not None:
            self.ready.synchronize()

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
    """One token per row: the Triton kernels on CUDA, the PyTorch reference elsewhere; no host sync."""
    return _sample(logits, batch, reference=logits.device.type != "cuda")


def sample_reference(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """`sample` with the PyTorch reference on any device (the kept tokens found by sorting each row)."""
    return _sample(logits, batch, reference=True)


def sampling_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[B, V] fp32: what each row draws from, softmax(logits / temperature) on the tokens the filters keep, 0 elsewhere
    (the reference's kept set; greedy rows as if sampled at temperature 1); logits as `sample` takes them."""
    logits = logits.float()
    kept = ref.sample_kept(logits, batch.inv_temperature, batch.min_p, batch.top_k, batch.drop_share)
    x = (logits * batch.inv_temperature[:, None]).masked_fill(~kept, float("-inf"))
    return x.softmax(dim=-1)


# ------------------------------------------------------------------ internals
def _sample(logits: torch.Tensor, batch: SamplingBatch, reference: bool) -> SamplerOutput:
    if logits.dim() != 2 or logits.dtype not in LOGITS_DTYPES:
        raise ValueError(f"logits must be [B, V] float32, bfloat16 or float16, got {tuple(logits.shape)} "
                         f"{logits.dtype}")
    if logits.shape[0] != batch.temperature.shape[0]:
        raise ValueError(f"logits have {logits.shape[0]} rows but the batch has {batch.temperature.shape[0]}")
    if logits.shape[1] != batch.vocab_size:
        raise ValueError(f"logits have {logits.shape[1]} columns but the batch was built for vocab {batch.vocab_size}")
    if reference:                   # the reference takes fp32; the kernels widen each load (the same values)
        logits = logits.float()
    if reference and batch.all_greedy:
        token_ids = logits.argmax(dim=-1)    # first maximum: ties go to the lowest id
    else:                           # on CUDA greedy batches too: the kernels' argmax splits each row over programs
        if reference:
            draw = ref.sample_tokens
        else:
            from dsv4.kernels.sampling import sample_tokens as draw
        token_ids = draw(logits, batch.inv_temperature, batch.greedy, batch.min_p, batch.top_k, batch.drop_share,
                         batch.seeds, batch.counters)
    return _with_logprobs(logits, token_ids, batch.num_logprobs)


def _with_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, n: int | None) -> SamplerOutput:
    if n is None:
        return SamplerOutput(token_ids, None, None, None)
    raw = logits.float().log_softmax(dim=-1)
    sampled = raw.gather(1, token_ids[:, None])
    ranks = (raw >= sampled).sum(dim=-1)     # vLLM's convention: ties count against the token
    ids, lps = token_ids[:, None], sampled
    if n > 0:
        top = raw.topk(n, dim=-1)
        ids, lps = torch.cat([ids, top.indices], dim=1), torch.cat([lps, top.values], dim=1)
    return SamplerOutput(token_ids, ids, lps, ranks)
