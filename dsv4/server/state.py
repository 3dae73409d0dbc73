"""What the routes share: the server's state, the error object, and a request's way through the engine loop
(sampling parameters checked against the model, submission, streaming, collection, aborting)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from types import MappingProxyType

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from ..runtime.params import Logprob, RequestError, SamplingParams
from ..runtime.tokenizer import Tokenizer
from .engine_loop import EngineLoop, Job, NotAccepting, QueueFull, Update

# One error type per status, the same on every endpoint (OpenAI clients read the status, Anthropic's the type).
ERROR_TYPES = MappingProxyType({400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                                405: "invalid_request_error", 413: "request_too_large", 500: "api_error",
                                503: "overloaded_error"})
ANTHROPIC_PATHS = ("/v1/messages",)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None,
               path: str = "") -> dict:
    """OpenAI's error object; on Anthropic's paths also its `"type": "error"` envelope (one object fits both)."""
    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "api_error"), "param": param,
                      "code": code}}
    if path.startswith(ANTHROPIC_PATHS):
        body = {"type": "error", **body}
    return body


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   path: str = "") -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code, path), status_code=status)


@dataclass
class ServerState:
    loop: EngineLoop
    tokenizer: Tokenizer
    served_names: tuple[str, ...]
    root: str                                   # the model's path, for /v1/models
    api_key: str | None = None
    draining: bool = False                      # shutting down: new generation requests get 503
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def max_model_len(self) -> int:
        return self.loop.engine.max_model_len

    def model_name(self, requested: str | None) -> str:
        """The served name a request asked for (None: the first); 404 for any other."""
        if requested is None:
            return self.served_names[0]
        if requested not in self.served_names:
            raise APIError(404, f"The model `{requested}` does not exist; this server serves "
                                f"{', '.join(self.served_names)}.", "model", "model_not_found")
        return requested

    def params(self, prompt_len: int, *, max_tokens: int | None, default_max_tokens: int | None = None,
               temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
               min_p: float | None = None, seed: int | None = None, stop=None, stop_token_ids=None,
               ignore_eos: bool = False, logprobs: int | None = None, include_stop_str_in_output: bool = False,
               skip_special_tokens: bool = True, prompt_param: str = "prompt") -> SamplingParams:
        """SamplingParams for one choice, refusing (400) what cannot fit max_model_len."""
        size, room = self.max_model_len, self.max_model_len - prompt_len
        if room < 1:
            raise APIError(400, f"This model's maximum context length is {size} tokens; the prompt has {prompt_len} "
                                "tokens, which leaves no room for a completion.", prompt_param,
                           "context_length_exceeded")
        limit = self.loop.engine.max_logprobs
        if logprobs is not None and logprobs > limit:
            raise APIError(400, f"logprobs {logprobs} is more than this server's --max-logprobs {limit}", "logprobs")
        if max_tokens is None:
            max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
        elif max_tokens > room:
            raise APIError(400, f"This model's maximum context length is {size} tokens. However, you requested "
                                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
                                "completion). Please reduce the prompt or max_tokens.", "max_tokens",
                           "context_length_exceeded")
        try:
            return SamplingParams(
                temperature=1.0 if temperature is None else temperature, top_p=1.0 if top_p is None else top_p,
                top_k=top_k or 0, min_p=min_p or 0.0, seed=seed, stop=stop, stop_token_ids=stop_token_ids,
                ignore_eos=ignore_eos, max_tokens=max_tokens, logprobs=logprobs,
                include_stop_str_in_output=include_stop_str_in_output, skip_special_tokens=skip_special_tokens)
        except RequestError as e:
            raise APIError(400, str(e)) from e

    def submit(self, jobs: list[Job]) -> Submission:
        """Check every job with the engine (400), then queue them all (503 when the queue is full or the server
        is shutting down)."""
        for job in jobs:
            try:
                self.loop.engine.check_request(job.prompt_token_ids, job.params, f"request {job.request_id!r}")
            except RequestError as e:
                raise APIError(400, str(e)) from e
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        sub = Submission(self.loop, [j.request_id for j in jobs])
        try:
            self.loop.submit(jobs, sub.queue)
        except QueueFull as e:
            raise APIError(503, f"the server is busy: {e}; retry later", code="queue_full") from e
        except NotAccepting as e:
            raise APIError(503, str(e), code="shutting_down") from e
        return sub


@dataclass
class Result:
    """One choice, collected."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None

    def add(self, u: Update) -> None:
        self.text += u.text
        self.token_ids += u.token_ids
        self.logprobs += u.logprobs
        self.prompt_tokens, self.output_tokens = u.prompt_tokens, u.output_tokens
        self.finish_reason, self.stop_reason, self.error = u.finish_reason, u.stop_reason, u.error


class Submission:
    """One HTTP request's engine requests, seen from the event loop."""

    def __init__(self, loop: EngineLoop, request_ids: list[str]):
        self._loop, self.request_ids = loop, request_ids
        self.queue: asyncio.Queue[Update] = asyncio.Queue()
        self.open = set(range(len(request_ids)))

    async def updates(self) -> AsyncIterator[Update]:
        while self.open:
            update = await self.queue.get()
            if update.finished:
                self.open.discard(update.index)
            yield update

    def abort(self) -> None:
        """Abort what has not finished (a client gone, a stream closed early); the engine frees it before its
        next step."""
        if self.open:
            self._loop.abort([self.request_ids[i] for i in self.open])

    async def collect(self, request: Request) -> list[Result]:
        """Every choice's whole result; the requests are aborted if the client disconnects meanwhile."""
        watcher = asyncio.create_task(self._watch(request))
        results = [Result() for _ in self.request_ids]
        try:
            async for update in self.updates():
                results[update.index].add(update)
        finally:
            watcher.cancel()
            self.abort()
        failed = [r.error for r in results if r.finish_reason == "error"]
        if failed:
            raise APIError(500, f"the request failed while it ran: {failed[0]}", code="engine_error")
        return results

    async def _watch(self, request: Request, every_s: float = 0.5) -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(every_s)
        self.abort()


class EventStream(StreamingResponse):
    """Server-sent events; however the stream ends (done, failed, or the client gone), `on_close` runs."""
    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def sse(data: str, event: str | None = None) -> str:
    return (f"event: {event}\n" if event else "") + f"data: {data}\n\n"
