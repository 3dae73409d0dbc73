"""DeepSeek-V4 chat format: messages to a prompt string, and the model's reply back to content, reasoning
and tool calls. V4 has no Jinja template; this is our implementation of DeepSeek's `encoding/encoding_dsv4.py`
(V4 Hugging Face repos) and reproduces its golden outputs (tests/test_chat.py).

Prompt = BOS, then per message (OpenAI-style dicts):
  system            content [+ "\\n\\n" tools prompt] [+ "\\n\\n" response-format prompt]
  developer         <｜User｜>content [+ tools prompt] [+ response-format prompt]
  user              <｜User｜>content; `tool` messages merge into a user turn as <tool_result>..</tool_result>
                    blocks (ordered as the assistant's tool_calls), blocks joined by "\\n\\n"
  latest_reminder   <｜latest_reminder｜>content
  assistant         [reasoning</think>]content["\\n\\n" DSML tool_calls block]<｜end▁of▁sentence｜>
A user/developer turn that ends the prompt or precedes an assistant turn is followed by <｜Assistant｜> and
"<think>" (thinking mode) or "</think>" (chat mode). In thinking mode, reasoning of assistant turns before
the last user turn is dropped (and so are earlier developer turns) unless drop_thinking=False or any message
carries tools. The reasoning-effort prompt goes first (thinking mode only). A user message may carry a
DeepSeek "quick instruction" `task` (action, query, ...), whose token replaces the usual transition.

Deviations, all on inputs the official code mishandles: content given as a list of text parts is joined with
"\\n\\n" (as DeepSeek's vision variant does); non-text parts, a task that the official merge would lose, a
non-object arguments JSON and duplicate tool lists raise ChatFormatError; tool-call arguments may be a dict
(vLLM) and None means no arguments. Parsing is strict like the official parser (any malformed reply raises
ChatParseError) with two relaxations: the final EOS may be absent (the engine strips it), and a zero-argument
tool call may be written with the blank line the encoder itself emits.
"""
from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START, THINK_END = "<think>", "</think>"
DSML = "｜DSML｜"
# DSML tool-call markup: the encoder writes it, parse_reply and chat_stream.ReplyParser read it.
TOOL_CALLS_OPEN, TOOL_CALLS_CLOSE = f"<{DSML}tool_calls>", f"</{DSML}tool_calls>"
INVOKE_OPEN, INVOKE_CLOSE = f"<{DSML}invoke", f"</{DSML}invoke>"
PARAMETER_OPEN, PARAMETER_CLOSE = f"<{DSML}parameter", f"</{DSML}parameter>"
# DeepSeek's "quick instruction" tasks (classification prompts): task name -> its special token.
TASK_TOKENS = MappingProxyType({t: f"<｜{t}｜>" for t in ("action", "query", "authority", "domain", "title",
                                                         "read_url")})

_ABSOLUTE_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n")
_BEYOND_MAX = (
    "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively decompose "
    "the problem into its most fundamental components, trace every causal chain to its root, and resolve the "
    "underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles and are certain "
    "that no assumption remains unchecked and no error remains undiscovered.\n\n")
# Reasoning-effort prompt by encoding revision: "v4" is the original V4-Flash/V4-Pro release; the 0731
# refresh of V4-Flash moved the old "max" text to "high" and added a stronger "max".
EFFORT_PROMPTS = MappingProxyType({
    "v4": MappingProxyType({None: "", "high": "", "max": _ABSOLUTE_MAX}),
    "v4-0731": MappingProxyType({None: "", "low": "", "high": _ABSOLUTE_MAX, "max": _BEYOND_MAX}),
})

_TOOLS_PROMPT = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{dsml}tool_calls>" block like the following:

<{dsml}tool_calls>
<{dsml}invoke name="$TOOL_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$TOOL_NAME2">
...
</{dsml}invoke>
</{dsml}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {think_start}), you MUST output your complete reasoning inside {think_start}...{think_end} BEFORE any tool calls or final response.

Otherwise, output directly after {think_end} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""
_RESPONSE_FORMAT_PROMPT = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{}"
_TOOL_CALLS_START = f"\n\n<{DSML}tool_calls"
_TOOL_CALLS_END = TOOL_CALLS_CLOSE


class ChatFormatError(ValueError):
    pass


class ChatParseError(ValueError):
    pass


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


