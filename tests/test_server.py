"""`dsv4 serve` as a real process on a loopback port, on the built-in demo model, driven by the official `openai`
client (sync and async) and by `httpx` for raw HTTP.

One server process serves the module (a second one, in the last test, is stopped by SIGTERM mid-stream). Greedy
text is checked against an independent path, `dsv4.LLM(...).generate` in this process: greedy tokens do not depend
on the batch in fp32 on the CPU, so every client gets exactly what it would get alone.
"""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import runtime_fixtures as rf
from prometheus_client.parser import text_string_to_metric_families

import dsv4
from dsv4.runtime.chat import encode_messages
from dsv4.runtime.chat_stream import parse_whole
from dsv4.runtime.demo import DEMO_FOLDER

ROOT = Path(__file__).resolve().parents[1]
KEY = "test-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}


class ServerProcess:
    """`python -m dsv4 serve demo --port 0 ARGS`; its log in a file; `url` once it answers /health."""

    def __init__(self, *args: str, log: Path):
        env = dict(os.environ, DSV4_CACHE=str(rf.demo_root()), PYTHONPATH=str(ROOT))
        self.log_path = log
        self.proc = subprocess.Popen([sys.executable, "-m", "dsv4", "serve", "demo", "--port", "0", "--no-progress",
                                      *args], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                     stderr=log.open("w"))
        deadline = time.time() + 120
        while not (m := re.search(r"serving at (http://\S+)", self.log())):
            assert self.proc.poll() is None and time.time() < deadline, self.log()
            time.sleep(0.1)
        self.url = m[1]
        while True:
            try:
                if httpx.get(self.url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                assert time.time() < deadline, self.log()
                time.sleep(0.1)

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self, sig=signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess("--api-key", KEY, "--max-num-seqs", "16", "--max-request-bytes", "1MiB",
                      log=tmp_path_factory.mktemp("serve") / "serve.log")
    yield s
    assert s.stop(signal.SIGINT) == 0, s.log()[-3000:]            # Ctrl-C: a normal exit (SIGTERM: the last test)


@pytest.fixture(scope="module")
def llm():
    return dsv4.LLM(rf.demo_root() / DEMO_FOLDER, progress=False, max_num_seqs=64)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY)


def greedy(n: int, **kw) -> dsv4.SamplingParams:
    return dsv4.SamplingParams(temperature=0, max_tokens=n, **kw)


def metrics(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", headers=HEADERS).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def wait_idle(server, timeout: float = 10) -> dict[str, float]:
    """The metrics once nothing runs, waits or holds a cache slot."""
    deadline = time.time() + timeout
    while True:
        m = metrics(server)
        if not (m["dsv4:num_requests_running"] or m["dsv4:num_requests_waiting"] or m["dsv4:kv_cache_usage_perc"]):
            return m
        assert time.time() < deadline, m
        time.sleep(0.05)


# ============================================================================ endpoints
def test_health_models_tokenize_and_the_api_key(server, llm):
    assert httpx.get(server.url + "/health").status_code == 200                      # open without the key
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}):
        r = httpx.get(server.url + "/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    models = httpx.get(server.url + "/v1/models", headers={"x-api-key": KEY}).json()
    assert [m["id"] for m in models["data"]] == ["demo"] and models["data"][0]["max_model_len"] == 4096
    tok = llm.get_tokenizer()
    r = httpx.post(server.url + "/tokenize", headers=HEADERS, json={"prompt": "Hello world"}).json()
    assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"])
    conv = [{"role": "user", "content": "Hi"}]
    r = httpx.post(server.url + "/tokenize", headers=HEADERS, json={"messages": conv}).json()
    assert r["tokens"] == tok.encode(encode_messages(conv))
    r = httpx.post(server.url + "/detokenize", headers=HEADERS, json={"tokens": r["tokens"]}).json()
    assert r["prompt"] == encode_messages(conv)
    assert "dsv4:kv_cache_capacity_tokens" in metrics(server)


def test_completions_equal_in_process_generate(client, llm):
    tok = llm.get_tokenizer()
    prompts = ["The capital of France is", "DeepSeek-V4"]
    ids = [tok.bos_id, *tok.encode("Hello")]
    want = [o.outputs[0] for o in llm.generate([*prompts, ids], greedy(6), use_tqdm=False)]
    r = client.completions.create(model="demo", prompt=prompts, max_tokens=6, temperature=0)
    assert [c.text for c in r.choices] == [w.text for w in want[:2]]
    assert r.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts) and r.usage.completion_tokens == 12
    r = client.completions.create(model="demo", prompt=ids, max_tokens=6, temperature=0, echo=True)
    assert r.choices[0].text == tok.decode(ids) + want[2].text and r.choices[0].finish_reason == "length"
    # n choices with derived seeds (seed + i), as vLLM: choice i is what seed + i gives alone
    r = client.completions.create(model="demo", prompt=prompts[0], max_tokens=5, n=3, seed=7, top_p=0.9)
    for i, c in enumerate(r.choices):
        alone = llm.generate(prompts[0], dsv4.SamplingParams(max_tokens=5, seed=7 + i, top_p=0.9), use_tqdm=False)
        assert c.index == i and c.text == alone[0].outputs[0].text
    # a stop string cuts the text; logprobs have one entry per token
    stop = want[0].text[3:6]
    r = client.completions.create(model="demo", prompt=prompts[0], max_tokens=6, temperature=0, stop=[stop], logprobs=2)
    c = r.choices[0]
    assert c.text == want[0].text[:want[0].text.index(stop)] and c.finish_reason == "stop"
    assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == len(c.logprobs.top_logprobs) >= 1
    assert all(len(top) == 2 for top in c.logprobs.top_logprobs)


