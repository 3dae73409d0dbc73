"""vLLM-compatible request types and the per-sequence output tracker.

Names and semantics follow vLLM's `SamplingParams`, `RequestOutput` and `CompletionOutput` (V1 engine):
finish_reason is "stop" (EOS, a stop token id or a stop string) or "length" (max_tokens, or the engine's
max_model_len through `OutputTracker.finish`); stop_reason is the stop string or stop token id that ended the
sequence, None for EOS. A stop token (EOS included) stays in token_ids but adds no text, and a stop string is cut
from the text, unless include_stop_str_in_output. One deliberate difference: when several stop strings match in
the same step, the one that starts first wins (vLLM takes the first in list order).

Unknown vLLM arguments (penalties, n > 1, min_tokens, ...) are not accepted: the dataclass raises TypeError
rather than silently ignoring them.
"""
from __future__ import annotations

import codecs
from dataclasses import dataclass, field

SAMPLING_EPS = 1e-5  # temperature below this is greedy (vLLM's _SAMPLING_EPS)
FINISH_REASONS = ("stop", "length", "abort")


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                          # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None                 # per-request torch.Generator: same seed, same tokens in any batch
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16             # None: until the engine's max_model_len
    logprobs: int | None = None             # top-n raw log-probabilities per token (plus the sampled token)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()
        if self.greedy:  # as vLLM: the truncations are meaningless for argmax
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"SamplingParams: {msg}")

        need(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        need(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        need(isinstance(self.top_k, int) and self.top_k >= 0,
             f"top_k must be -1, 0 (disabled) or >= 1, got {self.top_k}")
        need(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        need(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
             f"max_tokens must be None or >= 1, got {self.max_tokens}")
        need(self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0),
             f"logprobs must be None or >= 0, got {self.logprobs}")
        need(all(isinstance(s, str) and s for s in self.stop),
             f"stop strings must be non-empty strings, got {self.stop}")
        need(all(isinstance(i, int) and i >= 0 for i in self.stop_token_ids),
             f"stop_token_ids must be non-negative ints, got {self.stop_token_ids}")
        need(self.seed is None or isinstance(self.seed, int), f"seed must be an int or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None                 # 1-based rank in the raw distribution (ties share the worst rank)
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None        # None unless logprobs were requested
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False


class IncrementalDetokenizer:
    """Token ids to text one token at a time. A byte-level BPE token can end inside a multi-byte UTF-8
    character (CJK, emoji); those bytes wait in the UTF-8 decoder until the character completes, so every
    returned piece is final and the pieces concatenate to `tokenizer.decode(ids)`."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self._tokenizer.bytes_of(token_id, self._skip))

    def flush(self) -> str:
        """End of sequence: an unfinished character becomes U+FFFD, as in a full decode."""
        return self._utf8.decode(b"", final=True)


class OutputTracker:
    """One generated sequence: takes sampled tokens, detokenizes, applies EOS / stop ids / stop strings /
    max_tokens, and streams text deltas that hold back any tail that could still become a stop string."""

    def __init__(self, params: SamplingParams, tokenizer, index: int = 0):
        self.params, self.index = params, index
        self._tokenizer = tokenizer
        self._eos = None if params.ignore_eos else tokenizer.eos_id
        self._stop_ids = frozenset(params.stop_token_ids)
        self._detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self._longest_stop = max(map(len, params.stop), default=0)
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self._streamed = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token_id: int, logprobs: dict[int, Logprob] | None = None) -> bool:
        """Add one sampled token; `logprobs` (from `SamplerOutput.host_logprobs`) when they were requested.
        Returns whether the sequence is now finished."""
        if self.finished:
            raise RuntimeError(f"sequence {self.index} already finished ({self.finish_reason}); got token {token_id}")
        self.token_ids.append(token_id)
        self._record_logprobs(token_id, logprobs)
        stop_token = token_id == self._eos or token_id in self._stop_ids
        at_length = self.params.max_tokens is not None and len(self.token_ids) >= self.params.max_tokens
        piece = self._detok.push(token_id) if not stop_token or self.params.include_stop_str_in_output else ""
        if stop_token or at_length:
            piece += self._detok.flush()
        self._add_text(piece)
        if self.finished:            # a stop string wins over EOS-free length, as in vLLM
            return True
        if stop_token:
            self._set_finished("stop", None if token_id == self._eos else token_id)
        elif at_length:
            self._set_finished("length")
        return self.finished

    def finish(self, reason: str) -> None:
        """End the sequence from outside: "length" (max_model_len reached) or "abort"."""
        if not self.finished:
            self._add_text(self._detok.flush())
        if not self.finished:
            self._set_finished(reason)

    def take_delta(self) -> str:
        """Text that became final since the last call (for streaming)."""
        end = len(self.text) - self._holdback()
        delta = self.text[self._streamed:end]
        self._streamed = max(self._streamed, end)
        return delta

    def output(self) -> CompletionOutput:
        """Snapshot; while running, the text excludes the held-back tail."""
        text = self.text[:len(self.text) - self._holdback()]
        logprobs = None if self.logprobs is None else list(self.logprobs)
        return CompletionOutput(self.index, text, list(self.token_ids), self.cumulative_logprob, logprobs,
                                self.finish_reason, self.stop_reason)

    # ------------------------------------------------------------------ internals
    def _set_finished(self, reason: str, stop_reason: int | str | None = None) -> None:
        if reason not in FINISH_REASONS:
            raise ValueError(f"finish reason must be one of {FINISH_REASONS}, got {reason!r}")
        self.finish_reason, self.stop_reason = reason, stop_reason

    def _record_logprobs(self, token_id: int, logprobs: dict[int, Logprob] | None) -> None:
        if self.logprobs is None:
            return
        if logprobs is None or token_id not in logprobs:
            raise ValueError(f"sequence {self.index}: logprobs were requested but none were given for token {token_id}")
        for i, lp in logprobs.items():
            if lp.decoded_token is None:
                lp.decoded_token = self._tokenizer.decode([i], skip_special_tokens=False)
        self.logprobs.append(logprobs)
        self.cumulative_logprob += logprobs[token_id].logprob

    def _add_text(self, piece: str) -> None:
        if not piece:
            return
        start = max(0, len(self.text) - self._longest_stop + 1)  # an earlier match was found in an earlier step
        self.text += piece
        hits = [(pos, s) for s in self.params.stop if (pos := self.text.find(s, start)) != -1]
        if hits:
            pos, s = min(hits, key=lambda h: h[0])
            self.text = self.text[:pos + len(s) if self.params.include_stop_str_in_output else pos]
            self._set_finished("stop", s)

    def _holdback(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        if self.finished or not self.params.stop or self.params.include_stop_str_in_output:
            return 0
        for k in range(min(len(self.text), self._longest_stop - 1), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.params.stop):
                return k
        return 0
