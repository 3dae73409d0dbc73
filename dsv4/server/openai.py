"""OpenAI's endpoints (and vLLM's /tokenize, /detokenize): completions, chat completions, models.

Chat replies go through `runtime.chat_stream.ReplyParser`, streaming or not, so reasoning, content and DSML tool
calls are split the same way in both, and DSML markup never reaches `content`.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated

from fastapi import APIRouter, Depends, Request

from ..runtime.chat import ChatFormatError, encode_messages
from ..runtime.chat_stream import ARGUMENTS, CONTENT, REASONING, TOOL_CALL, ReplyEvent, ReplyParser, parse_whole
from ..runtime.params import Logprob
from ..runtime.tokenizer import TokenizerError
from .engine_loop import Job, Update
from .protocol import (
    ChatChoice,
    ChatChunk,
    ChatLogprobs,
    ChatMessageOut,
    ChatRequest,
    ChatResponse,
    ChunkChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Delta,
    DetokenizeRequest,
    DetokenizeResponse,
    FunctionCallOut,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TokenLogprob,
    ToolCallDelta,
    ToolCallOut,
    TopLogprob,
    Usage,
)
from .state import APIError, EventStream, Result, ServerState, Submission, error_body, sse

router = APIRouter()
DONE = "data: [DONE]\n\n"
COMPLETION_MAX_TOKENS = 16                 # OpenAI's default for /v1/completions


def get_state(request: Request) -> ServerState:
    return request.app.state.dsv4


State = Annotated[ServerState, Depends(get_state)]


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


# ============================================================================ models, tokenizer
@router.get("/v1/models")
async def models(st: State) -> ModelList:
    return ModelList(data=[ModelCard(id=name, created=st.created, root=st.root, max_model_len=st.max_model_len)
                           for name in st.served_names])


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, st: State) -> TokenizeResponse:
    st.model_name(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give either prompt or messages", "prompt")
    if body.messages is not None:
        thinking = bool(body.chat_template_kwargs and body.chat_template_kwargs.thinking)
        ids = encode_chat(st, [m.to_encoder() for m in body.messages], thinking, None,
                          [t.model_dump(exclude_none=True) for t in body.tools or []])
    else:
        ids = st.tokenizer.encode(body.prompt)
    strs = [st.tokenizer.decode([i]) for i in ids] if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=st.max_model_len, tokens=ids, token_strs=strs)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, st: State) -> DetokenizeResponse:
    st.model_name(body.model)
    try:
        return DetokenizeResponse(prompt=st.tokenizer.decode(body.tokens))
    except TokenizerError as e:
        raise APIError(400, str(e), "tokens") from e


def encode_chat(st: ServerState, messages: list[dict], thinking: bool, effort: str | None,
                tools: list[dict] | None) -> list[int]:
    try:
        text = encode_messages(messages, thinking=thinking, reasoning_effort=effort, tools=tools or None)
    except ChatFormatError as e:
        raise APIError(400, str(e), "messages") from e
    return st.tokenizer.encode(text)


# ============================================================================ completions
@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, st: State):
    model = st.model_name(body.model)
    if body.best_of not in (None, body.n):
        raise APIError(400, "best_of other than n is not supported", "best_of")
    if body.echo and body.logprobs is not None:
        raise APIError(400, "echo with logprobs needs the prompt's logprobs, which dsv4 does not compute", "echo")
    prompts = _prompts(st, body.prompt)
    rid, n = new_id("cmpl-"), body.n
    jobs = [Job(f"{rid}-{k}", ids, st.params(
        len(ids), max_tokens=body.max_tokens, default_max_tokens=COMPLETION_MAX_TOKENS, temperature=body.temperature,
        top_p=body.top_p, top_k=body.top_k, min_p=body.min_p, seed=None if body.seed is None else body.seed + k % n,
        stop=body.stop, stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos, logprobs=body.logprobs,
        include_stop_str_in_output=body.include_stop_str_in_output, skip_special_tokens=body.skip_special_tokens),
        text) for k, (text, ids) in enumerate(p for p in prompts for _ in range(n))]
    echo = [(text if text is not None else st.tokenizer.decode(ids)) if body.echo else "" for text, ids in prompts]
    prompt_tokens = sum(len(ids) for _, ids in prompts)
    sub = st.submit(jobs)
    if body.stream:
        return EventStream(_completion_stream(st, sub, body, rid, model, echo, prompt_tokens), sub.abort)
    results = await sub.collect(request)
    choices = [CompletionChoice(index=k, text=echo[k // n] + r.text, finish_reason=r.finish_reason,
                                stop_reason=r.stop_reason,
                                logprobs=_completion_logprobs(r.token_ids, r.logprobs, body.logprobs, len(echo[k // n]))
                                if body.logprobs is not None else None)
               for k, r in enumerate(results)]
    return CompletionResponse(id=rid, model=model, choices=choices, usage=_usage(prompt_tokens, results))


def _prompts(st: ServerState, prompt) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) per prompt: a string, token ids, or a list of either."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    return [(p, st.tokenizer.encode(p)) if isinstance(p, str) else (None, list(p)) for p in prompt]


async def _completion_stream(st: ServerState, sub: Submission, body: CompletionRequest, rid: str, model: str,
                             echo: list[str], prompt_tokens: int):
    created, n = int(time.time()), body.n
    offsets = [len(echo[k // n]) for k in range(len(sub.request_ids))]
    results = [Result() for _ in sub.request_ids]

    def chunk(choices, usage=None) -> str:
        return sse(CompletionResponse(id=rid, created=created, model=model, choices=choices,
                                      usage=usage).model_dump_json())

    if body.echo:
        yield chunk([CompletionChoice(index=k, text=echo[k // n]) for k in range(len(sub.request_ids))])
    async for u in sub.updates():
        results[u.index].add(u)
        if u.finish_reason == "error":
            yield sse(json.dumps(error_body(500, f"the request failed while it ran: {u.error}")))
            continue
        logprobs = None
        if body.logprobs is not None and u.token_ids:
            logprobs = _completion_logprobs(u.token_ids, u.logprobs, body.logprobs, offsets[u.index])
            offsets[u.index] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
        yield chunk([CompletionChoice(index=u.index, text=u.text, logprobs=logprobs, finish_reason=u.finish_reason,
                                      stop_reason=u.stop_reason)])
    if body.include_usage:
        yield chunk([], _usage(prompt_tokens, results))
    yield DONE


def _top(lp: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k best (token id, Logprob) of a token's logprobs (which also hold the sampled token, of any rank)."""
    return sorted(lp.items(), key=lambda item: (item[1].rank, -item[1].logprob))[:k]


