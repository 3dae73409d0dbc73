import random

import pytest

from dsv4.runtime.params import (CompletionOutput, IncrementalDetokenizer, Logprob, OutputTracker, RequestOutput,
                                 SamplingParams)
from dsv4.runtime.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_checkpoint(None)


class PieceTokenizer:
    """Token i is the text PIECES[i]; EOS = 99 (no text). Exact control over where tokens split strings."""
    PIECES = ["Hel", "lo", " <", "/ans", "wer>", "!", "b>", "Hello"]
    eos_id = 99

    def bytes_of(self, i, skip_special_tokens=False):
        return b"" if i == self.eos_id else self.PIECES[i].encode()

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.bytes_of(i).decode() for i in ids)


def run(params, ids, tokenizer=None):
    tracker = OutputTracker(params, tokenizer or PieceTokenizer())
    deltas = []
    for i in ids:
        done = tracker.append(i)
        deltas.append(tracker.take_delta())
        if done:
            break
    return tracker, deltas


# ------------------------------------------------------------------ SamplingParams
def test_sampling_params_normalize_and_validate():
    p = SamplingParams(stop="###", top_k=-1)
    assert (p.stop, p.stop_token_ids, p.top_k, p.max_tokens, p.temperature) == (["###"], [], 0, 16, 1.0)
    g = SamplingParams(temperature=0.0, top_p=0.5, top_k=5, min_p=0.1)
    assert g.greedy and (g.top_p, g.top_k, g.min_p) == (1.0, 0, 0.0)   # as vLLM: irrelevant for argmax
    for bad in [dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2), dict(min_p=2.0),
                dict(max_tokens=0), dict(logprobs=-1), dict(stop=[""]), dict(stop_token_ids=[-3])]:
        with pytest.raises(ValueError, match="SamplingParams"):
            SamplingParams(**bad)
    with pytest.raises(TypeError):  # an unsupported vLLM option is an error, not silently ignored
        SamplingParams(presence_penalty=1.0)


BAD_SAMPLING_PARAMS = [   # (arguments, error type, what the message must name)
    (dict(top_k=True), TypeError, r"SamplingParams.top_k must be an int .*got bool True"),
    (dict(top_k=2.0), TypeError, r"SamplingParams.top_k must be an int"),
    (dict(temperature=float("inf")), ValueError, r"SamplingParams.temperature must be in \[0, inf\).*got inf"),
    (dict(temperature="0.5"), TypeError, r"SamplingParams.temperature must be a number .*got str '0.5'"),
    (dict(temperature=None), TypeError, r"SamplingParams.temperature must be a number"),
    (dict(top_p=float("nan")), ValueError, r"SamplingParams.top_p must be in \(0, 1\], got nan"),
    (dict(min_p=float("-inf")), ValueError, r"SamplingParams.min_p must be in \[0, 1\]"),
    (dict(max_tokens=0), ValueError, r"SamplingParams.max_tokens must be None or >= 1, got 0"),
    (dict(max_tokens=True), TypeError, r"SamplingParams.max_tokens must be an int"),
    (dict(logprobs=-1), ValueError, r"SamplingParams.logprobs must be None or >= 0"),
    (dict(seed=2**70), ValueError, r"SamplingParams.seed must be None or an int in \[-9223372036854775808, "
                                   r"9223372036854775807\], got 1180591620717411303424"),
    (dict(seed=1.5), TypeError, r"SamplingParams.seed must be an int"),
    (dict(stop=b"x"), TypeError, r"SamplingParams.stop must be a non-empty string or a list of them"),
    (dict(stop=["ok", 3]), TypeError, r"SamplingParams.stop must be"),
    (dict(stop_token_ids=[1, True]), TypeError, r"SamplingParams.stop_token_ids must be integers: \[1\] is bool"),
    (dict(stop_token_ids=5), TypeError, r"SamplingParams.stop_token_ids must be a list of token ids"),
    (dict(ignore_eos="no"), TypeError, r"SamplingParams.ignore_eos must be True or False, got str 'no'"),
    (dict(skip_special_tokens=1), TypeError, r"SamplingParams.skip_special_tokens must be True or False"),
]


