"""vLLM-compatible request types, their validation, and the per-sequence output tracker.

Names and semantics follow vLLM's `SamplingParams`, `RequestOutput` and `CompletionOutput` (V1 engine):
finish_reason is "stop" (EOS, a stop token id or a stop string), "length" (max_tokens, or the engine's
max_model_len through `OutputTracker.finish`), "abort" (the caller's abort, or an interrupted step) or "error"
(the request's own work raised: its sampling, detokenization, stop handling or callback, or the step's model
forward; `CompletionOutput.error` says what); stop_reason is the stop string or stop token id that ended the
sequence, None for EOS. A stop token (EOS included) stays in token_ids but adds no text, and a stop string is cut
from the text, unless include_stop_str_in_output. One deliberate difference: when several stop strings match in
the same step, the one that starts first wins (vLLM takes the first in list order).

`SamplingParams` checks every field's type and range when it is made (and again when a request is added, so a
field changed afterwards is checked too): a bool is not a number, NaN and infinity are out of every range, and
the error names the field and what it allows. Unknown vLLM arguments (penalties, n > 1, min_tokens, ...) are
not accepted: the dataclass raises TypeError rather than silently ignoring them.
"""
from __future__ import annotations

import codecs
import math
import numbers
import operator
from dataclasses import dataclass, field

SAMPLING_EPS = 1e-5  # temperature below this is greedy (vLLM's _SAMPLING_EPS)
FINISH_REASONS = ("stop", "length", "abort", "error")
SEED_RANGE = (-2**63, 2**63 - 1)       # int64, as vLLM's OpenAI server accepts


class RequestError(ValueError):
    """A request the engine refuses; the message names the argument and what it allows."""


class RequestTypeError(RequestError, TypeError):
    """A request argument of the wrong type (also a TypeError)."""


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise RequestTypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return value


