"""The FastAPI application, and the uvicorn server that runs it with shutdown handled here.

`build_app(state)` assembles the routes (openai.py, anthropic.py, /health, /metrics), the error handlers (every
refusal is an OpenAI error object) and `Guard`, which answers 401 / 413 before any route reads the body. `run`
serves an `LLM`: the engine runs in its own thread (engine_loop.py) for as long as the server does; SIGINT or
SIGTERM stops accepting connections, lets running requests finish for up to `shutdown_timeout` seconds, aborts
the rest (their streams end with finish_reason "abort") and returns normally, so `dsv4 serve` exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import signal
import threading
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import Response

from ..runtime.engine import Engine
from ..runtime.params import RequestError
from ..runtime.tokenizer import Tokenizer
from . import anthropic, openai
from .engine_loop import EngineLoop
from .metrics import CONTENT_TYPE, Metrics
from .state import APIError, ServerState, error_response

log = logging.getLogger("dsv4.server")
OPEN_PATHS = ("/health",)                 # served without the API key


def make_state(engine: Engine, tokenizer: Tokenizer, served_names: tuple[str, ...], root: str, *,
               api_key: str | None = None, max_waiting: int | None = None) -> ServerState:
    metrics = Metrics(served_names[0], engine.cache.capacity_tokens)
    return ServerState(EngineLoop(engine, metrics, max_waiting), tokenizer, served_names, root, api_key)


def build_app(state: ServerState, max_body_bytes: int = 32 << 20, stop_timeout: float = 10.0) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop.start(asyncio.get_running_loop())
        yield
        state.loop.stop(stop_timeout)

    app = FastAPI(title="dsv4", summary="DeepSeek-V4: OpenAI- and Anthropic-compatible API", lifespan=lifespan)
    app.state.dsv4 = state
    app.include_router(openai.router)
    app.include_router(anthropic.router)
    app.add_middleware(Guard, state=state, max_body_bytes=max_body_bytes)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestError, _request_error)
    app.add_exception_handler(Exception, _internal_error)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if state.loop.alive and state.loop.failure is None else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.loop.metrics.render(), media_type=CONTENT_TYPE)

    return app


class Guard:
    """ASGI middleware: the API key (401; /health stays open) and the body size (413), before any route runs."""

    def __init__(self, app, state: ServerState, max_body_bytes: int):
        self.app, self.state, self.max_body_bytes = app, state, max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, headers, key = scope["path"], Headers(scope=scope), self.state.api_key
        if key and path not in OPEN_PATHS and not _authorized(headers, key):
            refusal = error_response(401, "missing or wrong API key (send 'Authorization: Bearer KEY' or "
                                          "'x-api-key: KEY')", code="invalid_api_key", path=path)
            return await refusal(scope, receive, send)
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return await error_response(413, self._too_large(), code="request_too_large", path=path)(
                scope, receive, send)
        await self.app(scope, _LimitedBody(receive, self.max_body_bytes, self._too_large()), send)

    def _too_large(self) -> str:
        return f"the request body is larger than {self.max_body_bytes} bytes (--max-request-bytes)"


class _LimitedBody:
    """A request's `receive` that refuses (413) a body growing past the limit (one sent without Content-Length)."""

    def __init__(self, receive, limit: int, message: str):
        self.receive, self.limit, self.message, self.size = receive, limit, message, 0

    async def __call__(self):
        message = await self.receive()
        self.size += len(message.get("body", b""))
        if self.size > self.limit:                 # FastAPI lets an HTTPException through while it reads the body
            raise HTTPException(413, self.message)
        return message


def _authorized(headers: Headers, key: str) -> bool:
    given = headers.get("x-api-key") or headers.get("authorization", "").removeprefix("Bearer ").strip()
    return secrets.compare_digest(given.encode(), key.encode())


# ------------------------------------------------------------------ every error is an OpenAI error object
async def _api_error(request: Request, exc: APIError) -> Response:
    return error_response(exc.status, exc.message, exc.param, exc.code, request.url.path)