@pytest.mark.parametrize("kwargs, error, message", BAD_SAMPLING_PARAMS,
                         ids=[repr(kw)[1:-1] for kw, _, _ in BAD_SAMPLING_PARAMS])
def test_sampling_params_refuse_bad_types_and_ranges(kwargs, error, message):
    with pytest.raises(error, match=message) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, ValueError)      # RequestError: both kinds are ValueErrors (one handler)


def test_sampling_params_take_numpy_numbers_and_check_again_on_validate():
    np = pytest.importorskip("numpy")
    p = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(7), seed=np.int64(3),
                       stop_token_ids=np.array([4]), max_tokens=np.int32(5))
    assert (p.temperature, p.top_k, p.seed, p.stop_token_ids, p.max_tokens) == (0.5, 7, 3, [4], 5)
    assert all(type(v) in (int, float) for v in (p.temperature, p.top_k, p.seed, p.max_tokens))
    p.top_k = True                                  # changed after construction: caught by the next check
    with pytest.raises(TypeError, match="SamplingParams.top_k"):
        p.validate()


def test_output_types_have_vllm_fields():
    out = CompletionOutput(0, "hi", [1, 2], None, None, "stop", None)
    req = RequestOutput("r0", "prompt", [0, 5], [out], finished=True)
    assert req.outputs[0].finished() and req.prompt_token_ids == [0, 5] and req.outputs[0].token_ids == [1, 2]