# ============================================================================ encoding
def encode_messages(messages: list[dict], *, thinking: bool = False, reasoning_effort: str | None = None,
                    tools: list[dict] | None = None, drop_thinking: bool = True, add_bos: bool = True,
                    context: list[dict] | None = None, revision: str = "v4") -> str:
    """Prompt string for `messages`. `context`: earlier messages already in the KV cache (not rendered, no BOS).
    `tools` (OpenAI format) go on a leading system/developer message, or a new empty system message."""
    if revision not in EFFORT_PROMPTS:
        raise ChatFormatError(f"unknown encoding revision {revision!r}; expected one of {list(EFFORT_PROMPTS)}")
    if reasoning_effort not in EFFORT_PROMPTS[revision]:
        raise ChatFormatError(f"reasoning_effort {reasoning_effort!r} is not one of "
                              f"{list(EFFORT_PROMPTS[revision])} (revision {revision!r})")
    context = [_normalize(m, i) for i, m in enumerate(context or [])]
    messages = [_normalize(m, i) for i, m in enumerate(messages)]
    if tools:
        if context:
            raise ChatFormatError("tools= cannot be combined with context=; put them on the first message")
        messages = _attach_tools(messages, tools)

    messages = _sort_tool_results(context + _merge_tool_messages(messages))[len(context):]
    context = _sort_tool_results(_merge_tool_messages(context))
    full = context + messages
    drop = drop_thinking and not any(m.get("tools") for m in full)
    if thinking and drop:
        full = _drop_old_thinking(full)
        start = len(_drop_old_thinking(context))
    else:
        start = len(context)
    effort = EFFORT_PROMPTS[revision][reasoning_effort] if thinking else ""
    prompt = BOS if add_bos and not context else ""
    return prompt + "".join(_render(i, full, thinking, drop, effort) for i in range(start, len(full)))


def _normalize(msg: dict, index: int) -> dict:
    msg = copy.deepcopy(msg)
    role = msg.get("role")
    if role not in ("system", "developer", "user", "assistant", "tool", "latest_reminder"):
        raise ChatFormatError(f"message {index}: unknown role {role!r}")
    if isinstance(msg.get("content"), list):
        msg["content"] = _flatten_parts(msg["content"], index)
    if "reasoning" in msg:  # vLLM's name for reasoning_content
        reasoning = msg.pop("reasoning")
        if msg.get("reasoning_content", reasoning) != reasoning:
            raise ChatFormatError(f"message {index}: reasoning and reasoning_content differ")
        msg["reasoning_content"] = reasoning
    if msg.get("tools") and role not in ("system", "developer"):
        raise ChatFormatError(f"message {index}: tools can only be declared on a system or developer message")
    if role in ("user", "tool", "latest_reminder") and not isinstance(msg.get("content"), str):
        raise ChatFormatError(f"message {index}: a {role} message needs string content, got {msg.get('content')!r}")
    if role == "developer" and not msg.get("content"):
        raise ChatFormatError(f"message {index}: a developer message needs content")
    if msg.get("task") is not None and msg["task"] not in TASK_TOKENS:
        raise ChatFormatError(f"message {index}: unknown task {msg['task']!r}; expected one of {list(TASK_TOKENS)}")
    return msg


def _flatten_parts(parts: list, index: int) -> str:
    texts = []
    for part in parts:
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ChatFormatError(f"message {index}: content part of type {kind!r} is not supported (text only)")
        texts.append(part["text"])
    return "\n\n".join(texts)


def _attach_tools(messages: list[dict], tools: list[dict]) -> list[dict]:
    if messages and messages[0]["role"] in ("system", "developer"):
        if messages[0].get("tools"):
            raise ChatFormatError("tools given both as tools= and on the first message")
        return [{**messages[0], "tools": tools}, *messages[1:]]
    return [{"role": "system", "content": "", "tools": tools}, *messages]


def _merge_tool_messages(messages: list[dict]) -> list[dict]:
    """Tool results become tool_result blocks of a user turn; consecutive user turns merge into one."""
    merged: list[dict] = []
    for msg in messages:
        role = msg["role"]
        mergeable = merged and merged[-1]["role"] == "user" and "content_blocks" in merged[-1]
        if role == "tool":
            block = {"type": "tool_result", "tool_use_id": msg.get("tool_call_id", ""),
                     "content": msg.get("content", "")}
            if mergeable:
                merged[-1]["content_blocks"].append(block)
            else:
                merged.append({"role": "user", "content_blocks": [block]})
        elif role == "user":
            block = {"type": "text", "text": msg.get("content", "")}
            if mergeable and merged[-1].get("task") is None:
                if msg.get("task") is not None or msg.get("wo_eos"):
                    raise ChatFormatError("a user message with a task or wo_eos follows another user turn and "
                                          "would be merged into it (its task would be lost)")
                merged[-1]["content_blocks"].append(block)
            else:
                keep = {k: msg[k] for k in ("task", "wo_eos") if k in msg}
                merged.append({"role": "user", "content": msg.get("content", ""), "content_blocks": [block], **keep})
        else:
            merged.append(msg)
    return merged