def _completion_logprobs(ids, logprobs, k: int, offset: int) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for t, lp in zip(ids, logprobs):
        out.tokens.append(lp[t].decoded_token)
        out.token_logprobs.append(lp[t].logprob)
        out.top_logprobs.append({x.decoded_token: x.logprob for _, x in _top(lp, k)})
        out.text_offset.append(offset)
        offset += len(lp[t].decoded_token)
    return out


def _usage(prompt_tokens: int, results: list[Result]) -> Usage:
    completion = sum(r.output_tokens for r in results)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion)


# ============================================================================ chat completions
@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: Request, st: State):
    model = st.model_name(body.model)
    try:
        thinking, effort = body.thinking_mode()
    except ValueError as e:
        raise APIError(400, str(e), "reasoning_effort") from e
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []] if body.tool_choice != "none" else None
    ids = encode_chat(st, [m.to_encoder() for m in body.messages], thinking, effort, tools)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    rid = new_id("chatcmpl-")
    jobs = [Job(f"{rid}-{i}", ids, st.params(
        len(ids), max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
        min_p=body.min_p, seed=None if body.seed is None else body.seed + i, stop=body.stop,
        stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        include_stop_str_in_output=body.include_stop_str_in_output, skip_special_tokens=body.skip_special_tokens,
        prompt_param="messages")) for i in range(body.n)]
    sub = st.submit(jobs)
    if body.stream:
        return EventStream(_chat_stream(st, sub, body, rid, model, thinking, len(ids)), sub.abort)
    results = await sub.collect(request)
    choices = []
    for i, r in enumerate(results):
        reply = parse_whole(r.text, thinking=thinking)
        calls = [ToolCallOut(id=new_id("call_"), function=FunctionCallOut(name=c.name, arguments=c.arguments))
                 for c in reply.tool_calls]
        message = ChatMessageOut(content=reply.content if reply.content or not calls else None,
                                 tool_calls=calls or None,
                                 reasoning_content=reply.reasoning_content if thinking else None)
        choices.append(ChatChoice(index=i, message=message, finish_reason=_finish(r.finish_reason, bool(calls)),
                                  stop_reason=r.stop_reason,
                                  logprobs=_chat_logprobs(st, r.token_ids, r.logprobs, body) if body.logprobs
                                  else None))
    return ChatResponse(id=rid, model=model, choices=choices, usage=_usage(len(ids), results))


