"""`dsv4.LLM`, vLLM's offline API, on the built-in demo model (tiny V4 with the real 129,280-token vocabulary, NVFP4).

Greedy tokens are checked against an independent path: repeated argmax over the stateless prefill logits
(which test_load_transformers.py checks against transformers); text against the tokenizer's own decode.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckpt_fixtures as fx
import dsv4
import runtime_fixtures as rf
from dsv4.runtime.chat import encode_messages
from dsv4.runtime.demo import DEMO_FOLDER
from dsv4.runtime.engine import RequestError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def llm():
    return dsv4.LLM(rf.demo_root() / DEMO_FOLDER, progress=False)


def greedy_by_prefill(model, ids: list[int], n: int, vocab: int) -> list[int]:
    ids = list(ids)
    for _ in range(n):
        ids.append(int(model.logits(torch.tensor([ids]))[0, -1, :vocab].argmax()))
    return ids[-n:]


def test_prompt_forms_and_outputs(llm):
    tok = llm.get_tokenizer()
    assert tok.vocab_size == llm.model.config.vocab_size == 129280
    text = "DeepSeek-V4 is"
    ids = [tok.bos_id, *tok.encode(text)]
    greedy = dsv4.SamplingParams(temperature=0, max_tokens=6)
    outs = llm.generate([text, ids, {"prompt_token_ids": ids}, {"prompt": text}], greedy)
    assert [o.prompt for o in outs] == [text, None, None, text]
    assert outs[0].prompt_token_ids == tok.encode(text) == ids[1:]          # as in vLLM: no implicit BOS
    assert outs[1].prompt_token_ids == outs[2].prompt_token_ids == ids
    want = greedy_by_prefill(llm.model, ids, 6, tok.vocab_size)
    for o in outs[1:3]:
        c = o.outputs[0]
        assert c.token_ids == want and c.finish_reason == "length" and o.finished
        assert c.text == tok.decode(want, skip_special_tokens=True)
    assert outs[0].outputs[0].token_ids == outs[3].outputs[0].token_ids
    # one prompt (not in a list) and a flat token list are single prompts
    assert len(llm.generate(text, greedy)) == 1 and len(llm.generate(ids, greedy)) == 1
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate([ids, ids, ids], [greedy, greedy])


def test_stop_string_and_streaming(llm):
    greedy = dsv4.SamplingParams(temperature=0, max_tokens=12)
    text = llm.generate("Hello", greedy)[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = llm.generate("Hello", dsv4.SamplingParams(temperature=0, max_tokens=12, stop=[stop]))[0].outputs[0]
    assert cut.text == text[:text.index(stop)] and cut.finish_reason == "stop" and cut.stop_reason == stop

    sampled = dsv4.SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=10)
    stream = llm.stream("Hello", sampled)
    pieces = []
    while True:
        try:
            pieces.append(next(stream))
        except StopIteration as end:
            final = end.value
            break
    assert len(pieces) > 1 and "".join(pieces) == final.outputs[0].text
    assert final.outputs[0].token_ids == llm.generate("Hello", sampled)[0].outputs[0].token_ids


def test_chat(llm):
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    params = dsv4.SamplingParams(temperature=0, max_tokens=5)
    one = llm.chat(conv, params)
    assert len(one) == 1 and one[0].prompt == encode_messages(conv)
    assert one[0].prompt_token_ids[0] == llm.get_tokenizer().bos_id
    longer = conv + [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "?"}]
    two = llm.chat([conv, longer], params, thinking=True)
    assert [o.prompt for o in two] == [encode_messages(conv, thinking=True), encode_messages(longer, thinking=True)]
    assert two[0].prompt.endswith("<think>") and all(len(o.outputs[0].token_ids) == 5 for o in two)


def test_token_ids_only_and_dtype():
    llm = dsv4.LLM(fx.tiny(), skip_tokenizer_init=True, dtype="bfloat16", progress=False, max_model_len=256)
    assert llm.get_tokenizer() is None and llm.model.embed.weight.dtype == torch.bfloat16
    out = llm.generate([[5, 6, 7]], dsv4.SamplingParams(temperature=0, max_tokens=4))[0].outputs[0]
    assert len(out.token_ids) == 4 and out.text == ""
    with pytest.raises(RequestError, match="text prompts need a tokenizer"):
        llm.generate("hello")
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        dsv4.LLM(fx.tiny(), dtype="fp8", skip_tokenizer_init=True, progress=False)


def test_bad_input_is_refused_before_it_runs_and_the_engine_stays_as_it_was(llm):
    """Every case of issue 36 section 2, then a normal request: its greedy tokens are unchanged (oracle: repeated
    argmax over the stateless prefill)."""
    np = pytest.importorskip("numpy")
    SP = dsv4.SamplingParams
    greedy = SP(temperature=0, max_tokens=4)
    ids = [0, 19923, 4]
    refused = [   # (a call, error type, what the message must name)
        (lambda: SP(top_k=True), TypeError, "SamplingParams.top_k"),
        (lambda: SP(temperature=float("inf")), ValueError, "SamplingParams.temperature"),
        (lambda: SP(temperature="0.5"), TypeError, "SamplingParams.temperature"),
        (lambda: SP(top_p=float("nan")), ValueError, "SamplingParams.top_p"),
        (lambda: SP(max_tokens=0), ValueError, "SamplingParams.max_tokens"),
        (lambda: SP(seed=2**70), ValueError, "SamplingParams.seed"),
        (lambda: llm.generate(ids, SP(logprobs=10**9)), ValueError, "logprobs=1000000000 is more than this "
                                                                    "engine's max_logprobs=20"),
        (lambda: llm.generate(ids, SP(stop_token_ids=[129280])), ValueError,
         r"stop_token_ids \[129280\] are outside the vocabulary \[0, 129280\)"),
        (lambda: llm.generate(b"hello", greedy), TypeError, "prompts is bytes"),
        (lambda: llm.generate([True, False], greedy), TypeError, r"prompts\[0\] must be integers: \[0\] is bool"),
        (lambda: llm.generate(None, greedy), TypeError, "prompts must be a string, a list of token ids"),
        (lambda: llm.generate(5, greedy), TypeError, "prompts must be a string, a list of token ids"),
        (lambda: llm.generate({"prompt": None}, greedy), TypeError, r"prompts\[0\]\['prompt'\] must be a string"),
        (lambda: llm.generate({"promt": "hi"}, greedy), ValueError, "a prompt dict takes 'prompt_token_ids'"),
        (lambda: llm.generate([1.0, 2.0], greedy), TypeError, r"prompts\[0\] must be integers: \[0\] is float"),
        (lambda: llm.generate(np.array([1.0, 2.0]), greedy), TypeError, "must be a 1-D array of integer token ids"),
        (lambda: llm.generate([ids, [3, None]], greedy), TypeError, r"prompts\[1\] must be integers: \[1\]"),
        (lambda: llm.generate([ids, "text", 7], greedy), TypeError, "prompts mixes numbers with other things"),
        (lambda: llm.generate(ids, {"temperature": 0}), TypeError, r"sampling_params must be a SamplingParams .*"
                                                                    r"SamplingParams\(\*\*params\)"),
        (lambda: llm.generate([ids, ids], [greedy, None]), TypeError, "sampling_params must be a SamplingParams"),
        (lambda: llm.generate([ids, [0, 200000]], greedy), ValueError, r"prompts\[1\]: token ids \[200000\] are "
                                                                        "outside the model's vocabulary"),
        (lambda: list(llm.stream(ids, {"max_tokens": 3})), TypeError, "sampling_params must be a SamplingParams"),
    ]
    for call, error, message in refused:
        with pytest.raises(error, match=message):
            call()
        assert not llm.engine.has_unfinished() and len(llm.engine.scheduler.free_slots) == 8
    mutated = SP(temperature=0, max_tokens=4)
    mutated.max_tokens = 0                        # changed after construction: the engine checks it again
    with pytest.raises(ValueError, match="SamplingParams.max_tokens"):
        llm.generate(ids, mutated)
    want = greedy_by_prefill(llm.model, ids, 4, llm.get_tokenizer().vocab_size)
    # The forms vLLM accepts, and a 1-D array / tensor of ids as one prompt (a 2-D one as a batch of rows).
    for prompt in (ids, tuple(ids), np.array(ids), torch.tensor(ids), [np.int64(i) for i in ids],
                   {"prompt_token_ids": np.array(ids, dtype=np.int32)}):
        outs = llm.generate(prompt, greedy)
        assert len(outs) == 1 and outs[0].outputs[0].token_ids == want and outs[0].prompt_token_ids == ids
    outs = llm.generate(np.array([ids, ids]), greedy)
    assert [o.outputs[0].token_ids for o in outs] == [want, want]


def test_import_stays_light_and_llm_is_exported():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    probe = "import sys, dsv4; print('torch' in sys.modules, 'LLM' in dsv4.__all__)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=ROOT)
    assert done.stdout.split() == ["False", "True"], done.stderr


def test_a_stop_string_found_while_the_next_step_runs_drops_that_steps_token(llm):
    """The stop string is seen when its token renders, while the next step already computes a row for the sequence:
    that row's token is dropped, the sequence ends as if it had stopped at once, and a request beside it gets the
    tokens it gets alone; afterwards every slot and page is free."""
    greedy = dsv4.SamplingParams(temperature=0, max_tokens=12)
    text = llm.generate("Hello", greedy)[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    beside = dsv4.SamplingParams(temperature=0.9, seed=4, max_tokens=16, ignore_eos=True)
    alone = llm.generate("Bonjour", beside)[0].outputs[0].token_ids
    engine = llm.engine
    plans, schedule = [], engine.scheduler.schedule

    def recording():
        plan = schedule()
        plans.append([s.request_id for s, _ in plan])
        return plan
    engine.scheduler.schedule = recording
    try:
        outs = llm.generate(["Hello", "Bonjour"], [dsv4.SamplingParams(temperature=0, max_tokens=12, stop=[stop]),
                                                   beside], use_tqdm=False)
    finally:
        del engine.scheduler.schedule
    cut = outs[0].outputs[0]
    assert cut.text == text[:text.index(stop)] and cut.finish_reason == "stop" and cut.stop_reason == stop
    stopped = outs[0].request_id
    assert sum(stopped in p for p in plans) == len(cut.token_ids) + 1   # one more step ran it: its token dropped
    assert outs[1].outputs[0].token_ids == alone
    assert len(engine.scheduler.free_slots) == engine.cache.num_slots
    assert engine.scheduler.pages.num_free == engine.cache.num_pages
