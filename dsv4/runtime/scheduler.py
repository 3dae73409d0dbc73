"""Continuous batching with chunked prefill over a paged cache: which sequences run in the next step, how many tokens
each, and the pages they need.

Every step has a budget of `max_num_batched_tokens`. Running sequences with one token pending (decoding) take it
first, so decode latency never waits behind prompts; then sequences still in their prompt (or recomputing one)
take the next chunk of it, oldest first, as far as the budget goes; then waiting requests are admitted, in arrival
order, while a slot is free and budget is left. A prompt may thus be split at any token, wherever it falls relative
to the 4- and 128-token compression windows.

A request is admitted only when the pool's free pages hold all its tokens (its prompt, or for a preempted one
everything it has), so its prefill chunks never wait for pages. Decoding takes one more position per step; when a
decoding sequence needs a page and none is free, the youngest running sequence (the last admitted) is preempted:
its slot and pages are freed and it goes back to the front of the waiting queue, to recompute its tokens when it
is admitted again (vLLM's recompute preemption). A running request is never failed for lack of pages, and no other
sequence's pages are touched.
"""

from __future__ import annotations

from collections import deque

from .cache import PAGE_TOKENS, PageAllocator
from .sequence import Sequence


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, pages: PageAllocator):
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({max_num_seqs}) so that every running sequence can decode in each step")
        self.max_num_batched_tokens = max_num_batched_tokens
        self.pages = pages
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []       # in admission order: the last is the youngest
        self.free_slots: deque[int] = deque(range(max_num_seqs))
        self.vacated: list[int] = []            # slots freed by preemption since the engine last reset them
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """(sequence, number of its pending tokens to feed) for the next step; every planned sequence's page table
        covers the positions it feeds; admitted ones get a slot."""
        budget = self.max_num_batched_tokens
        plan: list[tuple[Sequence, int]] = []
        preempted_before = self.num_preemptions
        for seq in [s for s in self.running if s.num_pending == 1]:
            if seq.slot is None or not self._make_room(seq, seq.num_cached + 1):
                continue                          # preempted to make room for an older one, or for itself
            plan.append((seq, 1))
            budget -= 1
        for seq in [s for s in self.running if s.num_pending > 1]:
            if budget == 0:
                break
            n = min(seq.num_pending, budget)      # its pages were given at admission
            plan.append((seq, n))
            budget -= n
        # A sequence preempted in this call is not admitted back in it (its pages went to an older one).
        preempted_now = self.num_preemptions - preempted_before
        while self.waiting and self.free_slots and budget > 0 and preempted_now == 0:
            seq = self.waiting[0]
            if not self.pages.grow(seq.page_table, seq.num_tokens):
                break                             # too few free pages for all its tokens: it waits, in order
            self.waiting.popleft()
            seq.slot = self.free_slots.popleft()
            self.running.append(seq)
            n = min(seq.num_pending, budget)
            plan.append((seq, n))
            budget -= n
        return plan

    def would_admit(self) -> bool:
        """Whether `schedule` could now admit the first waiting request: a slot is free and the free pages hold all
        its tokens (admission goes in order, so the others wait behind it)."""
        return bool(self.waiting and self.free_slots
                    and self.pages.fits(self.waiting[0].page_table, self.waiting[0].num_tokens))

    def grow_ahead(self, seqs: list[Sequence]) -> bool:
        """Pages for each of `seqs` (running, in running order) to feed one more token than it has cached, as
        `schedule` gives them, but without preempting: whether all of them have theirs."""
        return all(self.pages.grow(seq.page_table, seq.num_cached + 1) for seq in seqs)

    def _make_room(self, seq: Sequence, tokens: int) -> bool:
        """Pages for `seq` to hold `tokens` positions, preempting the youngest running sequences as needed;
        False if `seq` itself had to be preempted."""
        while not self.pages.grow(seq.page_table, tokens):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free `seq`'s slot and pages and queue it first, to recompute its tokens when admitted again."""
        self.running.remove(seq)
        self.free_slots.append(seq.slot)
        self.vacated.append(seq.slot)
        self.pages.release(seq.page_table)
        seq.slot, seq.num_cached = None, 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its slot and pages."""
        if seq in self.running:
            self.running.remove(seq)
            self.free_slots.append(seq.slot)
            seq.slot = None
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.pages.release(seq.page_table)
