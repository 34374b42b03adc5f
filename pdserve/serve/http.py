"""HTTP edges shared by every route: JSON body parsing, the error body, error handlers and auth.

Every error leaves as :class:`~pdserve.protocol.errors.ErrorResponse`: a client's mistake is its
own status (400 unless the error says otherwise); anything unexpected is a 500 with a log line,
so a server bug is never reported as the client's fault.
"""

from __future__ import annotations

import hmac
import json
import logging
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pdserve.engine.api import EngineDeadError, EngineError, KVLoadError, RequestAborted
from pdserve.protocol.derender import chat_derender_adapter, completion_derender_adapter
from pdserve.protocol.engine import ABORT_FOR_SHUTDOWN
from pdserve.protocol.errors import ErrorInfo, ErrorResponse, RequestError
from pdserve.protocol.generate import AbortRequest, GenerateRequest
from pdserve.protocol.limits import MAX_HEADER_BYTES, MAX_JSON_DEPTH, MAX_REQUEST_ID_CHARS
from pdserve.protocol.openai import ChatCompletionRequest, CompletionRequest
from pdserve.serve.event_stream import CLOSE_CONNECTION, DIRECT_BODY, SEND_BODY
from pdserve.serve.inflight import RETRY_AFTER_S, InFlight
from pdserve.serve.state import app_state

logger = logging.getLogger("pdserve")
ModelT = TypeVar("ModelT", bound=BaseModel)


def _where(loc: tuple[Any, ...], skip_tag: bool) -> str:
    """An error location as a dotted field path (a tagged union's tag, e.g. derender's batch/stream, left out)."""
    parts = [str(x) for x in loc if x != "body"]
    return ".".join(parts[1:] if skip_tag else parts)


def format_validation_error(err: ValidationError | RequestValidationError, skip_tag: bool = False) -> str:
    parts = []
    for e in err.errors():
        loc = _where(tuple(e.get("loc", ())), skip_tag)
        msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts) or "invalid request"


_SCALAR_LIST = list[int | float | bool | None]


def decode_json(raw: bytes) -> Any:
    """A request body as Python values. msgspec first (3x json.loads' speed on the id lists a streaming
    derender body carries); whatever it refuses (a bad document, NaN, 1e400, lone surrogates, deep
    nesting) goes through json.loads, whose verdict and messages are the server's rules."""
    try:
        return _fast_decode(raw)
    except (msgspec.DecodeError, RecursionError):
        pass
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"JSON decode error: {e}") from None
    except RecursionError:
        raise RequestError(f"the JSON body nests deeper than {MAX_JSON_DEPTH} levels") from None


_fast_decode = msgspec.json.Decoder().decode


def check_json(data: Any) -> None:
    """Refuse (400 naming the place) what json.loads accepts but the server cannot hold: nesting
    deeper than MAX_JSON_DEPTH (it would exhaust recursion downstream) and strings with lone
    surrogates (``"\\ud800"``: valid JSON escapes, but not text; encoding them fails later).

    Iterative, and it only visits containers and strings: a long list of token ids costs one C-level
    pass over the element types (about 2.5 ms per 100k ids, next to json.loads of them)."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        value, where, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value, where)
            continue
        if depth >= MAX_JSON_DEPTH:
            raise RequestError(f"the JSON body nests deeper than {MAX_JSON_DEPTH} levels (at {where or 'the top'})")
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, f"{where}.{key}" if where else key)
                if isinstance(item, (dict, list, str)):
                    stack.append((item, f"{where}.{key}" if where else key, depth + 1))
        elif not _scalars_only(value):
            stack.extend((item, f"{where}[{i}]", depth + 1)
                         for i, item in enumerate(value) if isinstance(item, (dict, list, str)))


def _scalars_only(values: list[Any]) -> bool:
    """Whether a list holds only numbers, booleans and nulls (a list of token ids): one C pass of msgspec,
    4x a type() check per element, which was a fifth of a long streamed /derender chunk's work."""
    try:
        msgspec.convert(values, _SCALAR_LIST)
    except (msgspec.ValidationError, UnicodeEncodeError):
        # A string or container is in it (or an integer msgspec does not hold; a lone surrogate fails its
        # error message): look closer.
        return False
    return True


