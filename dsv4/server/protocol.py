"""Request and response bodies, as pydantic models: OpenAI's schemas with vLLM's extensions, and Anthropic's Messages.

OpenAI requests are strict, as OpenAI's own API is: an unknown field, a string or a bool where a number goes, NaN,
or a value out of range is refused (400) naming the field. Fields dsv4 cannot honour (penalties, logit_bias, a
required or named tool_choice, a response_format other than text) are refused, never silently ignored. Anthropic
requests ignore unknown top-level fields (agents send beta fields freely) but check the ones they use.
"""

from __future__ import annotations

import time
from types import MappingProxyType
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

Int64 = Annotated[int, Field(ge=-2**63, le=2**63 - 1)]
MAX_N = 128                                   # choices per prompt
# OpenAI's reasoning_effort values -> V4's encoding effort (None and "high" both mean the default prompt)
REASONING_EFFORTS = MappingProxyType({"minimal": None, "low": None, "medium": None, "high": "high", "max": "max"})


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class Loose(BaseModel):
    """Message-level objects: clients send back what they received (refusal, annotations, ...)."""
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


def _unsupported(name: str, default: Any):
    def check(value):
        if value not in (None, default) and value != {}:
            raise ValueError(f"{name} is not supported by dsv4 (only {default!r})")
        return value
    return field_validator(name)(check)


# ============================================================================ OpenAI requests
class StreamOptions(Strict):
    include_usage: bool = False


class SamplingRequest(Strict):
    """What completions and chat completions share."""
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)                  # vLLM: -1 or 0 = off
    min_p: float | None = Field(None, ge=0, le=1)           # vLLM
    seed: Int64 | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None                 # vLLM
    ignore_eos: bool = False                                # vLLM
    include_stop_str_in_output: bool = False                # vLLM
    skip_special_tokens: bool = True                        # vLLM
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None                 # vLLM
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    _no_presence = _unsupported("presence_penalty", 0.0)
    _no_frequency = _unsupported("frequency_penalty", 0.0)
    _no_repetition = _unsupported("repetition_penalty", 1.0)
    _no_bias = _unsupported("logit_bias", None)

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value):
        if "" in ([value] if isinstance(value, str) else value or []):
            raise ValueError("stop strings must not be empty")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0)
    best_of: int | None = None
    suffix: str | None = None

    _no_suffix = _unsupported("suffix", None)

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, value):
        if not value or (isinstance(value, list) and any(not p for p in value if isinstance(p, (str, list)))):
            raise ValueError("the prompt must not be empty")
        return value


class FunctionCallIn(Loose):
    name: str
    arguments: str | dict[str, Any] | None = None


class ToolCallIn(Loose):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(Loose):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None                    # DeepSeek / vLLM: earlier turns' reasoning
    reasoning: str | None = None                            # vLLM's newer name

    def to_encoder(self) -> dict:
        """The message as runtime.chat.encode_messages takes it."""
        return self.model_dump(include={"role", "content", "tool_calls", "tool_call_id", "reasoning_content",
                                        "reasoning"}, exclude_none=True)


class FunctionDef(Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class ChatTemplateKwargs(Strict):
    thinking: bool | None = None                            # vLLM's switch for DeepSeek's thinking mode
    enable_thinking: bool | None = None
    reasoning_effort: str | None = None


class ThinkingOption(Strict):                               # DeepSeek's API: {"type": "enabled"}
    type: Literal["enabled", "disabled"]


class ResponseFormat(Strict):
    type: Literal["text"]


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto"] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal["minimal", "low", "medium", "high", "max"] | None = None
    thinking: ThinkingOption | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    response_format: ResponseFormat | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, value):
        if value == "required" or isinstance(value, dict):
            raise ValueError("tool_choice 'required' or a named function needs constrained decoding, which dsv4 "
                             "does not do; use 'auto' or 'none'")
        return value

    def thinking_mode(self) -> tuple[bool, str | None]:
        """(thinking, V4 reasoning effort) from chat_template_kwargs, thinking and reasoning_effort."""
        kw = self.chat_template_kwargs or ChatTemplateKwargs()
        on = next((v for v in (kw.thinking, kw.enable_thinking) if v is not None),
                  self.thinking is not None and self.thinking.type == "enabled")
        effort = kw.reasoning_effort or self.reasoning_effort
        if effort is not None and effort not in REASONING_EFFORTS:
            raise ValueError(f"reasoning_effort {effort!r} is not one of {list(REASONING_EFFORTS)}")
        return on, REASONING_EFFORTS.get(effort)


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: ChatTemplateKwargs | None = None
    tools: list[Tool] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]


# ============================================================================ OpenAI responses
class Out(BaseModel):
    """Responses leave out what is None (OpenAI's own responses omit most absent fields)."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None or k in self._keep_none}

    _keep_none: frozenset = frozenset()


class Usage(Out):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(Out):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(Out):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None                     # vLLM
    _keep_none = frozenset({"logprobs", "finish_reason"})


class CompletionResponse(Out):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class FunctionCallOut(Out):
    name: str | None = None
    arguments: str | None = None


class ToolCallOut(Out):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ToolCallDelta(Out):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallOut


class TopLogprob(Out):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Out):
    content: list[TokenLogprob]


class ChatMessageOut(Out):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None
    _keep_none = frozenset({"content"})


class ChatChoice(Out):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    _keep_none = frozenset({"logprobs", "finish_reason"})


class ChatResponse(Out):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(Out):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(Out):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    _keep_none = frozenset({"finish_reason"})


class ChatChunk(Out):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class ModelCard(Out):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dsv4"
    root: str
    max_model_len: int


class ModelList(Out):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(Out):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(Out):
    prompt: str


# ============================================================================ Anthropic Messages
class AnthropicBlock(Loose):
    """A content block: text, thinking, tool_use, tool_result (image and document blocks are refused)."""
    type: Literal["text", "thinking", "redacted_thinking", "tool_use", "tool_result", "image", "document"]
    text: str | None = None
    thinking: str | None = None
    signature: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None


class AnthropicMessage(Loose):
    role: Literal["user", "assistant"]
    content: str | list[AnthropicBlock]


class AnthropicTool(Loose):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class AnthropicToolChoice(Loose):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class AnthropicThinking(Loose):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class AnthropicRequest(Loose):
    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[AnthropicBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    stream: bool = False
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinking | None = None
    metadata: dict[str, Any] | None = None

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value):
        if value is not None and value.type in ("any", "tool"):
            raise ValueError(f"tool_choice {value.type!r} needs constrained decoding, which dsv4 does not do; use "
                             "'auto' or 'none'")
        return value


class AnthropicUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class AnthropicResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: AnthropicUsage
