"""The engine: requests in, one ragged model step at a time, tokens and text out.

A step flattens the scheduled chunks of all sequences (prefill chunks and single decode tokens alike) into
one [1, N] batch described by a `SeqBatch`, runs the model against the runtime-owned `KVCache`, computes
logits only at each sequence's last token when that token completes what is known of it (the last prompt
token, or the last sampled one), and samples them in one batch with per-request parameters. A sequence
ends on its SamplingParams (EOS, stop ids/strings, max_tokens) or, with finish_reason "length", when it
reaches max_model_len; its cache slot is freed in the same step.
"""

from __future__ import annotations

import itertools
import operator

import torch

from ..model import Transformer
from ..model.state import SeqBatch
from .cache import KVCache
from .params import OutputTracker, SamplingParams
from .sampler import SamplingBatch, make_generator, sample
from .scheduler import Scheduler
from .sequence import Sequence

DEFAULT_MAX_MODEL_LEN = 4096
DEFAULT_MAX_NUM_SEQS = 8
DEFAULT_MAX_NUM_BATCHED_TOKENS = 1024


class RequestError(ValueError):
    """A request the engine cannot run (the message names it)."""


class TokenIdsOnly:
    """Stands in for a tokenizer when none is loaded: token ids in and out, no text."""

    def __init__(self, eos_id: int, vocab_size: int):
        self.eos_id, self.vocab_size = eos_id, vocab_size

    def bytes_of(self, token_id: int, skip_special_tokens: bool = False) -> bytes:
        return b""

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return ""


class Engine:
    def __init__(self, model: Transformer, tokenizer=None, *, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                 max_model_len: int | None = None, max_num_batched_tokens: int | None = None):
        cfg = model.config
        self.model = model
        self.device, self.dtype = model.embed.weight.device, model.embed.weight.dtype
        self.max_model_len = max_model_len or min(cfg.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        if self.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                             f"({cfg.max_position_embeddings})")
        if tokenizer is not None:
            tokenizer.check_model(cfg)
        self.tokenizer = tokenizer or TokenIdsOnly(cfg.eos_token_id, cfg.vocab_size)
        self.text = tokenizer is not None
        # The head may have more rows than the tokenizer has ids (padding): those are never sampled.
        self.vocab_size = self.tokenizer.vocab_size
        self.cache = KVCache(cfg, max_num_seqs, self.max_model_len, self.dtype, self.device)
        budget = max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_num_seqs)
        self.scheduler = Scheduler(max_num_seqs, budget)
        self._ids = itertools.count()

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, prompt: str | None = None) -> Sequence:
        params = params or SamplingParams()
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        ids = self._check(request_id, prompt_token_ids, params)
        generator = None if params.seed is None else make_generator(params.seed, self.device)
        seq = Sequence(request_id, prompt, ids, params, OutputTracker(params, self.tokenizer), generator)
        self.scheduler.add(seq)
        return seq

    def _check(self, request_id: str, prompt_token_ids, params: SamplingParams) -> list[int]:
        def refuse(why: str):
            raise RequestError(f"request {request_id!r}: {why}")

        try:
            ids = [operator.index(i) for i in prompt_token_ids]
        except TypeError as e:
            refuse(f"prompt token ids must be integers ({e})")
        if not ids:
            refuse("the prompt is empty")
        bad = [i for i in ids if not 0 <= i < self.model.config.vocab_size]
        if bad:
            refuse(f"token ids {bad[:8]} are outside the model's vocabulary [0, {self.model.config.vocab_size})")
        if len(ids) > self.max_model_len:
            refuse(f"the prompt has {len(ids)} tokens, more than max_model_len={self.max_model_len}")
        if params.stop and not self.text:
            refuse(f"stop strings {params.stop} need a tokenizer, and this engine has none (token ids only)")
        return ids

    def abort(self, request_id: str) -> None:
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            if seq.request_id == request_id:
                seq.tracker.finish("abort")
                self.scheduler.finish(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Run one model step; returns the sequences that got a new token (finished ones included)."""
        plan = self.scheduler.schedule()
        if not plan:
            return []
        for seq, _ in plan:
            if seq.num_cached == 0:
                self.cache.reset(seq.slot)
        batch = SeqBatch(tuple(s.slot for s, _ in plan), tuple(s.num_cached for s, _ in plan),
                         tuple(n for _, n in plan))
        ids = torch.tensor([t for s, n in plan for t in s.chunk(n)], dtype=torch.long, device=self.device)
        streams = self.model(ids[None], batch.positions(self.device)[None], self.cache.layers, batch)
        for seq, n in plan:
            seq.num_cached += n
        done = [(seq, off + n - 1) for (seq, n), off in zip(plan, batch.offsets) if seq.num_pending == 0]
        if done:
            self._sample([s for s, _ in done], streams[:, [row for _, row in done]])
        return [s for s, _ in done]

    def _sample(self, seqs: list[Sequence], streams: torch.Tensor) -> None:
        logits = self.model.head_logits(streams)[0, :, :self.vocab_size].float()
        params = [s.params for s in seqs]
        out = sample(logits, SamplingBatch.build(params, [s.generator for s in seqs], self.vocab_size, self.device))
        for seq, token, logprobs in zip(seqs, out.token_ids.tolist(), out.host_logprobs(params)):
            seq.tracker.append(token, logprobs)
            if not seq.finished and seq.num_tokens >= self.max_model_len:
                seq.tracker.finish("length")
            if seq.finished:
                self.scheduler.finish(seq)
