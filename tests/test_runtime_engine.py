"""The engine (scheduler + KVCache + sampler) against transformers' cached greedy `generate` on the same weights.

transformers' batched generate pads on the left, and its V4 compressors pool the pad tokens into their
windows, so each sequence is compared with transformers running it alone; the engine runs them all as one
ragged, continuously batched workload: fewer cache slots than requests (later ones join while others
decode), and a per-step token budget that splits long prompts into chunks mixed with decode tokens.
"""

import pytest
import torch

import dsv4
import runtime_fixtures as rf
from dsv4.config import ModelConfig
from dsv4.runtime.cache import CacheCapacityError, KVCache
from dsv4.runtime.engine import Engine, RequestError
from dsv4.runtime.params import SamplingParams

pytest.importorskip("transformers")
LENGTHS = (100, 127, 129, 200, 255, 257)      # around the window / HCA boundaries 128 and 256
NEW = 24                                       # 127 + 24 and 255 + 24 cross a boundary while decoding


@pytest.fixture(scope="module")
def prompts():
    return [rf.prompt_ids(n, seed=20 + i) for i, n in enumerate(LENGTHS)]


def hf_generate(name, prompts):
    import transformers
    from transformers import DeepseekV4ForCausalLM, GenerationConfig

    transformers.logging.set_verbosity_error()
    hf = DeepseekV4ForCausalLM.from_pretrained(rf.variant(name), dtype=torch.float32).eval()
    gc = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=None, use_cache=True)
    out = []
    for p in prompts:
        res = hf.generate(torch.tensor([p]), generation_config=gc, return_dict_in_generate=True, output_logits=True)
        tokens = res.sequences[0, len(p):].tolist()
        logprobs = [float(lg[0].float().log_softmax(-1)[t]) for lg, t in zip(res.logits, tokens)]
        out.append((tokens, logprobs))
    return out


def run(engine, prompts, params):
    """All requests through the engine; returns the outputs and the step plans (seq index, tokens, prefill?)."""
    seqs = [engine.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(prompts)]
    plans, schedule = [], engine.scheduler.schedule

    def recording():
        plan = schedule()
        plans.append([(seqs.index(s), n, s.num_cached < len(s.prompt_token_ids)) for s, n in plan])
        return plan
    engine.scheduler.schedule = recording
    while engine.has_unfinished():
        engine.step()
    return [s.output() for s in seqs], plans


@pytest.mark.parametrize("name", ["wide", "sharp"])
def test_greedy_ragged_batch_matches_transformers(name, prompts):
    model = dsv4.load(rf.variant(name))
    engine = Engine(model, max_num_seqs=4, max_num_batched_tokens=200)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=0)
    outs, plans = run(engine, prompts, params)
    # The workload really was ragged and continuous: a prompt was split, a prefill chunk ran in the same step
    # as decodes, and a request was admitted after others had started decoding.
    assert any(n < LENGTHS[i] and pre for plan in plans for i, n, pre in plan if n > 1)
    assert any(any(pre for _, _, pre in plan) and any(not pre for _, _, pre in plan) for plan in plans)
    first_decode = next(k for k, plan in enumerate(plans) if any(not pre for _, _, pre in plan))
    assert any(i in (4, 5) for plan in plans[first_decode + 1:] for i, _, _ in plan)
    assert sorted(engine.scheduler.free_slots) == [0, 1, 2, 3] and not engine.scheduler.running

    worst = 0.0
    for out, (tokens, logprobs) in zip(outs, hf_generate(name, prompts)):
        c = out.outputs[0]
        assert c.token_ids == tokens, f"prompt of {len(out.prompt_token_ids)} tokens"
        assert c.finish_reason == "length" and out.finished
        mine = [c.logprobs[k][t].logprob for k, t in enumerate(c.token_ids)]
        worst = max(worst, max(abs(a - b) for a, b in zip(mine, logprobs)))
    print(f"\n  {name}: {len(prompts)} x {NEW} greedy tokens equal transformers'; max |logprob diff| {worst:.1e}")
    assert worst < 1e-4


