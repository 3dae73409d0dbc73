"""One request as the engine sees it: its tokens, how many of them are in its cache slot, and its output."""

from __future__ import annotations

from collections.abc import Callable

from .cache import PageTable
from .params import OutputTracker, RequestOutput, SamplingParams


class Sequence:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 tracker: OutputTracker, on_output: Callable[[Sequence], None] | None = None):
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, list(prompt_token_ids)
        self.params, self.tracker = params, tracker
        self.on_output = on_output           # called after each new token (Engine.add_request)
        self.slot: int | None = None         # cache slot while running
        self.page_table = PageTable()        # cache pages of its compressed entries while running
        self.num_cached = 0                  # leading tokens whose state is in the slot and pages

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.tracker.num_sampled

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the cache: the rest of the prompt, or the last sampled token."""
        return self.num_tokens - self.num_cached

    @property
    def finished(self) -> bool:
        return self.tracker.finished

    def chunk(self, n: int) -> list[int]:
        """The next n tokens to feed (from the prompt, then the generated ones), in O(n): a decode step of a long
        sequence copies neither its prompt nor its output."""
        start, prompt = self.num_cached, self.prompt_token_ids
        p = len(prompt)
        if start + n <= p:
            return prompt[start:start + n]
        generated = self.tracker.sampled_ids(max(0, start - p), start + n - p)
        return prompt[start:] + generated if start < p else generated

    def output(self) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_token_ids), [self.tracker.output()],
                             self.finished)

    def __repr__(self) -> str:
        return f"Sequence({self.request_id!r}, {self.num_tokens} tokens, {self.num_cached} cached, slot {self.slot})"