def check_int(name: str, value, lo: int | None = None, hi: int | None = None, allowed: str = "") -> int:
    """`value` as an int in [lo, hi] (numpy integers too; bools, floats and strings refused)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)
    except TypeError:
        raise RequestTypeError(f"{name} must be an int{allowed and f' ({allowed})'}, got {type(value).__name__} "
                               f"{value!r}") from None
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise RequestError(f"{name} must be {allowed or f'in [{lo}, {hi}]'}, got {value}")
    return value


def check_real(name: str, value, ok, allowed: str) -> float:
    """`value` as a finite float for which ok(value) holds (ints and numpy floats too; bools, strings refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RequestTypeError(f"{name} must be a number {allowed}, got {type(value).__name__} {value!r}")
    value = float(value)
    if not (math.isfinite(value) and ok(value)):
        raise RequestError(f"{name} must be {allowed}, got {value}")
    return value


def check_token_ids(name: str, ids) -> list[int]:
    """A sequence of token ids as a list of ints: a list or tuple of ints, or a 1-D integer numpy array or torch
    tensor. Bools, floats and strings are refused (vocabulary bounds are the engine's to check)."""
    if isinstance(ids, list) and all(type(i) is int for i in ids):     # the common case, at C speed
        return list(ids)
    if isinstance(ids, (str, bytes, bytearray)) or not hasattr(ids, "__len__"):
        raise RequestTypeError(f"{name} must be a list of token ids (ints), got {type(ids).__name__} {ids!r:.80}")
    dtype = getattr(ids, "dtype", None)
    if dtype is not None:                       # numpy array or torch tensor: check it whole
        shape = tuple(ids.shape)
        kind = str(dtype)
        if len(shape) != 1 or "bool" in kind or not ("int" in kind):
            raise RequestTypeError(f"{name} must be a 1-D array of integer token ids, got shape {shape} {kind}")
        return [int(i) for i in ids.tolist()]
    out = []
    for k, i in enumerate(ids):
        try:
            if isinstance(i, bool) or "bool" in type(i).__name__:   # numpy's bool too
                raise TypeError
            out.append(operator.index(i))
        except TypeError:
            raise RequestTypeError(f"{name} must be integers: [{k}] is {type(i).__name__} {i!r}") from None
    return out


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                          # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None                 # the request's draws: same seed, same tokens in any batch and run
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16             # None: until the engine's max_model_len
    logprobs: int | None = None             # top-n raw log-probabilities per token (plus the sampled token)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> SamplingParams:
        """Check every field's type and range and normalise it in place (stop as a list, top_k -1 as 0, numbers
        as int / float; greedy drops the truncations, as vLLM: they mean nothing for argmax). Raises
        RequestTypeError / RequestError naming the field. Returns self."""
        def name(f: str) -> str:
            return f"SamplingParams.{f}"

        self.temperature = check_real(name("temperature"), self.temperature, lambda v: v >= 0.0,
                                      "in [0, inf) (0 = greedy)")
        self.top_p = check_real(name("top_p"), self.top_p, lambda v: 0.0 < v <= 1.0, "in (0, 1]")
        self.top_k = check_int(name("top_k"), self.top_k, lo=-1, allowed="-1 or 0 (disabled), or >= 1")
        self.top_k = max(self.top_k, 0)
        self.min_p = check_real(name("min_p"), self.min_p, lambda v: 0.0 <= v <= 1.0, "in [0, 1]")
        if self.seed is not None:
            self.seed = check_int(name("seed"), self.seed, *SEED_RANGE, allowed=f"None or an int in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise RequestTypeError(f"{name('stop')} must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        self.stop_token_ids = check_token_ids(name("stop_token_ids"), self.stop_token_ids)
        if any(i < 0 for i in self.stop_token_ids):
            raise RequestError(f"{name('stop_token_ids')} must be token ids >= 0, got {self.stop_token_ids}")
        if self.max_tokens is not None:
            self.max_tokens = check_int(name("max_tokens"), self.max_tokens, lo=1, allowed="None or >= 1")
        if self.logprobs is not None:
            self.logprobs = check_int(name("logprobs"), self.logprobs, lo=0, allowed="None or >= 0")
        for flag in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            check_bool(name(flag), getattr(self, flag))
        if self.greedy:
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        return self

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
    error: str | None = None                # finish_reason "error" / "abort" by a fault: what went wrong

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
    max_tokens, and streams text deltas that hold back any tail that could still become a stop string.

    A token arrives in two halves, so that an engine can detokenize while its next step runs: `accept` takes it
    (cheap: it says at once whether the token ends the sequence by EOS, a stop token id or max_tokens), and
    `render` detokenizes the accepted tokens, checks stop strings and records their logprobs. `append` does both.
    Everything a reader sees (`token_ids`, `logprobs`, the text, `output`, `take_delta`) is rendered output; a
    stop string found while rendering drops the accepted tokens after the one that completed it.

    The text is kept as the list of pieces it arrived in and joined only when read (`text`, `output`), and its
    last (longest stop string - 1) characters as one string, so a token costs O(len(piece) + the longest stop
    string): the stop-string search, the hold-back and `take_delta` look only at the text's end."""

    def __init__(self, params: SamplingParams, tokenizer, index: int = 0):
        self.params, self.index = params, index
        self._tokenizer = tokenizer
        self._eos = None if params.ignore_eos else tokenizer.eos_id
        self._stop_ids = frozenset(params.stop_token_ids)
        self._detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self._longest_stop = max(map(len, params.stop), default=0)
        self._stop_prefixes = {s[:k] for s in params.stop for k in range(1, len(s))}   # proper, non-empty
        self.token_ids: list[int] = []         # rendered tokens
        self._accepted: list[tuple[int, dict[int, Logprob] | None]] = []   # accepted, not yet rendered
        self._pieces: list[str] = []         # the text, joined when read
        self._length = 0                     # len(text)
        self._tail = ""                      # its last (longest stop - 1) characters, while it runs
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self._streamed = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """All the text so far, the held-back tail included."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def num_sampled(self) -> int:
        """Tokens taken so far, rendered or not."""
        return len(self.token_ids) + len(self._accepted)

    def sampled_ids(self, start: int, stop: int) -> list[int]:
        """The ids of the taken tokens [start, stop), rendered or not, in O(stop - start)."""
        r = len(self.token_ids)
        return self.token_ids[start:min(stop, r)] + [t for t, _ in self._accepted[max(0, start - r):max(0, stop - r)]]

    @property
    def has_unrendered(self) -> bool:
        return bool(self._accepted)

    def append(self, token_id: int, logprobs: dict[int, Logprob] | None = None) -> bool:
        """Add one sampled token and render it; `logprobs` (from `SamplerOutput.host_logprobs`) when they were
        requested. Returns whether the sequence is now finished."""
        self.accept(token_id, logprobs)
        self.render()
        return self.finished

    def accept(self, token_id: int, logprobs: dict[int, Logprob] | None = None) -> bool:
        """Take one sampled token without rendering it. Returns whether it ends the sequence (EOS, a stop token id,
        max_tokens): then nothing more may be accepted, and the caller renders it to finish the sequence."""
        if self.finished or self._ends_at(len(self._accepted)):
            raise RuntimeError(f"sequence {self.index} already finished ({self.finish_reason or 'by its last token'});"
                               f" got token {token_id}")
        self._accepted.append((token_id, logprobs))
        return self._ends_at(len(self._accepted))

    def render(self) -> bool:
        """Detokenize the accepted tokens in order, with stop strings and logprobs; returns whether any was rendered.
        A token that ends the sequence (a stop string, or what `accept` said) drops those after it. A token whose
        rendering raises is in token_ids, as far as it got; the caller then ends the sequence (`fail`)."""
        rendered = False
        while self._accepted and not self.finished:
            rendered = True
            self._render_one(*self._accepted.pop(0))
        self._accepted.clear()
        return rendered

    def next_ends_by_count(self) -> bool:
        """Whether the next token taken ends the sequence whatever it is (max_tokens)."""
        max_tokens = self.params.max_tokens
        return max_tokens is not None and self.num_sampled + 1 >= max_tokens

    def _ends_at(self, k: int) -> bool:
        """Whether the k-th accepted token (1-based; 0: none) ends the sequence without its text."""
        if k == 0:
            return False
        token_id = self._accepted[k - 1][0]
        max_tokens = self.params.max_tokens
        return (token_id == self._eos or token_id in self._stop_ids
                or (max_tokens is not None and len(self.token_ids) + k >= max_tokens))

    def _render_one(self, token_id: int, logprobs: dict[int, Logprob] | None) -> None:
        self.token_ids.append(token_id)
        self._record_logprobs(token_id, logprobs)
        stop_token = token_id == self._eos or token_id in self._stop_ids
        at_length = self.params.max_tokens is not None and len(self.token_ids) >= self.params.max_tokens
        piece = self._detok.push(token_id) if not stop_token or self.params.include_stop_str_in_output else ""
        if stop_token or at_length:
            piece += self._detok.flush()
        self._add_text(piece)
        if self.finished:            # a stop string wins over EOS-free length, as in vLLM
            return
        if stop_token:
            self._set_finished("stop", None if token_id == self._eos else token_id)
        elif at_length:
            self._set_finished("length")

    def finish(self, reason: str) -> None:
        """End the sequence from outside: "length" (max_model_len reached) or "abort". Accepted tokens are
        rendered first (and may end it on their own)."""
        self.render()
        if not self.finished:
            self._add_text(self._detok.flush())
        if not self.finished:
            self._set_finished(reason)

    def fail(self, reason: str, error: BaseException | str) -> None:
        """End the sequence because its work failed ("error") or was interrupted ("abort"), whatever state it
        is in (finished included: the failure wins). Touches neither the detokenizer nor the text, which may be
        what failed; the text keeps what was final, and tokens accepted but not rendered are dropped."""
        self._accepted.clear()
        self._set_finished(reason)
        self.stop_reason = None
        self.error = error if isinstance(error, str) else f"{type(error).__name__}: {error}"

    def take_delta(self) -> str:
        """Text that became final since the last call (for streaming)."""
        end = self._length - self._holdback()
        delta = self._last(self._length - self._streamed)[:end - self._streamed] if end > self._streamed else ""
        self._streamed = max(self._streamed, end)
        return delta

    def output(self) -> CompletionOutput:
        """Snapshot; while running, the text excludes the held-back tail."""
        text = self.text[:self._length - self._holdback()]
        logprobs = None if self.logprobs is None else list(self.logprobs)
        return CompletionOutput(self.index, text, list(self.token_ids), self.cumulative_logprob, logprobs,
                                self.finish_reason, self.stop_reason, self.error)

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
        self._pieces.append(piece)
        self._length += len(piece)
        if not self.params.stop:
            return
        # A match must end in the new piece (an earlier one ended the sequence), so it starts in this window.
        window = self._tail + piece
        hits = [(pos, s) for s in self.params.stop if (pos := window.find(s)) != -1]
        if hits:
            pos, s = min(hits, key=lambda h: h[0])
            cut = self._length - len(window) + pos
            self._truncate(cut + len(s) if self.params.include_stop_str_in_output else cut)
            self._set_finished("stop", s)
        else:
            self._tail = window[max(0, len(window) - self._longest_stop + 1):]

    def _last(self, n: int) -> str:
        """The last n characters of the text (all of it if shorter), from the pieces at its end."""
        parts = []
        for piece in reversed(self._pieces):
            if n <= 0:
                break
            parts.append(piece[-n:] if n < len(piece) else piece)
            n -= len(piece)
        return "".join(reversed(parts))

    def _truncate(self, length: int) -> None:
        """Keep the first `length` characters; what goes is at the end (within the last stop-string window). The
        tail is not updated: only a finished sequence is truncated."""
        while self._pieces and self._length - len(self._pieces[-1]) >= length:
            self._length -= len(self._pieces.pop())
        if self._length > length:
            self._pieces[-1] = self._pieces[-1][:length - self._length]
            self._length = length

    def _holdback(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        if self.finished or not self.params.stop or self.params.include_stop_str_in_output:
            return 0
        tail = self._tail
        for k in range(len(tail), 0, -1):
            if tail[-k:] in self._stop_prefixes:
                return k
        return 0
