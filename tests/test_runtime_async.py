"""Async scheduling (`Engine(async_scheduling=True)`): a decode step of the runner launches the next one before its
tokens are read back, fed with them on the device. On the CPU the runner runs uncaptured in the CUDA layout (one
more cache slot for the padding rows), and every request must get exactly the tokens, log-probabilities and finish
reasons it gets with async scheduling off: sequences that end by count (max_tokens, max_model_len) leave the step
ahead, a sequence that a stop token ends keeps a row there that is dropped, requests wait for a slot and arrive or
are aborted mid-run, sampling is seeded, unseeded and filtered. Failures: reading a batch's tokens back failing
after the step ahead launched recomputes the step's sequences (the same tokens); the step ahead's launch failing
ends its sequences with "error" as a failed step does, and the engine goes on."""

import logging

import pytest
import torch

import dsv4
import runtime_fixtures as rf
from dsv4.runtime import sampler as sampler_module
from dsv4.runtime.cache import KVCache
from dsv4.runtime.engine import Engine
from dsv4.runtime.graphs import DecodeGraphs
from dsv4.runtime.params import SamplingParams

MAX_LEN, SLOTS, PAGES = 320, 3, 8


@pytest.fixture(scope="module")
def model():
    return dsv4.load(rf.variant("wide"))


def runner_engine(model, async_scheduling: bool, pages: int = PAGES) -> Engine:
    torch.manual_seed(0)                          # the engine's seed for unseeded requests
    engine = Engine(model, max_num_seqs=SLOTS, max_model_len=MAX_LEN, num_cache_pages=pages,
                    max_num_batched_tokens=64, async_scheduling=async_scheduling)
    engine.cache = KVCache(model.config, SLOTS + 1, pages, torch.float32)
    engine.graphs = DecodeGraphs(model, engine.cache.layers, SLOTS, MAX_LEN, pad_slot=SLOTS, capture=False,
                                 lengths=[MAX_LEN])
    return engine


def launches(engine: Engine) -> list[tuple[int, bool]]:
    """(rows, launched ahead) of each step the runner runs from now on."""
    out, replay = [], engine.graphs.replay
    engine.graphs.replay = lambda step, ids=None: out.append((len(step.ids), ids is not None)) or replay(step, ids)
    return out


def run(engine: Engine, requests, arrivals=(), aborts=()) -> dict[str, tuple]:
    """Every request to its end -> {id: (token ids, finish reason, logprobs)}. arrivals: (call, prompt, params)
    added before that step() call; aborts: (call, request id) aborted before it."""
    seqs = {str(i): engine.add_request(p, params, request_id=str(i)) for i, (p, params) in enumerate(requests)}
    call = 0
    while engine.has_unfinished() or any(c >= call for c, *_ in arrivals):
        for c, prompt, params in arrivals:
            if c == call:
                rid = str(len(seqs))
                seqs[rid] = engine.add_request(prompt, params, request_id=rid)
        for c, rid in aborts:
            if c == call:
                engine.abort(rid)
        engine.step()
        call += 1
    return {rid: (list(s.tracker.token_ids), s.tracker.finish_reason, s.tracker.logprobs) for rid, s in seqs.items()}


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def test_async_steps_sample_exactly_as_without(model):
    """Batches that are the same either way (every end known a step ahead; the waiting request is admitted when
    one ends by count): seeded, unseeded and filtered draws and log-probabilities are equal bit for bit."""
    prompts = [rf.prompt_ids(n, seed=70 + i) for i, n in enumerate((5, 300, 130, 9))]
    requests = [
        (prompts[0], SamplingParams(temperature=1.0, top_k=20, top_p=0.9, max_tokens=12)),   # unseeded, filtered
        (prompts[1], greedy(None)),                                           # ends at max_model_len
        (prompts[2], SamplingParams(temperature=0.8, seed=7, max_tokens=30, logprobs=2)),    # seeded
        (prompts[3], SamplingParams(temperature=0.7, min_p=0.1, seed=3, max_tokens=16)),     # waits for a slot
    ]
    want = run(runner_engine(model, False), requests)
    engine = runner_engine(model, True)
    steps = launches(engine)
    assert run(engine, requests) == want
    assert want["1"][1] == "length" and want["2"][2] is not None
    assert sum(a for _, a in steps) > len(steps) // 2      # most decode steps were launched ahead


