"""A failed request never breaks the engine: faults injected into one request's work (sampling, detokenization,
its callback) and into the model step (a layer's forward, the head, a KeyboardInterrupt mid-forward), then the
same engine must give every other request, and every new one, exactly the tokens a fresh engine gives.

The oracle for "the tokens it would have had" is a fresh Engine running the request alone (greedy, or seeded
sampling, whose tokens do not depend on the batch: test_runtime_engine.py checks that against itself and
transformers' generate).

Tiny model layers: 0, 1 sliding; 2 CSA (ratio 4, with the Ca half `prev` state); 3 HCA (ratio 128); 4 CSA.
An interrupt raised at layer 3 leaves layer 2's state already written for the step's tokens.
"""

import pytest
import torch

import dsv4
import runtime_fixtures as rf
from dsv4.runtime import engine as engine_module
from dsv4.runtime.engine import Engine
from dsv4.runtime.params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=11, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return dsv4.load(rf.variant("wide"))


@pytest.fixture(scope="module")
def alone(model):
    """Tokens of (prompt seed, params) run alone on a fresh engine, memoised."""
    memo = {}

    def run(seed: int, params: SamplingParams, n: int = 9) -> list[int]:
        key = (seed, n, repr(params))
        if key not in memo:
            engine = Engine(model, max_num_seqs=1)
            seq = engine.add_request(rf.prompt_ids(n, seed=seed), params)
            while engine.has_unfinished():
                engine.step()
            memo[key] = seq.tracker.token_ids
        return memo[key]
    return run


def add(engine, seed, params, n=9, **kw):
    return engine.add_request(rf.prompt_ids(n, seed=seed), params, **kw)


def drain(engine):
    while engine.has_unfinished():
        engine.step()


def assert_engine_clean(engine):
    """No request left behind, every slot and page free, every free slot reset (no previous window in the CSA
    state)."""
    assert not engine.has_unfinished() and not engine._live
    assert sorted(engine.scheduler.free_slots) == list(range(engine.cache.num_slots))
    assert engine.scheduler.pages.num_free == engine.cache.num_pages
    for name, pool in engine.cache.pools.items():
        if name.endswith("prev_score"):
            assert torch.all(pool == float("-inf")), name


def then_new_requests_match(engine, alone):
    """After a fault: new greedy and seeded requests, together, get exactly their tokens alone."""
    a, b = add(engine, 30, GREEDY), add(engine, 31, SEEDED)
    drain(engine)
    assert a.tracker.token_ids == alone(30, GREEDY) and a.output().outputs[0].finish_reason == "length"
    assert b.tracker.token_ids == alone(31, SEEDED)
    assert_engine_clean(engine)


# ------------------------------------------------------------------ one request's own work fails
@pytest.mark.parametrize("after_draw", [False, True], ids=["before-draw", "after-draw"])
def test_sampler_fault_ends_only_its_request(model, alone, monkeypatch, after_draw):
    engine = Engine(model, max_num_seqs=3)
    a, b = add(engine, 1, GREEDY), add(engine, 2, SEEDED)
    bad = add(engine, 3, SamplingParams(temperature=0.7, seed=5, max_tokens=10, ignore_eos=True))
    real_sample, calls = engine_module.sample, []

    def faulty(logits, batch):
        # The failing request's third token raises; after_draw: only once every row has drawn, so the others'
        # retries must make the same draws (seed, counter) again.
        mine = bad.params.seed in batch.seeds.tolist()
        calls.append(mine)
        out = real_sample(logits, batch) if after_draw else None
        if mine and bad.tracker.num_sampled == 2:
            raise RuntimeError("injected sampler fault")
        return out if after_draw else real_sample(logits, batch)

    monkeypatch.setattr(engine_module, "sample", faulty)
    drain(engine)
    out = bad.output().outputs[0]
    assert (out.finish_reason, len(out.token_ids)) == ("error", 2)
    assert "RuntimeError: injected sampler fault" in out.error
    assert a.tracker.token_ids == alone(1, GREEDY) and b.tracker.token_ids == alone(2, SEEDED)
    assert [o.outputs[0].finish_reason for o in (a.output(), b.output())] == ["length", "length"]
    assert calls.count(True) > 3          # the batch, then the per-request retries, were really exercised
    assert_engine_clean(engine)
    then_new_requests_match(engine, alone)


def test_detokenizer_fault_ends_only_its_request(model, alone):
    class FailingDetokenizer:
        def __init__(self, ok: int):
            self.ok = ok

        def push(self, token_id):
            self.ok -= 1
            if self.ok < 0:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
            return ""

        def flush(self):
            return ""

    engine = Engine(model, max_num_seqs=3)
    a, bad, b = add(engine, 1, GREEDY), add(engine, 4, GREEDY), add(engine, 2, SEEDED)
    bad.tracker._detok = FailingDetokenizer(ok=3)
    drain(engine)
    out = bad.output().outputs[0]
    assert out.finish_reason == "error" and "UnicodeDecodeError" in out.error and len(out.token_ids) == 4
    assert a.tracker.token_ids == alone(1, GREEDY) and b.tracker.token_ids == alone(2, SEEDED)
    assert_engine_clean(engine)
    then_new_requests_match(engine, alone)