def _finish(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if reason == "stop" and called else reason


def _chat_logprobs(st: ServerState, ids, logprobs, body: ChatRequest) -> ChatLogprobs:
    def entry(token: int, x: Logprob) -> dict:     # bytes: the token's own (a piece of a character stays whole)
        return dict(token=x.decoded_token, logprob=x.logprob, bytes=list(st.tokenizer.bytes_of(token)))

    return ChatLogprobs(content=[TokenLogprob(**entry(t, lp[t]), top_logprobs=[
        TopLogprob(**entry(*top)) for top in _top(lp, body.top_logprobs or 0)]) for t, lp in zip(ids, logprobs)])


def _deltas(events: list[ReplyEvent], call_ids: dict[int, str]) -> list[Delta]:
    out = []
    for e in events:
        if e.kind == REASONING:
            out.append(Delta(reasoning_content=e.text))
        elif e.kind == CONTENT:
            out.append(Delta(content=e.text))
        elif e.kind == TOOL_CALL:
            call_ids[e.index] = new_id("call_")
            out.append(Delta(tool_calls=[ToolCallDelta(index=e.index, id=call_ids[e.index], type="function",
                                                       function=FunctionCallOut(name=e.text, arguments=""))]))
        elif e.kind == ARGUMENTS:
            out.append(Delta(tool_calls=[ToolCallDelta(index=e.index, function=FunctionCallOut(arguments=e.text))]))
    return out


async def _chat_stream(st: ServerState, sub: Submission, body: ChatRequest, rid: str, model: str, thinking: bool,
                       prompt_tokens: int):
    created = int(time.time())
    parsers = [ReplyParser(thinking) for _ in sub.request_ids]
    call_ids: list[dict[int, str]] = [{} for _ in sub.request_ids]
    results = [Result() for _ in sub.request_ids]

    def chunk(index: int, delta: Delta, **kw) -> str:
        return sse(ChatChunk(id=rid, created=created, model=model,
                             choices=[ChunkChoice(index=index, delta=delta, **kw)]).model_dump_json())

    for i in range(len(sub.request_ids)):
        yield chunk(i, Delta(role="assistant", content=""))
    async for u in sub.updates():
        results[u.index].add(u)
        if u.finish_reason == "error":
            yield sse(json.dumps(error_body(500, f"the request failed while it ran: {u.error}")))
            continue
        events = update_events(parsers[u.index], u)
        logprobs = _chat_logprobs(st, u.token_ids, u.logprobs, body) if body.logprobs and u.token_ids else None
        for delta in _deltas(events, call_ids[u.index]) or ([Delta()] if logprobs else []):
            yield chunk(u.index, delta, logprobs=logprobs)
            logprobs = None
        if u.finished:
            yield chunk(u.index, Delta(), finish_reason=_finish(u.finish_reason, bool(call_ids[u.index])),
                        stop_reason=u.stop_reason)
    if body.include_usage:
        yield sse(ChatChunk(id=rid, created=created, model=model, choices=[],
                            usage=_usage(prompt_tokens, results)).model_dump_json())
    yield DONE


def update_events(parser: ReplyParser, u: Update) -> list[ReplyEvent]:
    """The reply events an engine update brings (its text, and what the parser held back if it finished)."""
    return parser.feed(u.text) + (parser.finish() if u.finished else [])