def _sort_tool_results(messages: list[dict]) -> list[dict]:
    """Within a user turn, order tool_result blocks as the preceding assistant's tool_calls."""
    order: dict[str, int] = {}
    for msg in messages:
        if msg["role"] == "assistant" and msg.get("tool_calls"):
            order = {tc.get("id") or tc.get("function", {}).get("id", ""): i for i, tc in enumerate(msg["tool_calls"])}
            order.pop("", None)
        elif msg["role"] == "user" and msg.get("content_blocks"):
            results = [b for b in msg["content_blocks"] if b["type"] == "tool_result"]
            if len(results) > 1 and order:
                ordered = iter(sorted(results, key=lambda b: order.get(b["tool_use_id"], 0)))
                msg["content_blocks"] = [next(ordered) if b["type"] == "tool_result" else b
                                         for b in msg["content_blocks"]]
    return messages


def _last_user_index(messages: list[dict]) -> int:
    return max((i for i, m in enumerate(messages) if m["role"] in ("user", "developer")), default=-1)


def _drop_old_thinking(messages: list[dict]) -> list[dict]:
    """Before the last user turn: assistant turns lose their reasoning, developer turns are dropped."""
    last_user = _last_user_index(messages)
    kept = []
    for i, msg in enumerate(messages):
        if msg["role"] in ("user", "system", "latest_reminder") or i >= last_user:
            kept.append(msg)
        elif msg["role"] == "assistant":
            kept.append({k: v for k, v in msg.items() if k != "reasoning_content"})
    return kept


def _render(index: int, messages: list[dict], thinking: bool, drop_thinking: bool, effort: str) -> str:
    msg, role = messages[index], messages[index]["role"]
    last_user = _last_user_index(messages)
    out = effort if index == 0 else ""
    if role in ("system", "developer"):
        out += (USER if role == "developer" else "") + (msg.get("content") or "")
        if msg.get("tools"):
            out += "\n\n" + _render_tools(msg["tools"])
        if msg.get("response_format"):
            out += "\n\n" + _RESPONSE_FORMAT_PROMPT.format(_json(msg["response_format"]))
    elif role == "user":
        out += USER + "\n\n".join(_render_block(b) for b in msg["content_blocks"])
    elif role == "latest_reminder":
        out += LATEST_REMINDER + msg["content"]
    else:  # assistant
        prev_has_task = index > 0 and messages[index - 1].get("task") is not None
        if thinking and not prev_has_task and (not drop_thinking or index > last_user):
            out += (msg.get("reasoning_content") or "") + THINK_END
        out += msg.get("content") or ""
        if msg.get("tool_calls"):
            out += "\n\n" + _render_tool_calls(msg["tool_calls"])
        out += "" if msg.get("wo_eos") else EOS

    # What follows: nothing before a user/system/developer turn; otherwise the assistant's opening.
    if index + 1 < len(messages) and messages[index + 1]["role"] not in ("assistant", "latest_reminder"):
        return out
    task = msg.get("task")
    if task is not None and task != "action":
        out += TASK_TOKENS[task]
    elif task == "action":
        out += ASSISTANT + (THINK_START if thinking else THINK_END) + TASK_TOKENS[task]
    elif role in ("user", "developer"):
        opens_thinking = thinking and (not drop_thinking or index >= last_user)
        out += ASSISTANT + (THINK_START if opens_thinking else THINK_END)
    return out


def _render_block(block: dict) -> str:
    if block["type"] == "text":
        return block["text"]
    return f"<tool_result>{block['content']}</tool_result>"


def _render_tools(tools: list[dict]) -> str:
    schemas = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
            raise ChatFormatError(f"tool {i}: expected OpenAI format {{'type': 'function', 'function': {{...}}}}")
        schemas.append(_json(tool["function"]))
    return _TOOLS_PROMPT.format(dsml=DSML, think_start=THINK_START, think_end=THINK_END, schemas="\n".join(schemas))


def _render_tool_calls(tool_calls: list[dict]) -> str:
    invokes = []
    for i, tc in enumerate(tool_calls):
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ChatFormatError(f"tool call {i}: expected {{'function': {{'name': ..., 'arguments': ...}}}}")
        params = "\n".join(
            f'{PARAMETER_OPEN} name="{k}" string="{str(isinstance(v, str)).lower()}">'
            f'{v if isinstance(v, str) else _json(v)}{PARAMETER_CLOSE}'
            for k, v in _arguments(fn.get("arguments"), fn["name"]).items())
        invokes.append(f'{INVOKE_OPEN} name="{fn["name"]}">\n{params}\n{INVOKE_CLOSE}')
    return f"{TOOL_CALLS_OPEN}\n" + "\n".join(invokes) + f"\n{TOOL_CALLS_CLOSE}"


def _arguments(raw: Any, name: str) -> dict:
    if raw is None:
        return {}
    if isinstance(raw, dict):
        return raw
    try:
        args = json.loads(raw)
    except (TypeError, ValueError):
        return {"arguments": raw}  # official fallback for arguments that are not JSON
    if not isinstance(args, dict):
        raise ChatFormatError(f"tool call {name!r}: arguments must be a JSON object, got {raw!r}")
    return args