def test_callback_fault_ends_only_its_request(model, alone):
    seen = []

    def callback(seq):
        seen.append(seq.request_id)
        if len(seq.tracker.token_ids) == 5:
            raise ConnectionError("client went away")

    engine = Engine(model, max_num_seqs=3)
    a = add(engine, 1, GREEDY, on_output=lambda s: seen.append(s.request_id))
    bad, b = add(engine, 4, GREEDY, on_output=callback), add(engine, 2, SEEDED)
    drain(engine)
    out = bad.output().outputs[0]
    assert out.finish_reason == "error" and "ConnectionError: client went away" in out.error
    assert out.token_ids == alone(4, GREEDY)[:5]
    assert seen.count(a.request_id) == 10 and seen.count(bad.request_id) == 5
    assert a.tracker.token_ids == alone(1, GREEDY) and b.tracker.token_ids == alone(2, SEEDED)
    assert_engine_clean(engine)
    then_new_requests_match(engine, alone)


# ------------------------------------------------------------------ the model step fails
def fail_on_call(monkeypatch, target, name, at: int, error: BaseException):
    """Make target.name raise `error` on its at-th call (once), else behave as before."""
    real, calls = getattr(target, name), [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at:
            raise error
        return real(*args, **kwargs)
    monkeypatch.setattr(target, name, wrapper)


@pytest.mark.parametrize("where", ["layer", "head"])
def test_model_fault_ends_the_steps_requests_and_the_engine_goes_on(model, alone, monkeypatch, where):
    engine = Engine(model, max_num_seqs=2)
    a, b = add(engine, 1, GREEDY), add(engine, 2, SEEDED)
    waiting = add(engine, 5, SEEDED)                         # no free slot yet: waits beside the failure
    if where == "layer":
        fail_on_call(monkeypatch, model.layers[3].attn, "forward", at=4, error=RuntimeError("injected layer fault"))
    else:
        fail_on_call(monkeypatch, model, "head_logits", at=4, error=RuntimeError("injected head fault"))
    failed = []
    while not failed:
        failed = [s for s in engine.step() if s.finished]
    assert set(failed) == {a, b}
    for s in failed:
        out = s.output().outputs[0]
        assert out.finish_reason == "error" and f"injected {where} fault" in out.error
    assert a.tracker.token_ids == alone(1, GREEDY)[:3] and b.tracker.token_ids == alone(2, SEEDED)[:3]
    drain(engine)
    assert waiting.tracker.token_ids == alone(5, SEEDED)
    assert_engine_clean(engine)
    then_new_requests_match(engine, alone)


def test_interrupt_mid_forward_aborts_the_step_and_the_engine_goes_on(model, alone, monkeypatch):
    engine = Engine(model, max_num_seqs=2, max_num_batched_tokens=4)
    a = add(engine, 1, GREEDY, n=3)
    b = add(engine, 2, SEEDED, n=14)                         # mid-prefill (chunks of 3) when interrupted
    waiting = add(engine, 5, GREEDY)
    # Layer 3's 2nd call: a's first decode token (position 3) and b's prompt positions 1-3 each complete a
    # ratio-4 window, so CSA layer 2 has already pooled them and replaced its `prev` state when the interrupt comes.
    fail_on_call(monkeypatch, model.layers[3].attn, "forward", at=2, error=KeyboardInterrupt())
    engine.step()
    assert b.num_cached == 1 and len(a.tracker.token_ids) == 1
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    for s in (a, b):
        out = s.output().outputs[0]
        assert out.finish_reason == "abort" and out.error == "KeyboardInterrupt: "
    assert not waiting.finished
    drain(engine)
    assert waiting.tracker.token_ids == alone(5, GREEDY)
    assert_engine_clean(engine)
    then_new_requests_match(engine, alone)


def test_an_error_in_the_engine_itself_ends_the_step_and_propagates(model, alone, monkeypatch):
    engine = Engine(model, max_num_seqs=2)
    a = add(engine, 1, GREEDY)
    def broken(*args):
        raise ValueError("bug")
    monkeypatch.setattr(engine_module.SeqBatch, "positions", broken)
    with pytest.raises(ValueError, match="bug"):
        engine.step()
    assert a.output().outputs[0].finish_reason == "error"
    monkeypatch.undo()
    assert_engine_clean(engine)
    then_new_requests_match(engine, alone)


# ------------------------------------------------------------------ through dsv4.LLM
@pytest.fixture(scope="module")
def llm():
    from dsv4.runtime.demo import DEMO_FOLDER

    return dsv4.LLM(rf.demo_root() / DEMO_FOLDER, progress=False)


def test_llm_reports_a_failed_request_and_interrupts_leave_nothing_behind(llm, monkeypatch):
    greedy = dsv4.SamplingParams(temperature=0, max_tokens=6)
    prompts = [[1, 5, 9], [1, 7, 7, 7]]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    real_sample = engine_module.sample

    def faulty(logits, batch):
        if bool((batch.temperature == 0.5).any()):
            raise RuntimeError("injected")
        return real_sample(logits, batch)
    monkeypatch.setattr(engine_module, "sample", faulty)
    bad = dsv4.SamplingParams(temperature=0.5, max_tokens=6)
    outs = llm.generate(prompts + [[1, 2]], [greedy, greedy, bad], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:2]] == want
    assert outs[2].outputs[0].finish_reason == "error" and "injected" in outs[2].outputs[0].error
    with pytest.raises(dsv4.RequestFailed, match="injected"):
        list(llm.stream([1, 2], bad))
    monkeypatch.undo()

    fail_on_call(monkeypatch, llm.model.layers[1], "forward", at=3, error=KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, greedy, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    monkeypatch.undo()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == want