def _check_text(text: str, where: str) -> None:
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            where = where.encode("utf-8", "backslashreplace").decode("utf-8")  # the path may hold the surrogate
            raise RequestError(
                f"{where or 'the body'}: the string holds a lone UTF-16 surrogate (such as \\ud800 without its "
                "pair), which is not text; send valid Unicode",
                param=where or None,
            ) from None


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused once it passes ``limit``: by its Content-Length, or (chunked, or a lying
    length) as soon as what arrived passes it, never buffered whole first."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(f"request body of {declared} bytes is over the limit of {limit} bytes", close=True)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(f"request body is over the limit of {limit} bytes (stopped reading at {size})",
                               close=True)
        chunks.append(chunk)
    return b"".join(chunks)


def header_request_id(request: Request) -> str | None:
    """``X-Request-Id``, bounded like a body ``request_id`` (it is echoed back in every answer)."""
    value = request.headers.get("x-request-id")
    if value is not None and len(value) > MAX_REQUEST_ID_CHARS:
        raise RequestError(f"X-Request-Id has {len(value)} characters; at most {MAX_REQUEST_ID_CHARS} are allowed",
                           param="X-Request-Id")
    return value


async def parse_body(request: Request, model: type[ModelT] | TypeAdapter[Any]) -> Any:
    """Read a JSON body into ``model`` (a model class or a TypeAdapter of a union); every failure
    is a 400 that says what was wrong (a body over the size limit too: DESIGN.md rule 6)."""
    state = app_state(request)
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise RequestError(f"Content-Type must be application/json (got {content_type or 'none'!r})")
    header_request_id(request)
    raw = await _read_body(request, state.config.max_body_bytes)
    data = decode_json(raw)
    if not isinstance(data, dict):
        raise RequestError("request body must be a JSON object")
    check_json(data)
    tagged = isinstance(model, TypeAdapter)
    try:
        if tagged:
            return model.validate_python(data)
        return model.model_validate(data)
    except ValidationError as e:
        first = _where(tuple(e.errors()[0]["loc"]), tagged)
        raise RequestError(format_validation_error(e, tagged), param=first.split(".")[0] or None) from None


def error_body(message: str, status: int, kind: str, param: str | None = None) -> dict[str, Any]:
    """The wire error object, as a JSON-ready dict (an SSE stream ends with one)."""
    return ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=status)).model_dump()


def error_json(message: str, status: int, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, kind, param), status_code=status)


def engine_error_body(exc: EngineError) -> tuple[int, dict[str, Any]]:
    """Status and error body of an engine failure, the same for a batch answer and a stream's last event:
    503 when the engine is gone, 502 when a decode leg's KV could not be pulled, else 500."""
    if isinstance(exc, EngineDeadError):
        return 503, error_body(f"engine unavailable: {exc}", 503, "ServiceUnavailableError")
    if isinstance(exc, KVLoadError):
        return 502, error_body(str(exc), 502, "KVLoadError")
    if isinstance(exc, RequestAborted):
        if exc.cause == ABORT_FOR_SHUTDOWN:
            return 503, error_body(str(exc), 503, "ServiceUnavailableError")
        return 500, error_body(str(exc), 500, "RequestAbortedError")
    return 500, error_body(f"engine error: {exc}", 500, "InternalServerError")


@dataclass
class _Outcome:
    """What one request ended as: its status line, and a stream's error event after a 200 status line."""

    status: int = 0
    stream_error: int | None = None


_outcome: ContextVar[_Outcome | None] = ContextVar("pdserve_outcome", default=None)