def finish_all(engine, prompts, params):
    seqs = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    while engine.has_unfinished():
        engine.step()
    return [s.output().outputs[0] for s in seqs]


def test_seeded_sampling_does_not_depend_on_the_batch(prompts):
    model = dsv4.load(rf.variant("wide"))
    seeded = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=7, max_tokens=12, ignore_eos=True)
    alone = finish_all(Engine(model, max_num_seqs=1), [prompts[1]], [seeded])[0]
    others = [SamplingParams(temperature=1.0, seed=s, max_tokens=5, ignore_eos=True) for s in (1, 2)]
    mixed = finish_all(Engine(model, max_num_seqs=3), [prompts[0], prompts[1], prompts[2]],
                       [others[0], seeded, others[1]])
    assert mixed[1].token_ids == alone.token_ids
    again = finish_all(Engine(model, max_num_seqs=1), [prompts[1]], [seeded])[0]
    assert again.token_ids == alone.token_ids
    other_seed = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=8, max_tokens=12, ignore_eos=True)
    assert finish_all(Engine(model, max_num_seqs=1), [prompts[1]], [other_seed])[0].token_ids != alone.token_ids


@pytest.fixture(scope="module")
def small_engine_model():
    return dsv4.load(rf.variant("wide"))


def test_requests_that_cannot_run_get_a_clear_error(small_engine_model):
    engine = Engine(small_engine_model, max_num_seqs=2, max_model_len=64)
    with pytest.raises(RequestError, match=r"request 'long': the prompt has 65 tokens, more than max_model_len=64"):
        engine.add_request(list(range(2, 67)), request_id="long")
    with pytest.raises(RequestError, match="request 'empty': the prompt is empty"):
        engine.add_request([], request_id="empty")
    with pytest.raises(RequestError, match=r"request 'oov': token ids \[600\] are outside the model's vocabulary"):
        engine.add_request([5, 600, 7], request_id="oov")
    with pytest.raises(RequestError, match="request 'floats': prompt token ids must be integers"):
        engine.add_request([5.0, 6.0], request_id="floats")
    with pytest.raises(RequestError, match="stop strings .* need a tokenizer"):
        engine.add_request([5, 6], SamplingParams(stop=["x"]))
    with pytest.raises(RequestError, match=r"request 'ids': prompt token ids must be integers: \[1\] is bool"):
        engine.add_request([5, True], request_id="ids")
    with pytest.raises(RequestError, match=r"stop_token_ids \[512\] are outside the vocabulary \[0, 512\)"):
        engine.add_request([5, 6], SamplingParams(stop_token_ids=[512]))
    with pytest.raises(RequestError, match="logprobs=21 is more than this engine's max_logprobs=20"):
        engine.add_request([5, 6], SamplingParams(logprobs=21))
    with pytest.raises(TypeError, match="params must be a SamplingParams, got dict"):
        engine.add_request([5, 6], {"max_tokens": 3})
    assert not engine.has_unfinished()
    engine.add_request([5, 6], request_id="twice")
    with pytest.raises(RequestError, match="request 'twice': a request with this id is already running or waiting"):
        engine.add_request([5, 6], request_id="twice")
    engine.abort("twice")
    assert not engine.has_unfinished()
    engine.add_request([5, 6], request_id="twice")              # its id is free again once it has ended
    with pytest.raises(ValueError, match="max_model_len 8192 exceeds the model's max_position_embeddings"):
        Engine(small_engine_model, max_model_len=8192)
    with pytest.raises(ValueError, match="max_num_batched_tokens .* must be >= max_num_seqs"):
        Engine(small_engine_model, max_num_seqs=8, max_num_batched_tokens=4)