# ============================================================================ parsing
@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON object text


@dataclass(frozen=True)
class AssistantReply:
    content: str
    reasoning_content: str
    tool_calls: tuple[ToolCall, ...] = ()

    def to_message(self) -> dict:
        """OpenAI-style assistant message (tool calls without ids: the server assigns them)."""
        return {"role": "assistant", "content": self.content, "reasoning_content": self.reasoning_content,
                "tool_calls": [{"type": "function", "function": {"name": t.name, "arguments": t.arguments}}
                               for t in self.tool_calls]}


def parse_reply(text: str, *, thinking: bool) -> AssistantReply:
    """Split the generated text (everything after the prompt's <think> or </think>) into reasoning,
    content and DSML tool calls. Malformed text raises ChatParseError."""
    pos, reasoning = 0, ""
    if thinking:
        pos, reasoning, stop = _read_until(text, pos, [THINK_END, _TOOL_CALLS_START])
        if stop != THINK_END:
            raise ChatParseError("thinking reply has no </think>")
    pos, content, stop = _read_until(text, pos, [EOS, _TOOL_CALLS_START])
    calls: list[ToolCall] = []
    if stop == _TOOL_CALLS_START:
        pos, calls = _parse_tool_calls(text, pos)
        pos, rest, stop = _read_until(text, pos, [EOS])
        if rest:
            raise ChatParseError(f"unexpected text after the tool calls: {rest[:80]!r}")
    if pos != len(text):
        raise ChatParseError(f"unexpected text after EOS: {text[pos:pos + 80]!r}")
    for token in (BOS, EOS, THINK_START, THINK_END, DSML):
        if token in content or token in reasoning:
            raise ChatParseError(f"special token {token!r} inside the reply's content or reasoning")
    return AssistantReply(content, reasoning, tuple(calls))


def _read_until(text: str, pos: int, stops: list[str]) -> tuple[int, str, str | None]:
    """(position after the earliest stop, text before it, the stop); (len, rest, None) if none occurs."""
    hits = [(i, s) for s in stops if (i := text.find(s, pos)) != -1]
    if not hits:
        return len(text), text[pos:], None
    i, s = min(hits, key=lambda h: h[0])
    return i + len(s), text[pos:i], s


_INVOKE_NAME = re.compile(r'\s*name="(.*?)">\n\n?', re.DOTALL)   # "\n\n": the encoder's zero-argument form
_PARAMETER = re.compile(r' name="(.*?)" string="(true|false)">(.*?)<', re.DOTALL)


def _parse_tool_calls(text: str, pos: int) -> tuple[int, list[ToolCall]]:
    invoke, param = INVOKE_OPEN, PARAMETER_OPEN
    end_invoke, end_param = INVOKE_CLOSE.removesuffix(">"), PARAMETER_CLOSE.removeprefix("<").removesuffix(">")
    calls = []
    while True:
        pos, between, stop = _read_until(text, pos, [invoke, _TOOL_CALLS_END])
        if between != ">\n":
            raise ChatParseError(f"tool calls: expected '>\\n' before the next tag, got {between[:80]!r}")
        if stop == _TOOL_CALLS_END:
            return pos, calls
        if stop is None:
            raise ChatParseError(f"tool calls: block not closed with {_TOOL_CALLS_END}")
        pos, head, stop = _read_until(text, pos, [param, end_invoke])
        name = _INVOKE_NAME.fullmatch(head)
        if name is None or stop is None:
            raise ChatParseError(f"tool calls: malformed invoke {head[:80]!r}")
        args: dict[str, str] = {}
        while stop == param:
            pos, body, stop = _read_until(text, pos, [end_param])
            kv = _PARAMETER.fullmatch(body)
            if kv is None or stop is None:
                raise ChatParseError(f"tool {name[1]!r}: malformed parameter {body[:80]!r}")
            key, is_string, value = kv.groups()
            if key in args:
                raise ChatParseError(f"tool {name[1]!r}: duplicate parameter {key!r}")
            if is_string == "false":
                try:
                    json.loads(value)
                except ValueError:
                    raise ChatParseError(f"tool {name[1]!r}: parameter {key!r} is marked string=\"false\" "
                                         f"but is not JSON: {value[:80]!r}") from None
            args[key] = _json(value) if is_string == "true" else value
            pos, between, stop = _read_until(text, pos, [param, end_invoke])
            if between != ">\n" or stop is None:
                raise ChatParseError(f"tool {name[1]!r}: expected '>\\n' after a parameter, got {between[:80]!r}")
        calls.append(ToolCall(name[1], "{" + ", ".join(f"{_json(k)}: {v}" for k, v in args.items()) + "}"))