def report_stream_error(status: int) -> None:
    """A stream whose 200 headers went out ended with a ``status`` error event: count it as that."""
    outcome = _outcome.get()
    if outcome is not None:
        outcome.stream_error = status


class CountServerErrors:
    """Counts every server error in one place, for every route: an ASGI wrapper (not an HTTP middleware,
    which would hide client disconnects from streaming routes) that reads each response's status line,
    a stream's late error (:func:`report_stream_error`) and an exception no handler turned into a response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        outcome = _Outcome()
        token = _outcome.set(outcome)

        async def observed(message: Message) -> None:
            if message["type"] == "http.response.start":
                outcome.status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, observed)
        except Exception:
            outcome.status = outcome.status or 500  # the server's error handler answers 500
            raise
        finally:
            _outcome.reset(token)
            status = outcome.stream_error or outcome.status
            if status >= 500:
                route = getattr(scope.get("route"), "path", None) or "unmatched"
                scope["app"].state.pdserve.metrics.server_errors.labels(route, str(status)).inc()


class _HeadTooLarge(Exception):
    """Raised from a parser callback to stop parsing a request head over MAX_HEADER_BYTES."""


class ChunkedBodyWriter:
    """Writes a chunk of a streamed body at once, from plain code (no coroutine): what uvicorn's ``send``
    does for a chunked body when nothing holds it back. :meth:`writable` says when that is: the response
    has started and not ended, the client is still there and the connection's buffer is below its high
    mark (flow control). Otherwise the chunk must go through ``send``, which waits."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle

    def writable(self) -> bool:
        c = self._cycle
        return (
            c.response_started and not c.response_complete and not c.disconnected and c.chunked_encoding is True
            and not c.flow.write_paused and not c.transport.is_closing()
        )

    def write(self, body: bytes) -> None:
        self._cycle.transport.write(b"%x\r\n%b\r\n" % (len(body), body))


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a bound on request head bytes (request line + headers), which
    httptools itself lacks: past MAX_HEADER_BYTES the connection gets a 431 and is closed, before the
    parser buffers more (a 64 MB header would otherwise be read whole)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._parsed_head = 0  # url + header names and values of this request, as parsed
        self._raw_head = 0  # bytes received while this request's head was still incomplete
        self._reading_head = True
        self._head_too_large = False

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._parsed_head = self._raw_head = 0
        self._reading_head = True
        # How an idle stream's connection is cut (serve.inflight): abort, not close, which would wait for
        # the unread buffer to drain first; its pending send then returns and the stream ends as a
        # disconnect does.
        self.scope[CLOSE_CONNECTION] = self.transport.abort  # type: ignore[typeddict-unknown-key]

    def _count(self, size: int) -> None:
        self._parsed_head += size
        if self._parsed_head > MAX_HEADER_BYTES:
            self._head_too_large = True
            raise _HeadTooLarge()  # stops the parser; uvicorn then answers through send_400_response

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value))
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._reading_head = False
        super().on_headers_complete()
        # The stream's body chunks go straight to the connection (serve.event_stream); the app still
        # gets the request's cycle as it did, and the middleware still see the response start.
        cycle = getattr(self, "cycle", None)
        if cycle is not None and cycle.scope is self.scope:
            self.scope[SEND_BODY] = cycle.send  # type: ignore[typeddict-unknown-key]
            self.scope[DIRECT_BODY] = ChunkedBodyWriter(cycle)  # type: ignore[typeddict-unknown-key]

    def send_400_response(self, msg: str) -> None:
        if self._head_too_large:
            self._send_431()
        else:
            super().send_400_response(msg)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # A header still arriving is buffered by httptools before on_header sees it: bound that too.
        if self._reading_head and not self.transport.is_closing():
            self._raw_head += len(data)
            if self._raw_head > MAX_HEADER_BYTES:
                self._send_431()

    def _send_431(self) -> None:
        body = json.dumps(error_body(
            f"request headers are over the limit of {MAX_HEADER_BYTES} bytes", 431, "RequestHeaderFieldsTooLargeError"
        )).encode()
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body
        )
        self.transport.close()