async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    errors = exc.errors()
    first = errors[0]
    param = _param(first.get("loc", ()))
    if first["type"] == "json_invalid":
        message, param = f"malformed JSON body: {first.get('ctx', {}).get('error', first['msg'])}", None
    elif first["type"] == "extra_forbidden":
        message = f"unknown parameter {param!r}"
    elif first["type"] == "missing" and param is None:
        message = "the request needs a JSON body"
    else:
        why = first["msg"].removeprefix("Value error, ")
        message = f"{param}: {why}" if param else why
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return error_response(400, message, param, path=request.url.path)


def _param(loc) -> str | None:
    """('body', 'messages', 0, 'role') -> 'messages[0].role'; stops at pydantic's union tags ('str', 'list[int]')."""
    out = ""
    for part in list(loc)[1:]:
        if isinstance(part, int):
            out += f"[{part}]"
        elif any(c in part for c in "[]()-") or part in ("str", "int", "float", "bool", "dict", "list"):
            break
        else:
            out += f".{part}" if out else part
    return out or None


async def _http_error(request: Request, exc: HTTPException) -> Response:
    code = "request_too_large" if exc.status_code == 413 else None
    return error_response(exc.status_code, str(exc.detail), code=code, path=request.url.path)


async def _request_error(request: Request, exc: RequestError) -> Response:
    return error_response(400, str(exc), path=request.url.path)


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("internal error on %s", request.url.path, exc_info=exc)
    return error_response(500, f"internal error: {type(exc).__name__}: {exc}", path=request.url.path)


# ------------------------------------------------------------------ serving
class Server(uvicorn.Server):
    """uvicorn with dsv4's shutdown: on SIGINT / SIGTERM stop accepting, give running requests `drain_s`
    seconds, then abort what is left; return normally (uvicorn itself would re-raise the signal). A second
    SIGINT quits at once."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_s: float):
        super().__init__(config)
        self.state, self.drain_s = state, drain_s

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets=None) -> None:
        self.state.draining = True
        log.info("shutting down: new requests are refused; running ones get %.1f s to finish", self.drain_s)
        timer = asyncio.get_running_loop().call_later(self.drain_s, self._abort)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _abort(self) -> None:
        log.info("shutdown: the drain time is over; aborting the requests still running")
        self.state.loop.abort_all()


def run(llm, *, served_names: tuple[str, ...], root: str, host: str = "127.0.0.1", port: int = 8000,
        api_key: str | None = None, max_waiting: int | None = None, shutdown_timeout: float = 10.0,
        max_body_bytes: int = 32 << 20) -> None:
    """Serve a `dsv4.LLM` until SIGINT / SIGTERM."""
    engine = llm.engine
    state = make_state(engine, llm.get_tokenizer(), served_names, root, api_key=api_key, max_waiting=max_waiting)
    app = build_app(state, max_body_bytes, stop_timeout=shutdown_timeout)
    config = uvicorn.Config(app, host=host, port=port, log_config=None, access_log=False, lifespan="on",
                            timeout_graceful_shutdown=shutdown_timeout + 5)
    sock = config.bind_socket()
    bound = sock.getsockname()[1]
    cache = engine.cache
    log.info("model %s (%s), dtype %s on %s; cache %d tokens in %d pages for up to %d sequences of %d tokens "
             "(%.2f GiB)", root, ", ".join(served_names), str(engine.dtype).removeprefix("torch."), engine.device,
             cache.capacity_tokens, cache.num_pages, cache.num_slots, engine.max_model_len, cache.nbytes / 2**30)
    log.info("serving at http://%s:%d (OpenAI /v1/completions, /v1/chat/completions; Anthropic /v1/messages)%s",
             host, bound, "; API key required" if api_key else "")
    Server(config, state, shutdown_timeout).run(sockets=[sock])
