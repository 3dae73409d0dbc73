"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens): what many agent tools speak.

Messages map onto DeepSeek-V4's chat encoding: `system` becomes the system message, tool_result blocks become tool
messages, an assistant's thinking / text / tool_use blocks become reasoning_content / content / tool_calls. The
reply comes back as thinking, text and tool_use blocks (streamed as Anthropic's content_block events, tool input
as input_json_delta). `thinking: {"type": "enabled"}` turns V4's thinking mode on (budget_tokens is not
enforced); image and document blocks are refused.
"""

from __future__ import annotations

import json
from types import MappingProxyType

from fastapi import APIRouter, Request

from ..runtime.chat_stream import ARGUMENTS, CONTENT, REASONING, TOOL_CALL, ReplyParser, parse_whole
from .engine_loop import Job
from .openai import State, encode_chat, new_id, update_events
from .protocol import AnthropicBlock, AnthropicRequest, AnthropicResponse, AnthropicUsage
from .state import APIError, EventStream, Result, ServerState, Submission, error_body, sse

router = APIRouter()
# reply event kind -> (block type, delta type, text field)
BLOCK_TYPES = MappingProxyType({REASONING: ("thinking", "thinking_delta", "thinking"),
                               CONTENT: ("text", "text_delta", "text")})


@router.post("/v1/messages")
async def messages(body: AnthropicRequest, request: Request, st: State):
    model = st.model_name(body.model)
    thinking, ids = _prompt(st, body)
    params = st.params(len(ids), max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p,
                       top_k=body.top_k, stop=body.stop_sequences, prompt_param="messages")
    rid = new_id("msg_")
    sub = st.submit([Job(rid, ids, params)])
    if body.stream:
        return EventStream(_stream(sub, rid, model, thinking, len(ids)), sub.abort)
    result = (await sub.collect(request))[0]
    reply = parse_whole(result.text, thinking=thinking)
    content = []
    if reply.reasoning_content:
        content.append({"type": "thinking", "thinking": reply.reasoning_content, "signature": ""})
    if reply.content:
        content.append({"type": "text", "text": reply.content})
    content += [{"type": "tool_use", "id": new_id("toolu_"), "name": c.name, "input": _input(c.arguments)}
                for c in reply.tool_calls]
    stop_reason, stop_sequence = _stop(result, bool(reply.tool_calls))
    return AnthropicResponse(id=rid, model=model, content=content, stop_reason=stop_reason, stop_sequence=stop_sequence,
                             usage=AnthropicUsage(input_tokens=len(ids), output_tokens=result.output_tokens))


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: dict, st: State) -> dict:
    body.setdefault("max_tokens", 1)
    try:
        parsed = AnthropicRequest.model_validate(body)
    except ValueError as e:
        raise APIError(400, str(e)) from e
    st.model_name(parsed.model)
    return {"input_tokens": len(_prompt(st, parsed)[1])}


def _prompt(st: ServerState, body: AnthropicRequest) -> tuple[bool, list[int]]:
    """(thinking, prompt token ids)."""
    thinking = body.thinking is not None and body.thinking.type != "disabled"
    tools = None
    if body.tools and not (body.tool_choice and body.tool_choice.type == "none"):
        tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                   "parameters": t.input_schema}} for t in body.tools]
    return thinking, encode_chat(st, _messages(body), thinking, None, tools)


def _text(blocks: str | list, where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    texts = []
    for b in blocks:
        b = b if isinstance(b, AnthropicBlock) else AnthropicBlock.model_validate(b)
        if b.type != "text" or b.text is None:
            raise APIError(400, f"{where}: {b.type} blocks are not supported here (text only)", "messages")
        texts.append(b.text)
    return "\n\n".join(texts)


def _messages(body: AnthropicRequest) -> list[dict]:
    """Anthropic messages as the OpenAI-style messages the V4 encoder takes."""
    out = [{"role": "system", "content": _text(body.system, "system")}] if body.system else []
    for i, m in enumerate(body.messages):
        blocks = [AnthropicBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        if m.role == "user":
            texts = []
            for b in blocks:
                if b.type == "tool_result":
                    out.append({"role": "tool", "tool_call_id": b.tool_use_id or "",
                                "content": _text(b.content or "", f"messages[{i}] tool_result")})
                elif b.type == "text":
                    texts.append(b.text or "")
                else:
                    raise APIError(400, f"messages[{i}]: {b.type} blocks are not supported (text and tool_result "
                                        "only)", "messages")
            if texts:
                out.append({"role": "user", "content": "\n\n".join(texts)})
            continue
        msg = {"role": "assistant", "content": "".join(b.text or "" for b in blocks if b.type == "text"),
               "reasoning_content": "".join(b.thinking or "" for b in blocks if b.type == "thinking")}
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input or {}}}
                 for b in blocks if b.type == "tool_use"]
        if any(b.type not in ("text", "thinking", "redacted_thinking", "tool_use") for b in blocks):
            raise APIError(400, f"messages[{i}]: an assistant message holds text, thinking and tool_use blocks",
                           "messages")
        out.append({**msg, "tool_calls": calls} if calls else msg)
    return out


def _input(arguments: str) -> dict:
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {"arguments": arguments}


def _stop(result: Result, called: bool) -> tuple[str | None, str | None]:
    if result.finish_reason == "stop":
        if isinstance(result.stop_reason, str):
            return "stop_sequence", result.stop_reason
        return ("tool_use" if called else "end_turn"), None
    return ("max_tokens" if result.finish_reason == "length" else result.finish_reason), None


async def _stream(sub: Submission, rid: str, model: str, thinking: bool, prompt_tokens: int):
    def event(kind: str, **data) -> str:
        return sse(json.dumps({"type": kind, **data}, ensure_ascii=False), kind)

    yield event("message_start", message={"id": rid, "type": "message", "role": "assistant", "model": model,
                                          "content": [], "stop_reason": None, "stop_sequence": None,
                                          "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}})
    parser, result = ReplyParser(thinking), Result()
    block, index, called = None, -1, False       # the open block: its (kind, call index) and position
    async for u in sub.updates():
        result.add(u)
        if u.finish_reason == "error":
            yield sse(json.dumps(error_body(500, f"the request failed while it ran: {u.error}", path="/v1/messages")),
                      "error")
            return
        for e in update_events(parser, u):
            key = (e.kind if e.kind != ARGUMENTS else TOOL_CALL, e.index)
            if key != block:
                if block is not None:
                    yield event("content_block_stop", index=index)
                block, index = key, index + 1
                if e.kind == TOOL_CALL:
                    called = True
                    start = {"type": "tool_use", "id": new_id("toolu_"), "name": e.text, "input": {}}
                else:
                    kind, _, field = BLOCK_TYPES[e.kind]
                    start = {"type": kind, field: "", **({"signature": ""} if kind == "thinking" else {})}
                yield event("content_block_start", index=index, content_block=start)
            if e.kind == ARGUMENTS:
                yield event("content_block_delta", index=index,
                            delta={"type": "input_json_delta", "partial_json": e.text})
            elif e.kind != TOOL_CALL:
                _, delta, field = BLOCK_TYPES[e.kind]
                yield event("content_block_delta", index=index, delta={"type": delta, field: e.text})
    if block is not None:
        yield event("content_block_stop", index=index)
    stop_reason, stop_sequence = _stop(result, called)
    yield event("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                usage={"output_tokens": result.output_tokens})
    yield event("message_stop")