# ------------------------------------------------------------------ incremental detokenization
def test_streaming_multibyte_utf8(tok):
    text = "你好，世界！今天天气很好🙂🚀👩‍💻 naïve café ẞ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"
    ids = tok.encode(text)
    partial = [i for i in ids if not _valid_utf8(tok.token_bytes[i])]
    assert partial, "the text must contain tokens that end inside a UTF-8 character"
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(i) for i in ids] + [detok.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text == tok.decode(ids)
    assert "" in pieces  # some token completed no character and was held back


def _valid_utf8(b):
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_random_token_streams_match_full_decode(tok):
    # Oracle: the tokenizers library decoding the whole sequence (broken UTF-8 becomes U+FFFD there too).
    rng = random.Random(0)
    partial = [i for i in range(128000) if not _valid_utf8(tok.token_bytes[i])]
    for _ in range(200):
        ids = [rng.choice(partial) if rng.random() < 0.5 else rng.randrange(tok.vocab_size) for _ in range(12)]
        for skip in (False, True):
            detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
            streamed = "".join(detok.push(i) for i in ids) + detok.flush()
            assert streamed == tok.decode(ids, skip_special_tokens=skip), ids


# ------------------------------------------------------------------ stop handling
def test_eos_stops_without_text(tok):
    ids = tok.encode("你好🙂") + [tok.eos_id, 19923]
    tracker, deltas = run(SamplingParams(max_tokens=50), ids, tok)
    out = tracker.output()
    assert (out.text, out.finish_reason, out.stop_reason) == ("你好🙂", "stop", None)
    assert out.token_ids == ids[:-1] and "".join(deltas) == out.text


def test_ignore_eos_runs_to_max_tokens(tok):
    tracker, _ = run(SamplingParams(max_tokens=3, ignore_eos=True), [19923, tok.eos_id, 19923, 19923], tok)
    assert (tracker.output().text, tracker.finish_reason, len(tracker.token_ids)) == ("HelloHello", "length", 3)


def test_stop_token_ids():
    t, _ = run(SamplingParams(stop_token_ids=[5]), [0, 1, 5, 0])
    assert (t.text, t.finish_reason, t.stop_reason, t.token_ids) == ("Hello", "stop", 5, [0, 1, 5])
    t, _ = run(SamplingParams(stop_token_ids=[5], include_stop_str_in_output=True), [0, 1, 5])
    assert t.text == "Hello!"


def test_stop_string_across_tokens_with_holdback():
    t, deltas = run(SamplingParams(stop=["</answer>"]), [0, 1, 2, 3, 4, 5])
    assert (t.text, t.finish_reason, t.stop_reason, t.token_ids) == ("Hello ", "stop", "</answer>", [0, 1, 2, 3, 4])
    assert deltas == ["Hel", "lo", " ", "", ""]   # " <" and "/ans" could start the stop string: held back
    t, deltas = run(SamplingParams(stop=["</answer>"], include_stop_str_in_output=True), [0, 1, 2, 3, 4, 5])
    assert t.text == "Hello </answer>" and "".join(deltas) == t.text


def test_holdback_released_when_no_stop_follows():
    t, deltas = run(SamplingParams(stop=["</answer>"], max_tokens=2), [2, 6])
    assert deltas == [" ", "<b>"] and (t.text, t.finish_reason) == (" <b>", "length")
    running, _ = run(SamplingParams(stop=["</answer>"]), [0, 1, 2])
    assert running.output().text == "Hello " and running.text == "Hello <"   # snapshot excludes the held tail


def test_earliest_stop_string_wins_and_beats_length():
    t, _ = run(SamplingParams(stop=["lo", "Hel"]), [7])   # both complete in one step
    assert (t.text, t.stop_reason) == ("", "Hel")
    t, _ = run(SamplingParams(stop=["lo"], max_tokens=2), [0, 1])
    assert (t.text, t.finish_reason, t.stop_reason) == ("Hel", "stop", "lo")


class TextTracker:
    """The stop-string rules on one plain string (the text re-copied every token): the oracle for OutputTracker,
    which keeps pieces and looks only at the text's end."""

    def __init__(self, params):
        self.params, self.text, self.streamed, self.finished = params, "", 0, False
        self.longest = max(map(len, params.stop), default=0)

    def add(self, piece):
        start = max(0, len(self.text) - self.longest + 1)
        self.text += piece
        hits = [(pos, s) for s in self.params.stop if (pos := self.text.find(s, start)) != -1]
        if hits:
            pos, s = min(hits)
            self.text = self.text[:pos + len(s) if self.params.include_stop_str_in_output else pos]
            self.finished = s

    def visible(self):
        held = 0
        if not (self.finished or self.params.include_stop_str_in_output):
            held = next((k for k in range(min(len(self.text), self.longest - 1), 0, -1)
                         if any(s.startswith(self.text[-k:]) for s in self.params.stop)), 0)
        return len(self.text) - held

    def delta(self):
        end = self.visible()
        out = self.text[self.streamed:end]
        self.streamed = max(self.streamed, end)
        return out


def test_pieces_and_stop_strings_match_the_plain_string_rules():
    rng = random.Random(1)
    alphabet = "ab</>"
    for case in range(300):
        pieces = ["".join(rng.choice(alphabet) for _ in range(rng.choice([0, 1, 1, 1, 2, 3, 6])))
                  for _ in range(rng.randrange(1, 40))]
        tokenizer = type("Pieces", (PieceTokenizer,), {"PIECES": pieces})()
        stop = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 6))) for _ in range(rng.randrange(3))]
        params = SamplingParams(stop=stop, include_stop_str_in_output=rng.random() < 0.3, max_tokens=None)
        tracker, oracle = OutputTracker(params, tokenizer), TextTracker(params)
        for i in range(len(pieces)):
            done = tracker.append(i)
            oracle.add(pieces[i])
            if rng.random() < 0.2:
                assert tracker.text == oracle.text, case     # reading joins the pieces; appending goes on
            assert tracker.output().text == oracle.text[:oracle.visible()], case
            if rng.random() < 0.7:
                assert tracker.take_delta() == oracle.delta(), case
            assert done == bool(oracle.finished) and tracker.stop_reason == (oracle.finished or None), case
            if done:
                break
        if not tracker.finished:
            tracker.finish("length")
            oracle.finished = True
        assert (tracker.text, tracker.take_delta()) == (oracle.text, oracle.delta()), case


def test_long_stream_of_one_character_tokens():
    n = 20000
    tokenizer = type("Chars", (PieceTokenizer,), {"PIECES": ["x", "<", "/", "e", "n", "d", ">"]})()
    ids = [0] * n + [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 6, 0]       # "<\/end" then "</end>": the second one stops
    tracker, deltas = run(SamplingParams(stop=["</end>"], max_tokens=None), ids, tokenizer)
    assert (tracker.finish_reason, tracker.stop_reason, len(tracker.token_ids)) == ("stop", "</end>", n + 11)
    assert tracker.text == "x" * n + "</end" and "".join(deltas) == tracker.text
    assert deltas[n - 1:n + 5] == ["x", "", "", "", "", ""] and deltas[n + 5] == "</end"