def test_cache_that_cannot_fit_is_refused_before_allocating():
    with pytest.raises(CacheCapacityError, match=r"max_num_seqs=1000 and 4096000 pages of 256 tokens needs .* GiB"):
        KVCache(ModelConfig.flash(), 1000, 4096 * 1000, torch.bfloat16)


def test_max_model_len_ends_with_length_and_frees_the_slot(small_engine_model):
    engine = Engine(small_engine_model, max_num_seqs=1, max_model_len=40)
    outs = finish_all(engine, [rf.prompt_ids(30, seed=5), rf.prompt_ids(40, seed=6)],
                      [SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                       SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)])
    assert [len(o.token_ids) for o in outs] == [10, 1]       # a full-length prompt still gets one token
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert list(engine.scheduler.free_slots) == [0]


def test_abort_frees_the_slot_for_a_waiting_request(small_engine_model):
    engine = Engine(small_engine_model, max_num_seqs=1)
    a = engine.add_request(rf.prompt_ids(20, seed=1), SamplingParams(max_tokens=50), request_id="a")
    b = engine.add_request(rf.prompt_ids(20, seed=2), SamplingParams(max_tokens=3), request_id="b")
    engine.step()
    assert a.slot == 0 and b.slot is None and len(a.tracker.token_ids) == 1
    engine.abort("a")
    assert a.finished and a.output().outputs[0].finish_reason == "abort"
    while engine.has_unfinished():
        engine.step()
    assert b.output().outputs[0].finish_reason == "length" and len(b.tracker.token_ids) == 3


def test_a_full_cache_preempts_and_recomputes_with_unchanged_tokens(small_engine_model):
    """Four sequences whose generations outgrow a 4-page cache: the youngest are preempted and recomputed, and every
    one ends with the tokens it gets alone (greedy); afterwards every page is free."""
    prompts = [rf.prompt_ids(n, seed=40 + i) for i, n in enumerate((200, 150, 120, 60))]
    params = SamplingParams(temperature=0, max_tokens=90, ignore_eos=True)
    alone = [finish_all(Engine(small_engine_model, max_num_seqs=1), [p], [params])[0].token_ids for p in prompts]
    engine = Engine(small_engine_model, max_num_seqs=4, max_model_len=512, num_cache_pages=4)
    outs = finish_all(engine, prompts, [params] * 4)
    assert engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == alone
    assert engine.scheduler.pages.num_free == 4 and engine.cache_usage() == 0.0


def test_a_cache_smaller_than_one_sequence_is_refused(small_engine_model):
    with pytest.raises(CacheCapacityError, match=r"holds 1 pages of 256 tokens \(256 tokens\), fewer than one sequence "
                                                 "of max_model_len=512"):
        Engine(small_engine_model, max_model_len=512, num_cache_pages=1)


def test_a_steps_tokens_render_while_the_next_step_runs(small_engine_model):
    """Token k (k >= 2) is rendered, and its callback called, after the model forward of step k + 1 has been launched
    and before that step's token is accepted; the first token and the last (max_tokens) render at once. The
    while_running hook gets exactly the rendered sequences, and the outputs are those of a plain run."""
    engine = Engine(small_engine_model, max_num_seqs=2)
    events = []
    real_forward = engine.model.forward

    def forward(*args, **kwargs):
        events.append("forward")
        return real_forward(*args, **kwargs)
    engine.model.forward = forward
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    seq = engine.add_request(rf.prompt_ids(12, seed=3), params,
                             on_output=lambda s: events.append(("render", len(s.tracker.token_ids),
                                                                s.tracker.num_sampled)))
    hooked = []

    def while_running(rendered):
        hooked.append([(s.request_id, s.tracker.num_sampled) for s in rendered])
    try:
        while engine.has_unfinished():
            engine.step(while_running=while_running)
    finally:
        del engine.model.forward
    renders = [(i, e) for i, e in enumerate(events) if e != "forward"]
    forwards_before = [events[:i].count("forward") for i, _ in renders]
    assert [e[1] for _, e in renders] == [1, 2, 3, 4, 5]
    assert [e[2] for _, e in renders] == [1, 2, 3, 4, 5]   # rendered before the step's own token was accepted
    assert forwards_before == [1, 3, 4, 5, 5]               # token k >= 2 after step k + 1's forward; the last at once
    assert hooked == [[], [], [(seq.request_id, 2)], [(seq.request_id, 3)], [(seq.request_id, 4)]]
    alone = finish_all(Engine(small_engine_model, max_num_seqs=1), [rf.prompt_ids(12, seed=3)], [params])[0]
    assert seq.output().outputs[0].token_ids == alone.token_ids and alone.finish_reason == "length"