def test_ends_arrivals_and_aborts_give_the_same_tokens(model):
    """A stop token ends a sequence a step after its row in the next step launched (the row is dropped, and a
    waiting request is admitted a step later); requests arrive and one is aborted mid-run. Greedy requests get the
    same tokens and finish reasons (the batches around such steps differ, so only greedy ones are compared)."""
    prompts = [rf.prompt_ids(n, seed=70 + i) for i, n in enumerate((5, 40, 130, 9, 17))]
    # a token that request 1 samples mid-way (with nothing stopping it) ends it there unpredictably
    probe = run(runner_engine(model, False), [(prompts[1], greedy(30))])["0"][0]
    stop_id = probe[12]
    requests = [(prompts[0], greedy(25)), (prompts[1], greedy(30, stop_token_ids=[stop_id])),
                (prompts[2], greedy(30)), (prompts[3], greedy(20)), (prompts[4], greedy(16))]
    arrivals = [(6, rf.prompt_ids(12, seed=90), greedy(14)), (11, rf.prompt_ids(3, seed=91), greedy(9))]
    aborts = [(18, "2")]                                   # running since the first step either way
    want = run(runner_engine(model, False), requests, arrivals, aborts)
    engine = runner_engine(model, True)
    dropped, take = [], engine._take_ahead

    def taking():
        ahead = engine._ahead
        if ahead is not None:
            dropped.append(sum(s.finished for s in ahead.seqs))
        return take()
    engine._take_ahead = taking
    assert run(engine, requests, arrivals, aborts) == want
    assert want["1"][1] == "stop" and len(want["1"][0]) == probe.index(stop_id) + 1 and want["2"][1] == "abort"
    assert sum(dropped) >= 1                               # the stop token's row (or the abort's) was dropped


def test_a_full_pool_preempts_the_same_way(model):
    """Four pages of 256 positions for three sequences that grow past them: the youngest is preempted and
    recomputes, with async scheduling as without; while it waits for pages (with a slot free) the others' steps
    still launch ahead."""
    prompts = [rf.prompt_ids(n, seed=80 + i) for i, n in enumerate((250, 200, 240))]
    requests = [(p, greedy(60)) for p in prompts]
    plain = runner_engine(model, False, pages=4)
    want = run(plain, requests)
    engine = runner_engine(model, True, pages=4)
    waiting_ahead, replay = [], engine.graphs.replay
    engine.graphs.replay = lambda step, ids=None: (waiting_ahead.append(ids is not None and
                                                                        bool(engine.scheduler.waiting))
                                                   or replay(step, ids))
    assert run(engine, requests) == want
    assert engine.scheduler.num_preemptions == plain.scheduler.num_preemptions > 0
    assert any(waiting_ahead)


def test_a_failed_read_after_the_step_ahead_recomputes_the_step(model, monkeypatch, caplog):
    prompts = [rf.prompt_ids(n, seed=100 + i) for i, n in enumerate((6, 20))]
    requests = [(p, greedy(20)) for p in prompts]
    want = run(runner_engine(model, False), requests)
    engine = runner_engine(model, True)
    steps = launches(engine)
    calls, original = [], sampler_module.SamplerOutput.host_logprobs

    def failing_once(self, params):
        calls.append(1)
        if len(calls) == 8:
            raise RuntimeError("injected read fault")
        return original(self, params)
    monkeypatch.setattr(sampler_module.SamplerOutput, "host_logprobs", failing_once)
    with caplog.at_level(logging.WARNING, logger="dsv4.runtime.engine"):
        got = run(engine, requests)
    assert got == want
    assert "injected read fault" in caplog.text and "recompute" in caplog.text
    assert engine.scheduler.num_preemptions == 2 and any(a for _, a in steps)


def test_a_failed_launch_ahead_ends_its_requests_and_the_engine_goes_on(model, caplog):
    prompts = [rf.prompt_ids(n, seed=110 + i) for i, n in enumerate((6, 20))]
    engine = runner_engine(model, True)
    replay, ahead_calls = engine.graphs.replay, []

    def failing(step, ids=None):
        if ids is not None:
            ahead_calls.append(1)
            if len(ahead_calls) == 3:
                raise RuntimeError("injected launch fault")
        return replay(step, ids)
    engine.graphs.replay = failing
    with caplog.at_level(logging.ERROR, logger="dsv4.runtime.engine"):
        failed = run(engine, [(p, greedy(20)) for p in prompts])
    for tokens, reason, _ in failed.values():
        assert reason == "error" and 0 < len(tokens) < 20
    assert "injected launch fault" in caplog.text
    # the engine goes on: a new request gets the tokens a fresh engine gives it
    request = [(rf.prompt_ids(9, seed=120), greedy(12))]
    assert list(run(engine, request).values())[0] == list(run(runner_engine(model, False), request).values())[0]
