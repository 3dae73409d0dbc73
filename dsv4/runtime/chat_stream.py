"""DeepSeek-V4's reply parsed as it streams: reasoning, content and DSML tool calls, as deltas.

`parse_reply` (chat.py) reads a finished reply strictly; a server must split the text while it arrives, a token
at a time, and never let tool-call markup reach `content` (the most reported V4 serving bug elsewhere). Feed the
text in pieces of any size; every piece returns the events that became certain:

    parser = ReplyParser(thinking=True)
    for piece in pieces:
        for event in parser.feed(piece): ...      # ReplyEvent(kind, text, index)
    events = parser.finish()                      # what was held back; parser.reply() -> AssistantReply

Kinds: REASONING and CONTENT (text), TOOL_CALL (a new call: `text` is its function name, `index` its position
in the reply) and ARGUMENTS (the next piece of call `index`'s JSON arguments, which together read exactly as
`parse_reply` writes them: `{"key": value, ...}`). The events of a reply do not depend on how it was split.

What is held back: a tail that may be the start of `</think>` or of a DSML tag, and trailing whitespace of
content (the blank line before a tool-call block belongs to the markup). Reasoning ends at `</think>` or at a
DSML tag (a model that forgets `</think>` before calling a tool). The tool-call grammar is the encoder's, with
any whitespace between tags, the `<｜DSML｜tool_calls>` wrapper optional, and `string="..."` optional on a
parameter. A string value streams as JSON-escaped pieces; any other value is emitted when it closes, as is when
it is JSON and as a JSON string otherwise. A call is announced (TOOL_CALL, then ARGUMENTS "{") once its invoke
tag is complete. Markup the grammar does not accept is returned as content, verbatim, from the start of its
block (or, inside a call already announced, from where it went wrong; that call's arguments stay as they
were sent); parsing resumes after it, so a later well-formed call is still a call. A reply that ends inside
a block (max_tokens) drops the unfinished markup; a call already announced keeps its partial arguments.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from .chat import (
    DSML,
    INVOKE_CLOSE,
    INVOKE_OPEN,
    PARAMETER_CLOSE,
    PARAMETER_OPEN,
    THINK_END,
    TOOL_CALLS_CLOSE,
    TOOL_CALLS_OPEN,
    AssistantReply,
    ToolCall,
)

REASONING, CONTENT, TOOL_CALL, ARGUMENTS = "reasoning", "content", "tool_call", "arguments"
TAG = "<" + DSML                        # every DSML opening tag starts so
_HEAD_LIMIT = 512                       # an invoke / parameter tag longer than this is malformed
_INVOKE_HEAD = re.compile(r'\s+name="([^"<>]+)"\s*')
_PARAMETER_HEAD = re.compile(r'\s+name="([^"<>]+)"(?:\s+string="(true|false)")?\s*')


@dataclass(frozen=True)
class ReplyEvent:
    kind: str                          # REASONING | CONTENT | TOOL_CALL | ARGUMENTS
    text: str                          # the text; TOOL_CALL: the function name
    index: int = -1                    # TOOL_CALL / ARGUMENTS: the call's position in the reply


class _Malformed(Exception):
    pass


def _held(text: str, *markers: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `markers`."""
    for k in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(text[-k:]) for m in markers):
            return k
    return 0


