"""Continuous batching with chunked prefill: which sequences run in the next step, and how many tokens each.

Every step has a budget of `max_num_batched_tokens`. Running sequences that are decoding take one token
each (first, so decode latency never waits behind prompts); then sequences still in their prompt take the
next chunk of it, oldest first, as far as the budget goes; then waiting requests are admitted, in arrival
order, while a cache slot is free and budget is left. A prompt may thus be split at any token, wherever it
falls relative to the 4- and 128-token compression windows. Each slot holds a whole sequence of up to
max_model_len tokens, so a running sequence is never preempted; a finished one frees its slot at once.
"""

from __future__ import annotations

from collections import deque

from .sequence import Sequence


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int):
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({max_num_seqs}) so that every running sequence can decode in each step")
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_slots: deque[int] = deque(range(max_num_seqs))

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """(sequence, number of its pending tokens to feed) for the next step; admitted ones get a slot."""
        budget = self.max_num_batched_tokens
        plan = []
        decoding = [s for s in self.running if s.num_cached >= len(s.prompt_token_ids)]
        prefilling = [s for s in self.running if s.num_cached < len(s.prompt_token_ids)]
        for seq in decoding:
            plan.append((seq, 1))
            budget -= 1
        for seq in prefilling:
            if budget == 0:
                break
            n = min(seq.num_pending, budget)
            plan.append((seq, n))
            budget -= n
        while self.waiting and self.free_slots and budget > 0:
            seq = self.waiting.popleft()
            seq.slot = self.free_slots.popleft()
            self.running.append(seq)
            n = min(seq.num_pending, budget)
            plan.append((seq, n))
            budget -= n
        return plan

    def finish(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its slot."""
        if seq in self.running:
            self.running.remove(seq)
            self.free_slots.append(seq.slot)
            seq.slot = None
        elif seq in self.waiting:
            self.waiting.remove(seq)