def test_abort_renders_the_token_taken_before_it(small_engine_model):
    engine = Engine(small_engine_model, max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    seq = engine.add_request(rf.prompt_ids(12, seed=4), params)
    engine.step()
    engine.step()
    assert (len(seq.tracker.token_ids), seq.tracker.num_sampled) == (1, 2)
    assert seq.output().outputs[0].token_ids == seq.tracker.token_ids          # a reader sees rendered tokens only
    engine.abort(seq.request_id)
    out = seq.output().outputs[0]
    assert out.finish_reason == "abort" and len(out.token_ids) == 2
    alone = finish_all(Engine(small_engine_model, max_num_seqs=1), [rf.prompt_ids(12, seed=4)], [params])[0]
    assert out.token_ids == alone.token_ids[:2]
    assert not engine.has_unfinished() and list(engine.scheduler.free_slots) == [0]


def test_the_sampling_batch_is_rebuilt_only_when_the_rows_change(small_engine_model):
    engine = Engine(small_engine_model, max_num_seqs=2)
    seeded = SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=6, ignore_eos=True)
    a = engine.add_request(rf.prompt_ids(12, seed=5), seeded)
    engine.step()                                        # a's prefill
    built = engine._sampling[1]
    engine.step()                                        # a decodes: same rows, same columns, new counters
    assert engine._sampling[1].temperature is built.temperature
    assert engine._sampling[1].counters.tolist() == [1]
    b = engine.add_request(rf.prompt_ids(9, seed=6), SamplingParams(temperature=0, max_tokens=3))
    engine.step()                                        # a decodes and b prefills: the rows changed
    assert engine._sampling[1].temperature is not built.temperature
    while engine.has_unfinished():
        engine.step()
    alone = finish_all(Engine(small_engine_model, max_num_seqs=1), [rf.prompt_ids(12, seed=5)], [seeded])[0]
    assert a.output().outputs[0].token_ids == alone.token_ids and b.finished


def test_fp8_indexer_cache_halves_its_keys_and_keeps_the_tokens(small_engine_model):
    """kv_cache_dtype="fp8-indexer": the indexer's keys as e4m3 codes with a power-of-two scale each. The "wide"
    variant's indexer picks every visible entry whatever the scores, so the tokens are those of the compute-dtype
    cache; the page holds the keys in a quarter of fp32's bytes plus a scale."""
    from dsv4.runtime.cache import page_bytes, pool_shapes

    cfg = small_engine_model.config
    shapes = pool_shapes(cfg, 1, 1, torch.float32, "fp8-indexer")
    assert shapes["indexer.r4.entries"][1] == torch.float8_e4m3fn and "indexer.r4.entry_scales" in shapes
    assert shapes["compressor.r4.entries"][1] == torch.float32
    keys = sum(cfg.compress_ratio(i) == 4 for i in range(cfg.num_hidden_layers)) * 256 // 4
    assert page_bytes(cfg, torch.float32) - page_bytes(cfg, torch.float32, "fp8-indexer") == \
        keys * (3 * cfg.index_head_dim - 4)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [rf.prompt_ids(n, seed=70 + n) for n in (9, 130, 257)]
    want = finish_all(Engine(small_engine_model, max_num_seqs=3), prompts, [params] * 3)
    engine = Engine(small_engine_model, max_num_seqs=3, kv_cache_dtype="fp8-indexer")
    got = finish_all(engine, prompts, [params] * 3)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    scales = engine.cache.pools["indexer.r4.entry_scales"]
    assert int((scales > 0).sum()) > 0 and engine.cache.layers[2].indexer.entry_scales is not None
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        Engine(small_engine_model, kv_cache_dtype="fp4")


