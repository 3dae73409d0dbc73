"""DSML tool calls, reasoning and content through the server: the streaming reply parser as a unit, then the whole
server path with a scripted model.

The demo model's random weights will rarely write DSML, so the server tests put a `ScriptedModel` under the real
engine: each request the engine starts takes the next script (token ids of a reply) and the engine samples it one
token per step, detokenizes it and streams it, exactly as it would a model's. The app runs in this process (uvicorn
in a thread on a loopback port) and is driven by the official openai client and by httpx.
"""

import json
import threading
import time
from collections import deque
from contextlib import contextmanager

import httpx
import openai
import pytest
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from dsv4.config import ModelConfig
from dsv4.runtime.chat import ChatParseError, encode_messages, parse_reply
from dsv4.runtime.chat_stream import ARGUMENTS, CONTENT, REASONING, TOOL_CALL, ReplyParser
from dsv4.runtime.engine import Engine
from dsv4.runtime.tokenizer import Tokenizer
from dsv4.server.app import build_app, make_state

D = "｜DSML｜"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "location": {"type": "string"}, "days": {"type": "integer"}}}}},
         {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
CALLS = [("get_weather", {"location": "北京 <\"x\">\n", "days": 3, "tags": ["a", {"b": None}]}), ("now", {})]


def reply_text(content: str, reasoning: str | None, calls=CALLS) -> str:
    """What V4 writes after the prompt for this assistant turn (the encoder's own rendering, EOS dropped)."""
    message = {"role": "assistant", "content": content, "reasoning_content": reasoning or "",
               "tool_calls": [{"type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
                              for n, a in calls]}
    q = [{"role": "user", "content": "q"}]
    full = encode_messages(q + [message], thinking=reasoning is not None, drop_thinking=False)
    return full[len(encode_messages(q, thinking=reasoning is not None, drop_thinking=False)):].removesuffix(
        "<｜end▁of▁sentence｜>")


def parse(pieces, thinking: bool):
    parser = ReplyParser(thinking)
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    return parser.reply(), events


def merged(events):
    out = []
    for e in events:
        if out and out[-1][0] == e.kind != TOOL_CALL and out[-1][2] == e.index:
            out[-1] = (e.kind, out[-1][1] + e.text, e.index)
        else:
            out.append((e.kind, e.text, e.index))
    return out


# ============================================================================ the parser, as a unit
WELL_FORMED = {
    "thinking, content, two calls": (reply_text("Let me check 🙂: a < b.", "I need </the> weather."), True),
    "content, two calls": (reply_text("Checking.", None), False),
    "calls only": (reply_text("", None), False),
    "plain content with near-markup": ("Use <｜ and < or <｜DSM to compare.", False),
    "thinking, no calls": (reply_text("Paris.", "Capital of France.", []), True),
}


@pytest.mark.parametrize("name", sorted(WELL_FORMED))
def test_any_split_gives_the_same_events_as_parse_reply(name):
    text, thinking = WELL_FORMED[name]
    want = parse_reply(text, thinking=thinking)
    reply, events = parse([text], thinking)
    assert reply == want
    whole = merged(events)
    for i in range(len(text) + 1):                   # two pieces, cut at every position (inside every marker)
        reply, events = parse([text[:i], text[i:]], thinking)
        assert reply == want and merged(events) == whole, i
        assert not any(D in e.text or "</think>" in e.text for e in events if e.kind in (CONTENT, REASONING))
    for step in (1, 3):                              # one character (three) at a time
        reply, events = parse([text[i:i + step] for i in range(0, len(text), step)], thinking)
        assert reply == want and merged(events) == whole


def test_calls_are_announced_then_stream_their_arguments():
    text, _ = WELL_FORMED["content, two calls"]
    parser = ReplyParser(thinking=False)
    seen = []
    for ch in text:
        seen += [(e.kind, e.index) for e in parser.feed(ch)]
    seen += [(e.kind, e.index) for e in parser.finish()]
    kinds = [k for k, _ in seen]
    assert kinds[0] == CONTENT and kinds.count(TOOL_CALL) == 2
    first_args = [i for i, (k, idx) in enumerate(seen) if k == ARGUMENTS and idx == 0]
    assert len(first_args) > 5                      # the string value streamed, not sent at the end
    assert seen.index((TOOL_CALL, 1)) > max(first_args)


MALFORMED = [   # (text, content it must come back as, tool calls it still yields)
    (f'Hi\n\n<{D}tool_calls>\n<{D}invoke nam="f">\n</{D}invoke>\n</{D}tool_calls>',
     f'Hi\n\n<{D}tool_calls>\n<{D}invoke nam="f">\n</{D}invoke>\n</{D}tool_calls>', []),
    (f'x <{D}parameter name="a">1</{D}parameter> y', f'x <{D}parameter name="a">1</{D}parameter> y', []),
    (f'<{D}tool_calls>\n<{D}invoke nam="f">\n</{D}invoke>\n<{D}invoke name="g">\n<{D}parameter name="x" '
     f'string="true">1</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>',
     f'<{D}tool_calls>\n<{D}invoke nam="f">\n</{D}invoke>', [("g", '{"x": "1"}')]),
    (f'<{D}tool_calls>\n<{D}invoke name="f">\n<{D}parameter name="x" string="false">one</{D}parameter>\n'
     f'</{D}invoke>\n</{D}tool_calls>', "", [("f", '{"x": "one"}')]),       # not JSON: sent as a string
    (f'ok\n\n<{D}tool_calls>\n<{D}invoke name="f">\n<{D}parameter name="x" string="true">ab</{D}par', "ok",
     [("f", '{"x": "ab')]),                                                  # cut by max_tokens
    (f'ok\n\n<{D}tool_ca', "ok", []),
]


@pytest.mark.parametrize("text, content, calls", MALFORMED)
def test_malformed_markup_comes_back_as_text(text, content, calls):
    with pytest.raises(ChatParseError):
        parse_reply(text, thinking=False)
    for pieces in ([text], list(text)):
        reply, _ = parse(pieces, thinking=False)
        assert reply.content == content
        assert [(c.name, c.arguments) for c in reply.tool_calls] == calls


def test_reasoning_ends_at_a_tool_call_without_think_end():
    text = f'hmm\n\n<{D}tool_calls>\n<{D}invoke name="now">\n</{D}invoke>\n</{D}tool_calls>'
    reply, _ = parse(list(text), thinking=True)
    assert reply.reasoning_content.strip() == "hmm" and reply.content == ""
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [("now", "{}")]


# ============================================================================ the server path, scripted
V = 129280
EOS = 1


class ScriptedModel(torch.nn.Module):
    """Stands in for the Transformer under the real engine. Each sequence the engine starts (position 0) takes
    the next script (a list of token ids; None raises in the step); EOS follows the script."""

    def __init__(self, step_s: float = 0.0):
        super().__init__()
        self.config = ModelConfig.tiny(vocab_size=V)
        self.embed = torch.nn.Embedding(1, 1)
        self.scripts: deque = deque()
        self.slots: dict[int, list] = {}             # slot -> [script, position of its first sampled token]
        self.step_s = step_s

    def forward(self, ids, positions, states, batch):
        time.sleep(self.step_s)
        rows = []
        for slot, start, n in zip(batch.slots, batch.starts, batch.lengths):
            if start == 0:
                self.slots[slot] = [self.scripts.popleft(), None]
            rows += [(slot, start + k) for k in range(n)]
        return torch.tensor(rows, dtype=torch.float32)[None]

    def head_logits(self, rows):
        logits = torch.full((1, rows.shape[1], V), -1e30)          # the script, at any temperature
        for j, (slot, pos) in enumerate(rows[0].long().tolist()):
            entry = self.slots[slot]
            entry[1] = pos if entry[1] is None else entry[1]
            k = pos - entry[1]
            token = entry[0][k] if k < len(entry[0]) else EOS
            if token is None:
                raise RuntimeError("scripted fault")
            logits[0, j, token] = 0.0
        return logits


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_checkpoint(None)


@contextmanager
def serving(model: ScriptedModel, tokenizer, max_num_seqs: int = 4, max_waiting: int | None = None):
    engine = Engine(model, tokenizer, max_num_seqs=max_num_seqs, max_model_len=512)
    state = make_state(engine, tokenizer, ("scripted",), "scripted", max_waiting=max_waiting)
    config = uvicorn.Config(build_app(state), host="127.0.0.1", port=0, log_config=None, access_log=False)
    server = uvicorn.Server(config)
    sock = config.bind_socket()
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", state
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def scripted(tokenizer):
    model = ScriptedModel()
    with serving(model, tokenizer) as (url, state):
        yield model, url, state


def ask(scripted, tokenizer, text: str, **kw):
    """Chat completion whose reply is `text`; streamed (the chunks' deltas) and not (the message)."""
    model, url, _ = scripted
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    args = dict(model="scripted", messages=[{"role": "user", "content": "q"}], temperature=0, tools=TOOLS, **kw)
    model.scripts.append(tokenizer.encode(text))
    whole = client.chat.completions.create(**args)
    model.scripts.append(tokenizer.encode(text))
    chunks = list(client.chat.completions.create(stream=True, **args))
    return whole.choices[0], chunks


def from_chunks(chunks):
    """(content, reasoning, {index: (id, name, arguments)}, finish_reason) assembled from stream deltas."""
    content, reasoning, calls, finish = "", "", {}, None
    for c in chunks:
        for ch in c.choices:
            d = ch.delta
            content += d.content or ""
            reasoning += getattr(d, "reasoning_content", None) or ""
            for tc in d.tool_calls or []:
                cid, name, args = calls.get(tc.index, (None, None, ""))
                calls[tc.index] = (tc.id or cid, tc.function.name or name, args + (tc.function.arguments or ""))
            finish = ch.finish_reason or finish
    return content, reasoning, calls, finish


def test_tool_calls_reasoning_and_content_through_the_server(scripted, tokenizer):
    text = reply_text("Let me check.", "The user wants weather.")
    choice, chunks = ask(scripted, tokenizer, text, extra_body={"chat_template_kwargs": {"thinking": True}})
    msg = choice.message
    assert msg.content == "Let me check." and msg.reasoning_content == "The user wants weather."
    assert [(t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls] == CALLS
    assert choice.finish_reason == "tool_calls" and all(t.id.startswith("call_") for t in msg.tool_calls)
    content, reasoning, calls, finish = from_chunks(chunks)
    assert (content, reasoning, finish) == ("Let me check.", "The user wants weather.", "tool_calls")
    assert [(name, json.loads(args)) for _, name, args in calls.values()] == CALLS
    assert all(cid.startswith("call_") for cid, _, _ in calls.values())
    # the reply goes back as history, with the tools' results (the client's message object as it came)
    history = [{"role": "user", "content": "q"}, msg.model_dump(),
               *[{"role": "tool", "tool_call_id": t.id, "content": f"result {i}"} for i, t in enumerate(msg.tool_calls)]]
    _, url, _ = scripted
    sent = httpx.post(url + "/tokenize", json={"messages": history, "tools": TOOLS,
                                               "chat_template_kwargs": {"thinking": True}}).json()["tokens"]
    assert sent == tokenizer.encode(encode_messages([history[0], {
        "role": "assistant", "content": "Let me check.", "reasoning_content": "The user wants weather.",
        "tool_calls": [t.model_dump() for t in msg.tool_calls]}, *history[2:]], thinking=True, tools=TOOLS))
    deltas = [d for c in chunks for ch in c.choices
              for d in (ch.delta.content, getattr(ch.delta, "reasoning_content", None)) if d]
    assert len(chunks) > 20 and not any(D in d or "<｜" in d for d in deltas)


def test_malformed_markup_is_content_and_the_server_goes_on(scripted, tokenizer):
    text = f'Sure.\n\n<{D}tool_calls>\n<{D}invoke nam="f">\n</{D}invoke>\n</{D}tool_calls>'
    choice, chunks = ask(scripted, tokenizer, text)
    assert choice.message.content == text and not choice.message.tool_calls and choice.finish_reason == "stop"
    assert from_chunks(chunks)[0] == text and not from_chunks(chunks)[2]
    text = reply_text("", None, [("now", {})])
    choice, _ = ask(scripted, tokenizer, text)                      # the next request is served normally
    assert choice.message.tool_calls[0].function.name == "now" and choice.message.content is None


def test_anthropic_messages_tool_use_and_thinking(scripted, tokenizer):
    model, url, _ = scripted
    text = reply_text("Checking.", "Think first.")
    body = {"model": "scripted", "max_tokens": 200, "temperature": 0, "thinking": {"type": "enabled"},
            "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}, {"name": "now"}],
            "system": "Be brief.", "messages": [{"role": "user", "content": "weather?"}]}
    model.scripts.append(tokenizer.encode(text))
    r = httpx.post(url + "/v1/messages", json=body).json()
    assert [b["type"] for b in r["content"]] == ["thinking", "text", "tool_use", "tool_use"]
    assert r["content"][0]["thinking"] == "Think first." and r["content"][1]["text"] == "Checking."
    assert [(b["name"], b["input"]) for b in r["content"][2:]] == CALLS and r["stop_reason"] == "tool_use"
    model.scripts.append(tokenizer.encode(text))
    with httpx.stream("POST", url + "/v1/messages", json={**body, "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    blocks = {}
    for e in events:
        if e["type"] == "content_block_start":
            blocks[e["index"]] = [e["content_block"], ""]
        elif e["type"] == "content_block_delta":
            d = e["delta"]
            blocks[e["index"]][1] += d.get("thinking") or d.get("text") or d.get("partial_json") or ""
    assert [(b["type"], t) for b, t in blocks.values()][:2] == [("thinking", "Think first."), ("text", "Checking.")]
    assert [(b["name"], json.loads(t)) for b, t in list(blocks.values())[2:]] == CALLS
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    # the conversation goes on: tool_use and tool_result blocks are encoded back
    history = [*body["messages"], {"role": "assistant", "content": r["content"]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": r["content"][2]["id"],
                                             "content": "sunny"}]}]
    n = httpx.post(url + "/v1/messages/count_tokens", json={**body, "messages": history}).json()["input_tokens"]
    want = encode_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "weather?"},
                            {"role": "assistant", "content": "Checking.", "reasoning_content": "Think first.",
                             "tool_calls": [{"id": b["id"], "function": {"name": b["name"], "arguments": b["input"]}}
                                            for b in r["content"][2:]]},
                            {"role": "tool", "tool_call_id": r["content"][2]["id"], "content": "sunny"}],
                           thinking=True, tools=[{"type": "function", "function": {
                               "name": t["name"], "description": "", "parameters": t.get("input_schema",
                                                                                         {"type": "object"})}}
                                                 for t in body["tools"]])
    assert n == len(tokenizer.encode(want))