def install_error_handlers(app: FastAPI) -> None:
    app.add_middleware(CountServerErrors)
    @app.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError) -> JSONResponse:
        headers = dict(exc.headers or {})
        if exc.close:
            headers["connection"] = "close"
        return JSONResponse(exc.to_response().model_dump(), status_code=exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_json(format_validation_error(exc), 400, "BadRequestError")

    @app.exception_handler(EngineError)
    async def _engine_error(_: Request, exc: EngineError) -> JSONResponse:
        status, body = engine_error_body(exc)
        return JSONResponse(body, status_code=status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_json(str(exc.detail), exc.status_code, "NotFoundError" if exc.status_code == 404 else "Error")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # One line here; the server's own handler logs the traceback after this response is sent.
        logger.error("pdserve: %s %s failed: %r", request.method, request.url.path, exc)
        return error_json(f"internal server error: {type(exc).__name__}", 500, "InternalServerError")


# What a draining server still answers: its metrics, aborts of what it still runs, and the KV metadata
# that decode engines need to pull the leases of prefill legs this server already answered.
DRAINING_ROUTES = frozenset({"/metrics", "/abort_requests", "/inference/v1/abort_requests", "/kv/metadata"})


class Gate:
    """What is refused before any route runs: while the server drains for a shutdown, everything but
    :data:`DRAINING_ROUTES` (503, ``/health`` included, so load balancers stop sending), and without the
    ``--api-key`` every route but ``/health`` (401). Pure ASGI: an HTTP middleware would wrap streaming responses and
    can hide a client's disconnect from the route (a storm of disconnects then leaves requests running)."""

    def __init__(self, app: ASGIApp, api_key: str | None, inflight: InFlight) -> None:
        self.app = app
        self.inflight = inflight
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            if self.inflight.draining and path not in DRAINING_ROUTES:
                body = error_body("the server is shutting down", 503, "ServiceUnavailableError")
                headers = {"retry-after": str(RETRY_AFTER_S), "connection": "close"}
                await JSONResponse(body, status_code=503, headers=headers)(scope, receive, send)
                return
            if self.expected is not None and path != "/health" and not self._authorized(scope):
                body = error_body("missing or wrong API key (Authorization: Bearer <key>)", 401, "AuthenticationError")
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        sent = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        return hmac.compare_digest(sent, self.expected or b"")


def _request_bodies() -> dict[str, Any]:
    """The body each JSON route parses (by hand, through :func:`parse_body`), as a TypeAdapter per path."""
    chat, completion = TypeAdapter(ChatCompletionRequest), TypeAdapter(CompletionRequest)
    return {
        "/inference/v1/generate": TypeAdapter(GenerateRequest),
        "/inference/v1/abort_requests": TypeAdapter(AbortRequest),
        "/abort_requests": TypeAdapter(AbortRequest),
        "/v1/chat/completions": chat,
        "/v1/chat/completions/render": chat,
        "/v1/completions": completion,
        "/v1/completions/render": completion,
        "/v1/chat/completions/derender": chat_derender_adapter,
        "/v1/completions/derender": completion_derender_adapter,
    }


def install_openapi_bodies(app: FastAPI) -> None:
    """Declare the request bodies in ``/openapi.json``: routes read them with :func:`parse_body` (for the
    error messages and limits it adds), so FastAPI alone would publish body-less operations, and clients
    and schema-driven fuzzers (tests/e2e/test_schemathesis.py) would not know what to send."""
    plain_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = plain_openapi()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, adapter in _request_bodies().items():
            operation = schema.get("paths", {}).get(path, {}).get("post")
            if operation is None:
                continue
            body = adapter.json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