def _escaped(text: str) -> str:
    """`text` as the inside of a JSON string (per character, so pieces concatenate to the whole's escape)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def parse_whole(text: str, *, thinking: bool) -> AssistantReply:
    """A finished reply split exactly as streaming splits it (unlike `parse_reply`, malformed markup is content)."""
    parser = ReplyParser(thinking)
    parser.feed(text)
    parser.finish()
    return parser.reply()


class ReplyParser:
    def __init__(self, thinking: bool):
        self._state = self._reasoning if thinking else self._content
        self._buf = ""
        self._hidden = ""              # markup read since the last event it showed (content if it proves malformed)
        self._calls = 0                # calls announced so far
        self._args = 0                 # parameters of the current call so far
        self._done = False
        self.events: list[ReplyEvent] = []

    # ------------------------------------------------------------------ interface
    def feed(self, text: str) -> list[ReplyEvent]:
        if self._done:
            raise RuntimeError("ReplyParser.feed after finish")
        self._buf += text
        out: list[ReplyEvent] = []
        while self._buf:
            try:
                if not self._state(out):
                    break
            except _Malformed:
                # Show the markup read so far and the character where it broke; go on reading content.
                self._emit(out, CONTENT, self._hidden + self._buf[0])
                self._buf, self._hidden, self._state = self._buf[1:], "", self._content
        return self._record(out)

    def finish(self) -> list[ReplyEvent]:
        """The end of the reply: what was held back. Unfinished markup is dropped."""
        out: list[ReplyEvent] = []
        if not self._done and self._state in (self._reasoning, self._content):
            self._emit(out, REASONING if self._state == self._reasoning else CONTENT, self._buf)
        self._buf, self._done = "", True
        return self._record(out)

    def reply(self) -> AssistantReply:
        """Everything so far as one reply (call after `finish` for the whole of it)."""
        names: dict[int, str] = {}
        args: dict[int, list[str]] = {}
        for e in self.events:
            if e.kind == TOOL_CALL:
                names[e.index], args[e.index] = e.text, []
            elif e.kind == ARGUMENTS:
                args[e.index].append(e.text)
        text = {kind: "".join(e.text for e in self.events if e.kind == kind) for kind in (REASONING, CONTENT)}
        calls = tuple(ToolCall(names[i], "".join(args[i])) for i in sorted(names))
        return AssistantReply(text[CONTENT], text[REASONING], calls)

    # ------------------------------------------------------------------ states: each consumes what it can and
    # returns whether to go on (False: it needs more text)
    def _reasoning(self, out: list) -> bool:
        end, tag = self._buf.find(THINK_END), self._buf.find(TAG)
        if end >= 0 and (tag < 0 or end < tag):
            self._emit(out, REASONING, self._buf[:end])
            self._buf, self._state = self._buf[end + len(THINK_END):], self._content
            return True
        if tag >= 0:
            self._emit(out, REASONING, self._buf[:tag])
            self._buf, self._state = self._buf[tag:], self._block
            return True
        keep = len(self._buf) - _held(self._buf, THINK_END, TAG)
        self._emit(out, REASONING, self._buf[:keep])
        self._buf = self._buf[keep:]
        return False

    def _content(self, out: list) -> bool:
        tag = self._buf.find(TAG)
        if tag >= 0:
            text = self._buf[:tag].rstrip()
            self._emit(out, CONTENT, text)
            self._hidden = self._buf[len(text):tag]          # the blank line before the block is markup
            self._buf, self._state = self._buf[tag:], self._block
            return True
        keep = len(self._buf[:len(self._buf) - _held(self._buf, TAG)].rstrip())
        self._emit(out, CONTENT, self._buf[:keep])
        self._buf = self._buf[keep:]
        return False

    def _block(self, out: list) -> bool:
        return self._expect({TOOL_CALLS_OPEN: self._invokes, INVOKE_OPEN: self._invoke_head})  # wrapper optional

    def _invokes(self, out: list) -> bool:
        return self._expect({INVOKE_OPEN: self._invoke_head, TOOL_CALLS_CLOSE: self._content}, skip_space=True)

    def _invoke_head(self, out: list) -> bool:
        name = self._head(_INVOKE_HEAD)
        if name is None:
            return False
        out.append(ReplyEvent(TOOL_CALL, name[1], self._calls))
        out.append(ReplyEvent(ARGUMENTS, "{", self._calls))
        self._calls, self._args, self._hidden, self._state = self._calls + 1, 0, "", self._parameters
        return True

    def _parameters(self, out: list) -> bool:
        text = self._buf.lstrip()
        if text.startswith(INVOKE_CLOSE):
            self._emit(out, ARGUMENTS, "}")
            self._buf, self._state = text[len(INVOKE_CLOSE):], self._invokes
            return True
        return self._expect({PARAMETER_OPEN: self._parameter_head, INVOKE_CLOSE: self._invokes}, skip_space=True)

    def _parameter_head(self, out: list) -> bool:
        head = self._head(_PARAMETER_HEAD)
        if head is None:
            return False
        key, is_string = head.groups()
        self._emit(out, ARGUMENTS, (", " if self._args else "") + json.dumps(key, ensure_ascii=False) + ": ")
        self._args += 1
        if is_string == "true":
            self._emit(out, ARGUMENTS, '"')
            self._state = self._string_value
        else:
            self._state = self._json_value
        return True

    def _string_value(self, out: list) -> bool:
        end = self._buf.find(PARAMETER_CLOSE)
        if end >= 0:
            self._emit(out, ARGUMENTS, _escaped(self._buf[:end]) + '"')
            self._buf, self._state = self._buf[end + len(PARAMETER_CLOSE):], self._parameters
            return True
        keep = len(self._buf) - _held(self._buf, PARAMETER_CLOSE)
        self._emit(out, ARGUMENTS, _escaped(self._buf[:keep]))
        self._buf = self._buf[keep:]
        return False

    def _json_value(self, out: list) -> bool:
        end = self._buf.find(PARAMETER_CLOSE)
        if end < 0:
            return False
        value = self._buf[:end]
        try:
            json.loads(value)
        except ValueError:
            value = json.dumps(value, ensure_ascii=False)
        self._emit(out, ARGUMENTS, value)
        self._buf, self._state = self._buf[end + len(PARAMETER_CLOSE):], self._parameters
        return True

    # ------------------------------------------------------------------ helpers
    def _expect(self, tags: dict, skip_space: bool = False) -> bool:
        """Consume the tag `self._buf` starts with and go to its state; False if the text so far may still
        become one of them; _Malformed if it cannot."""
        text = self._buf.lstrip() if skip_space else self._buf
        for tag, state in tags.items():
            if text.startswith(tag):
                cut = len(self._buf) - len(text) + len(tag)
                self._hidden += self._buf[:cut]
                self._buf, self._state = self._buf[cut:], state
                if state == self._content:                  # the block closed
                    self._hidden = ""
                return True
        if not text or any(tag.startswith(text) for tag in tags):
            return False
        raise _Malformed

    def _head(self, pattern: re.Pattern) -> re.Match | None:
        """The rest of an invoke / parameter tag, up to its '>' (consumed), matched against `pattern`."""
        end = self._buf.find(">")
        if end < 0:
            if len(self._buf) > _HEAD_LIMIT or "<" in self._buf:
                raise _Malformed
            return None
        match = pattern.fullmatch(self._buf[:end])
        if match is None:
            raise _Malformed
        self._hidden += self._buf[:end + 1]
        self._buf = self._buf[end + 1:]
        return match

    def _emit(self, out: list, kind: str, text: str) -> None:
        if text:
            if kind == ARGUMENTS:                          # the markup read so far is shown
                self._hidden = ""
            out.append(ReplyEvent(kind, text, self._calls - 1 if kind == ARGUMENTS else -1))

    def _record(self, out: list[ReplyEvent]) -> list[ReplyEvent]:
        """Merge neighbouring events of one kind and call; remember them for `reply`."""
        merged: list[ReplyEvent] = []
        for e in out:
            if merged and merged[-1].kind == e.kind != TOOL_CALL and merged[-1].index == e.index:
                merged[-1] = ReplyEvent(e.kind, merged[-1].text + e.text, e.index)
            else:
                merged.append(e)
        self.events.extend(merged)
        return merged