def test_a_failing_step_is_an_error_object_and_the_server_goes_on(scripted, tokenizer):
    model, url, state = scripted
    model.scripts.append(tokenizer.encode("ab") + [None])
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "q"}]})
    assert r.status_code == 500 and "scripted fault" in r.json()["error"]["message"]
    model.scripts.append(tokenizer.encode("fine"))
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "q"}]})
    assert r.json()["choices"][0]["message"]["content"] == "fine"
    assert state.loop.alive


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_queue_full_is_503(tokenizer):
    model = ScriptedModel(step_s=0.05)
    with serving(model, tokenizer, max_num_seqs=1, max_waiting=1) as (url, _):
        body = {"messages": [{"role": "user", "content": "q"}], "stream": True}
        model.scripts.extend([tokenizer.encode(" a" * 200)] * 2)                      # 10 s each: cut short
        with httpx.Client(base_url=url) as client, client.stream("POST", "/v1/chat/completions", json=body) as running:
            lines = running.iter_lines()           # kept: a generator dropped closes its stream, aborting it
            while '"content":" a' not in next(lines):                                   # it has the slot
                pass
            with client.stream("POST", "/v1/chat/completions", json=body) as waiting:
                assert waiting.status_code == 200                                       # it waits
                r = httpx.post(url + "/v1/chat/completions", json=body)
                assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
        deadline = time.time() + 5                  # both streams closed early: aborted, their slots free
        while metric(url, "dsv4:num_requests_running") or metric(url, "dsv4:kv_cache_usage_perc"):
            assert time.time() < deadline
            time.sleep(0.05)
        assert metric(url, "dsv4:num_requests_waiting") == 0