def test_external_finish_and_misuse():
    t, _ = run(SamplingParams(stop=["</answer>"]), [0, 1, 2])
    t.finish("length")
    assert (t.output().text, t.take_delta(), t.finish_reason) == ("Hello <", "<", "length")
    with pytest.raises(RuntimeError, match="already finished"):
        t.append(0)
    with pytest.raises(ValueError, match="finish reason"):
        OutputTracker(SamplingParams(), PieceTokenizer()).finish("bored")


def test_truncated_character_at_length_becomes_replacement(tok):
    ids = tok.encode("🙂")
    assert len(ids) == 2
    t, _ = run(SamplingParams(max_tokens=1), ids, tok)
    assert (t.text, t.finish_reason) == ("\ufffd", "length")


def test_logprobs_accumulate(tok):
    t = OutputTracker(SamplingParams(logprobs=1), tok)
    t.append(19923, {19923: Logprob(-0.5, 1), 14: Logprob(-1.5, 2)})
    t.append(14, {14: Logprob(-0.25, 1)})
    out = t.output()
    assert out.cumulative_logprob == -0.75 and out.logprobs[0][19923].decoded_token == "Hello"
    with pytest.raises(ValueError, match="logprobs were requested"):
        t.append(3)
    assert OutputTracker(SamplingParams(), tok).output().cumulative_logprob is None


def test_accept_then_render_matches_append():
    """accept says at once whether a token ends the sequence (EOS, stop id, max_tokens); readers see rendered tokens
    only; a stop string found in rendering drops the accepted tokens after it; fail drops unrendered tokens, finish
    renders them first."""
    t = OutputTracker(SamplingParams(stop=["</answer>"], max_tokens=8), PieceTokenizer())
    assert [t.accept(i) for i in (0, 1, 2)] == [False, False, False]
    assert (t.token_ids, t.num_sampled, t.output().text, t.output().token_ids) == ([], 3, "", [])
    assert t.render() and t.text == "Hello <" and t.token_ids == [0, 1, 2] and not t.render()
    for i in (3, 4, 5):                                   # "</ans" "wer>" complete the stop string; "!" comes after
        assert not t.accept(i)
    assert t.sampled_ids(1, 6) == [1, 2, 3, 4, 5]
    t.render()
    want, _ = run(SamplingParams(stop=["</answer>"], max_tokens=8), [0, 1, 2, 3, 4, 5])
    assert (t.text, t.token_ids, t.finish_reason, t.stop_reason, t.num_sampled) == \
        (want.text, want.token_ids, "stop", "</answer>", 5)

    eos = OutputTracker(SamplingParams(), PieceTokenizer())
    assert not eos.accept(0) and eos.accept(99)          # EOS ends it: nothing more may be taken before it renders
    with pytest.raises(RuntimeError, match="already finished"):
        eos.accept(1)
    eos.render()
    assert (eos.text, eos.finish_reason, eos.token_ids) == ("Hel", "stop", [0, 99])
    assert OutputTracker(SamplingParams(max_tokens=2), PieceTokenizer()).accept(0) is False
    short = OutputTracker(SamplingParams(max_tokens=2), PieceTokenizer())
    assert [short.accept(0), short.accept(1)] == [False, True]

    aborted = OutputTracker(SamplingParams(), PieceTokenizer())
    aborted.accept(0)
    aborted.accept(1)
    aborted.finish("abort")
    assert (aborted.text, aborted.token_ids, aborted.finish_reason) == ("Hello", [0, 1], "abort")
    failed = OutputTracker(SamplingParams(), PieceTokenizer())
    failed.append(0)
    failed.accept(1)
    failed.fail("error", "boom")
    assert (failed.text, failed.token_ids, failed.num_sampled, failed.error) == ("Hel", [0], 1, "boom")