def test_fp8_cache_packs_the_entries_and_keeps_deepseeks_rounding(small_engine_model):
    """kv_cache_dtype="fp8": the compressed entries as packed fp8 rows, the K = V rows rounded to their values. The
    engine's log-probabilities equal those of the cache-free prefill (dense masks, the compressor module) whose kv and
    compressed entries are rounded by `ref.fp8_kv_round` (an oracle that shares no cache, packing or paging code;
    the "wide" variant's indexer picks every entry, so its fp8 keys cannot move a pick); the same engine without the
    fp8 cache is measurably farther from that oracle, and the cache holds the entries in fewer bytes."""
    import dataclasses

    from dsv4.kernels import ref
    from dsv4.runtime.cache import page_bytes, pool_shapes

    cfg, model = small_engine_model.config, small_engine_model
    nope, row = cfg.nope_head_dim, ref.kv_row_bytes(cfg.head_dim, cfg.nope_head_dim)
    shapes = pool_shapes(cfg, 1, 1, torch.float32, "fp8")
    assert shapes["compressor.r4.entries"][0][2:] == (64, row) and shapes["compressor.r4.entries"][1] == torch.uint8
    assert page_bytes(cfg, torch.float32, "fp8") < page_bytes(cfg, torch.float32, "fp8-indexer")
    prompt, n = rf.prompt_ids(300, seed=11), 6
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)

    def run(**kw):
        engine = Engine(model, max_num_seqs=1, **kw)
        out = finish_all(engine, [prompt], [params])[0]
        return engine, out.token_ids, [next(iter(lp.values())).logprob for lp in out.logprobs]
    engine, tokens, logprobs = run(kv_cache_dtype="fp8")
    packed = engine.cache.pools["compressor.r4.entries"]
    csa_layers = sum(cfg.compress_ratio(i) == 4 for i in range(len(model.layers)))
    assert int(packed.any(-1).sum()) == (300 + n - 1) // 4 * csa_layers       # the tokens fed: all but the last
    assert not packed[..., row - 1].any()

    saved, hooks = [(layer.attn, layer.attn.ops) for layer in model.layers], []
    try:                                   # the oracle: the fresh prefill with the cache's rounding put in by hand
        for attn, ops in saved:
            def norm_ropes(*calls, _kv=attn.kv_norm.weight, _f=ops.norm_ropes):     # q_norm's and kv_norm's rows
                outs = _f(*calls)
                return tuple(ref.fp8_kv_round(out, nope) if call[3] is _kv else out for out, call in zip(outs, calls))
            attn.ops = dataclasses.replace(ops, norm_ropes=norm_ropes)
            if attn.compressor is not None:
                hooks.append(attn.compressor.register_forward_hook(lambda m, i, o: ref.fp8_kv_round(o, nope)))
        logits = model.logits(torch.tensor([prompt + tokens[:-1]]))[0, len(prompt) - 1:].float()
    finally:
        for attn, ops in saved:
            attn.ops = ops
        for h in hooks:
            h.remove()
    want = logits.log_softmax(-1)
    assert tokens == want.argmax(-1).tolist()
    got = torch.tensor(logprobs)
    chosen = want[torch.arange(n), torch.tensor(tokens)]
    assert torch.allclose(got, chosen, atol=1e-4)
    _, plain_tokens, plain_logprobs = run()
    assert plain_tokens != tokens or (torch.tensor(plain_logprobs) - chosen).abs().max() > 1e-3