def test_streaming_equals_non_streaming_with_usage(server, client, llm):
    want = llm.generate("Once upon a time", greedy(8), use_tqdm=False)[0].outputs[0].text
    chunks = list(client.completions.create(model="demo", prompt="Once upon a time", max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == 8 and not chunks[-1].choices
    body = {"prompt": "Once upon a time", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", headers=HEADERS, json=body) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.headers["content-type"].startswith("text/event-stream") and lines[-1] == "data: [DONE]"


def test_chat_thinking_and_reasoning_content(client, llm):
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"},
            {"role": "assistant", "content": "Rayleigh.", "reasoning_content": "Scattering."},
            {"role": "user", "content": "More?"}]
    want = parse_whole(llm.chat(conv, greedy(8), use_tqdm=False, thinking=True)[0].outputs[0].text, thinking=True)
    kw = dict(model="demo", messages=conv, max_tokens=8, temperature=0,
              extra_body={"chat_template_kwargs": {"thinking": True}})
    msg = client.chat.completions.create(**kw).choices[0].message
    assert (msg.content or "", msg.reasoning_content) == (want.content, want.reasoning_content)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert (content, reasoning) == (want.content, want.reasoning_content)
    text = llm.chat(conv, greedy(8), use_tqdm=False)[0].outputs[0].text                     # thinking off
    choice = client.chat.completions.create(model="demo", messages=conv, max_tokens=8, temperature=0, logprobs=True,
                                            top_logprobs=2).choices[0]
    assert choice.message.content == parse_whole(text, thinking=False).content
    assert getattr(choice.message, "reasoning_content", None) is None
    tokens = choice.logprobs.content
    assert len(tokens) == 8 and all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.logprob for t in tokens)
    assert b"".join(bytes(t.bytes) for t in tokens).decode(errors="replace") == text     # each token's own bytes


def test_anthropic_messages_on_the_demo_model(server, llm):
    body = {"model": "demo", "max_tokens": 6, "temperature": 0, "system": "Be brief.",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}
    text = llm.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], greedy(6),
                    use_tqdm=False)[0].outputs[0].text
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY}, json=body).json()
    assert r["type"] == "message" and r["stop_reason"] == "max_tokens" and r["usage"]["output_tokens"] == 6
    assert "".join(b["text"] for b in r["content"] if b["type"] == "text") == text.rstrip()
    with httpx.stream("POST", server.url + "/v1/messages", headers={"x-api-key": KEY},
                      json={**body, "stream": True}) as s:
        events = [line[7:] for line in s.iter_lines() if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY}, json={**body, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["type"] == "error" and r.json()["error"]["param"] == "max_tokens"


BAD = [   # (path, body or raw bytes, status, param)
    ("/v1/completions", b'{"prompt": "x", "max_tokens": ', 400, None),
    ("/v1/completions", {"prompt": "x", "temperature": 2.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": "0.5"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "top_k": True}, 400, "top_k"),
    ("/v1/completions", {"prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": list(range(2, 4100))}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4096}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": [5, 999999]}, 400, None),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 400,
     "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("/v1/completions", {"prompt": "x" * (1 << 20)}, 413, None),
    ("/v1/nothing", {}, 404, None),
]


@pytest.mark.parametrize("path, body, status, param", BAD, ids=[f"{b[2]}-{b[3]}" for b in BAD])
def test_bad_requests_get_error_objects(server, path, body, status, param):
    kw = {"content": body, "headers": {**HEADERS, "content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body, "headers": HEADERS}
    r = httpx.post(server.url + path, **kw)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["param"] == param


def test_the_engine_survives_bad_requests(client):
    r = client.completions.create(model="demo", prompt="still here", max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason == "length"


# ============================================================================ load, faults
def test_64_streaming_clients_each_get_their_own_text(server, llm):
    prompts = [f"Request {i}: tell me about {w}" for i, w in enumerate(["rivers", "stones", "light", "music"] * 16)]
    want = [o.outputs[0].text for o in llm.generate(prompts, greedy(6), use_tqdm=False)]
    sync = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY)
    alone = [sync.completions.create(model="demo", prompt=p, max_tokens=6, temperature=0).choices[0].text
             for p in prompts]
    assert alone == want

    async def stream(client, p):
        chunks = await client.completions.create(model="demo", prompt=p, max_tokens=6, temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in chunks if c.choices])

    async def all_at_once():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        start = time.perf_counter()
        texts = await asyncio.gather(*(stream(client, p) for p in prompts))
        return texts, time.perf_counter() - start

    texts, seconds = asyncio.run(all_at_once())
    print(f"64 streaming clients: {seconds:.2f} s")
    assert texts == want
    wait_idle(server)


def test_a_client_that_disconnects_is_aborted_within_a_step(server):
    body = {"prompt": "Tell me a long story", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", headers=HEADERS, json=body) as r:
        lines = r.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
        received = 1 + sum(next(lines).startswith("data: ") for _ in range(6))
    closed = time.time()
    wait_idle(server, timeout=2)
    assert time.time() - closed < 2
    line = re.search(rf"{first['id']}-0: abort, prompt \d+ tokens, completion (\d+) tokens", server.log())
    print(f"aborted after {line[1]} tokens, {received} received")
    assert line and int(line[1]) <= received + 5, server.log()[-2000:]


def test_soak_of_mixed_requests_ends_idle(server):
    async def go():
        limit = asyncio.Semaphore(24)
        async with httpx.AsyncClient(base_url=server.url, headers=HEADERS, timeout=60) as http:
            async def one(i):
                async with limit:
                    kind = i % 6
                    body = {"prompt": f"soak {i}", "max_tokens": 1 + i % 4, "temperature": 0.5, "seed": i}
                    if kind == 0:                                       # invalid
                        r = await http.post("/v1/completions", json={**body, "temperature": -1})
                        return r.status_code == 400
                    if kind in (1, 2):                                  # streamed (kind 2: closed early)
                        body = {**body, "stream": True, "max_tokens": 40 if kind == 2 else 4}
                        async with http.stream("POST", "/v1/completions", json=body) as r:
                            async for line in r.aiter_lines():
                                if kind == 2 and line.startswith("data: "):
                                    return True
                                if line == "data: [DONE]":
                                    return True
                        return False
                    if kind == 3:                                       # non-streaming, given up on
                        try:
                            await http.post("/v1/completions", json={**body, "max_tokens": 100}, timeout=0.05)
                        except httpx.TimeoutException:
                            pass
                        return True
                    if kind == 4:
                        r = await http.post("/v1/chat/completions", json={
                            "messages": [{"role": "user", "content": body["prompt"]}], "max_tokens": 3, "n": 2})
                        return r.status_code == 200 and len(r.json()["choices"]) == 2
                    r = await http.post("/v1/completions", json=body)
                    return r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")

            return await asyncio.gather(*(one(i) for i in range(240)))

    assert all(asyncio.run(go()))
    m = wait_idle(server)
    assert m["dsv4:prompt_tokens_total"] > 0 and m["dsv4:generation_tokens_total"] > 0
    for histogram in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert m[f"dsv4:{histogram}_count"] > 0
    text = httpx.get(server.url + "/metrics", headers=HEADERS).text
    assert 'finished_reason="abort"' in text and 'finished_reason="length"' in text


def test_bench_serve_toy_run(server, tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, "bench/serve.py", "--base-url", server.url, "--api-key", KEY,
                           "--num-prompts", "8", "--max-concurrency", "4", "--input-len", "16", "--output-len", "4",
                           "--range-ratio", "0.5", "--endpoint", "chat", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    print(done.stdout)
    assert re.search(r"Successful / failed requests +8 / 0", done.stdout) and "TTFT" in done.stdout
    summary = json.loads(out.read_text())
    assert summary["completed"] == 8 and summary["total_output_tokens"] == sum(
        o["output_tokens"] for o in summary["outcomes"])


def test_sigterm_mid_stream_drains_aborts_and_exits_0(tmp_path):
    s = ServerProcess("--shutdown-timeout", "2", log=tmp_path / "serve.log")
    long = {"prompt": "a long one", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    short = {**long, "max_tokens": 12}

    async def go():
        async with httpx.AsyncClient(base_url=s.url, timeout=30) as http:
            async def run(body, started):
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    events = []
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                            started.set()
                    return events

            started = [asyncio.Event(), asyncio.Event()]
            tasks = [asyncio.create_task(run(b, e)) for b, e in zip((long, short), started)]
            for e in started:
                await e.wait()
            s.proc.send_signal(signal.SIGTERM)
            sent = time.time()
            await asyncio.sleep(0.3)
            with pytest.raises(httpx.TransportError):                   # no longer accepting
                await http.get("/health")
            results = await asyncio.gather(*tasks)
            return results, time.time() - sent

    (long_events, short_events), seconds = asyncio.run(go())
    assert json.loads(short_events[-2])["choices"][0]["finish_reason"] == "length"      # finished within the drain
    assert json.loads(long_events[-2])["choices"][0]["finish_reason"] == "abort" and long_events[-1] == "[DONE]"
    assert 1.5 < seconds < 10
    assert s.proc.wait(15) == 0, s.log()[-3000:]
