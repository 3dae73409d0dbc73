"""The scheduler alone (no model): token budget, decode-first order, chunked prefill, slot admission and release,
pages and preemption."""

import pytest

from dsv4.runtime.cache import PageAllocator
from dsv4.runtime.engine import TokenIdsOnly
from dsv4.runtime.params import OutputTracker, SamplingParams
from dsv4.runtime.scheduler import Scheduler
from dsv4.runtime.sequence import Sequence


def seq(name: str, prompt_len: int) -> Sequence:
    params = SamplingParams(max_tokens=1000, ignore_eos=True)
    return Sequence(name, None, list(range(2, 2 + prompt_len)), params, OutputTracker(params, TokenIdsOnly(1, 512)))


def advance(plan, sampled=7):
    """What the engine does after a step: the fed tokens are cached; a sequence with nothing pending samples."""
    for s, n in plan:
        s.num_cached += n
        if s.num_pending == 0:
            s.tracker.append(sampled)


def names(plan):
    return [(s.request_id, n) for s, n in plan]


def test_chunked_prefill_decode_first_and_admission_by_slots():
    sch = Scheduler(max_num_seqs=2, max_num_batched_tokens=10, pages=PageAllocator(8))
    a, b, c = seq("a", 4), seq("b", 13), seq("c", 3)
    for s in (a, b, c):
        sch.add(s)
    plan = sch.schedule()
    assert names(plan) == [("a", 4), ("b", 6)]            # b's prompt is cut by the budget; no slot left for c
    assert (a.slot, b.slot, c.slot) == (0, 1, None)
    advance(plan)
    assert a.num_pending == 1 and b.num_pending == 7
    plan = sch.schedule()
    assert names(plan) == [("a", 1), ("b", 7)]            # decode first, then the rest of b's prompt
    advance(plan)
    assert names(sch.schedule()) == [("a", 1), ("b", 1)]
    sch.finish(a)                                         # a finished: its slot goes to c at once
    assert a.slot is None and list(sch.free_slots) == [0]
    plan = sch.schedule()
    assert names(plan) == [("b", 1), ("c", 3)] and c.slot == 0
    sch.finish(b)
    sch.finish(c)
    assert not sch.has_unfinished() and sorted(sch.free_slots) == [0, 1]


def test_budget_bounds_every_step_and_prompts_are_split_anywhere():
    sch = Scheduler(max_num_seqs=3, max_num_batched_tokens=7, pages=PageAllocator(8))
    seqs = [seq(f"s{i}", n) for i, n in enumerate((11, 5, 9))]
    for s in seqs:
        sch.add(s)
    steps = []
    while any(s.num_cached < len(s.prompt_token_ids) for s in seqs):
        plan = sch.schedule()
        assert sum(n for _, n in plan) <= 7 and plan
        steps.append(names(plan))
        advance(plan)
    assert steps[0] == [("s0", 7)]
    assert steps[1] == [("s0", 4), ("s1", 3)]
    assert steps[2] == [("s0", 1), ("s1", 2), ("s2", 4)]
    assert steps[3] == [("s0", 1), ("s1", 1), ("s2", 5)]


def test_budget_must_cover_a_decode_step():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(max_num_seqs=4, max_num_batched_tokens=3, pages=PageAllocator(8))


def test_waiting_request_can_be_dropped():
    sch = Scheduler(max_num_seqs=1, max_num_batched_tokens=8, pages=PageAllocator(8))
    a, b = seq("a", 3), seq("b", 3)
    sch.add(a)
    sch.add(b)
    sch.schedule()
    sch.finish(b)                                         # aborted while waiting: never admitted
    assert list(sch.waiting) == [] and b.slot is None and a.slot == 0


def test_admission_takes_pages_for_all_its_tokens_and_finish_returns_them():
    pages = PageAllocator(4)
    sch = Scheduler(max_num_seqs=3, max_num_batched_tokens=600, pages=pages)
    a, b, c = seq("a", 300), seq("b", 10), seq("c", 600)
    for s in (a, b, c):
        sch.add(s)
    plan = sch.schedule()                                  # c needs 3 pages, 1 is free: it waits
    assert names(plan) == [("a", 300), ("b", 10)] and list(sch.waiting) == [c]
    assert (a.page_table.pages, b.page_table.pages, pages.num_free) == ([0, 1], [2], 1)
    advance(plan)
    sch.finish(a)
    assert a.page_table.pages == [] and pages.num_free == 3
    plan = sch.schedule()
    assert names(plan) == [("b", 1), ("c", 599)] and len(c.page_table) == 3


def test_out_of_pages_the_youngest_is_preempted_and_recomputes():
    pages = PageAllocator(3)
    sch = Scheduler(max_num_seqs=2, max_num_batched_tokens=1024, pages=pages)
    a, b = seq("a", 250), seq("b", 200)
    sch.add(a)
    sch.add(b)
    plan = sch.schedule()
    assert names(plan) == [("a", 250), ("b", 200)] and pages.num_free == 1
    advance(plan)
    for _ in range(6):                                     # a's positions 250-255 fit its page
        plan = sch.schedule()
        advance(plan)
    plan = sch.schedule()                                  # a takes the free page at position 256
    assert names(plan) == [("a", 1), ("b", 1)] and pages.num_free == 0
    for _ in range(56):                                    # b decodes to position 256: no page left, b yields
        advance(plan)
        plan = sch.schedule()
    assert names(plan) == [("a", 1)] and list(sch.waiting) == [b] and sch.num_preemptions == 1
    assert (b.slot, b.num_cached, b.page_table.pages, sch.vacated) == (None, 0, [], [1])
    assert len(b.tracker.token_ids) == 57                  # what b generated stays: it is recomputed, not lost
    advance(plan)
    plan = sch.schedule()                                  # b is back when its 257 tokens' 2 pages are free: not yet
    assert names(plan) == [("a", 1)]
    sch.finish(a)
    plan = sch.schedule()
    assert names(plan) == [("b", 257)] and b.num_tokens == 257


def test_an_older_sequence_out_of_pages_preempts_the_youngest():
    pages = PageAllocator(3)
    sch = Scheduler(max_num_seqs=2, max_num_batched_tokens=1024, pages=pages)
    a, b = seq("a", 500), seq("b", 10)
    sch.add(a)
    sch.add(b)
    plan = sch.schedule()
    assert names(plan) == [("a", 500), ("b", 10)] and pages.num_free == 0
    while not sch.num_preemptions:
        advance(plan)
        plan = sch.schedule()
    assert a.num_cached == 512 and names(plan) == [("a", 1)]   # a's position 512 opens its third page: b's
    assert b.slot is None and list(sch.waiting) == [b] and len(a.page_table) == 3


def test_chunk_feeds_the_prompt_then_the_generated_tokens_from_any_position():
    s = seq("a", 5)                                         # prompt 2..6
    s.tracker.token_ids.extend([100, 101, 102])
    whole = s.prompt_token_ids + s.tracker.token_ids
    for start in range(len(whole)):
        for n in range(1, len(whole) - start + 1):
            s.num_cached = start
            assert s.chunk(n) == whole[start:start + n], (start, n)
