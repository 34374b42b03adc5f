"""The proxy's FastAPI app: the OpenAI routes, ``/v1/models``, ``/health``, ``/metrics``, and the
health-check task that runs for the app's lifetime.

A client that leaves aborts both legs: before the decode stream starts, the leg in flight is
cancelled (closing its connection, which a pdserve server treats as an abort); once streaming, the
response closes the decode stream whichever way it ends.

Every answer carries a ``Server-Timing`` header of its legs (:mod:`pdserve.proxy.record`): a batch answer
all of them, a stream those done before its first byte (render, prefill).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import Receive, Scope, Send

from pdserve.protocol.keepalive import CLIENT_KEEP_ALIVE_EXPIRY_S
from pdserve.protocol.sse import DONE
from pdserve.proxy.flow import ClientRequestError, Kind, Orchestrator
from pdserve.proxy.pool import check_pools, health_loop
from pdserve.proxy.record import RequestRecord
from pdserve.proxy.upstream import UpstreamError, error_body, send
from pdserve.web.disconnect import ClientGone, unless_disconnected
from pdserve.web.logs import LEGS_STATE_KEY

log = logging.getLogger(__name__)

# The servers behind the proxy refuse more (pdserve.serve.config.DEFAULT_MAX_BODY_BYTES); the proxy reads no more.
MAX_BODY_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True)
class HealthSettings:
    interval_s: float = 1.0
    timeout_s: float = 2.0


class _RelayedStream(StreamingResponse):
    """A stream whose ``on_close`` runs however it ends (done, client gone, never started), so the
    decode stream behind it is always closed and the request always counted."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], Awaitable[None]], headers: dict[str, str]):
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with contextlib.suppress(Exception):
                await self._events.aclose()  # type: ignore[attr-defined]
            await self._on_close()


def _server_timing(record: RequestRecord) -> dict[str, str]:
    """The W3C ``Server-Timing`` header of the legs recorded so far (browsers' dev tools and tracing
    proxies read it without a client change)."""
    return {"server-timing": record.server_timing()}


async def _client_body(request: Request) -> dict[str, Any]:
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise ClientRequestError(f"Content-Type must be application/json (got {content_type or 'none'!r})", "body")
    raw = bytearray()
    async for chunk in request.stream():  # stop reading at the bound: a chunked body has no length to check first
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise ClientRequestError(f"request body is over {MAX_BODY_BYTES} bytes", "body")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ClientRequestError(f"JSON decode error: {e}", "body") from None
    except RecursionError:
        raise ClientRequestError("request body is nested too deeply", "body") from None
    if not isinstance(body, dict):
        raise ClientRequestError("request body must be a JSON object", "body")
    return body


def create_app(orch: Orchestrator, health: HealthSettings = HealthSettings(), api_key: str | None = None) -> FastAPI:
    """The app around ``orch``; its lifespan checks every member once, then keeps checking."""
    metrics = orch.metrics

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await check_pools(orch.pools, orch.client, health.timeout_s)
        task = asyncio.ensure_future(health_loop(orch.pools, orch.client, health.interval_s, health.timeout_s))
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await orch.client.aclose()

    app = FastAPI(title="pdserve proxy", lifespan=lifespan)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # A bug, never the client's fault: an error object naming it (not Starlette's bare text page); the
        # server's own handler logs the traceback after this response is sent.
        log.error("pdserve proxy: %s %s failed: %r", request.method, request.url.path, exc)
        return JSONResponse(error_body(f"pdserve proxy internal error: {type(exc).__name__}: {exc}", 500,
                                       "InternalServerError"), status_code=500)

    if api_key:
        @app.middleware("http")
        async def _check_key(request: Request, call_next):  # type: ignore[no-untyped-def]
            if request.url.path != "/health" and request.headers.get("authorization") != f"Bearer {api_key}":
                body = error_body("missing or wrong API key (Authorization: Bearer <key>)", 401, "AuthenticationError")
                return JSONResponse(body, status_code=401)
            return await call_next(request)

    def count(kind: Kind, status: int) -> None:
        orch.in_flight -= 1
        metrics.running.dec()
        metrics.requests.labels(kind, orch.mode, str(status)).inc()

    async def handle(request: Request, kind: Kind) -> Response:
        if orch.draining:
            body = error_body("the proxy is shutting down; send the request to another proxy", 503,
                              "ServiceUnavailableError")
            return JSONResponse(body, status_code=503, headers={"retry-after": "1", "connection": "close"})
        orch.in_flight += 1
        metrics.running.inc()
        try:
            response = await answer(request, kind)
        except BaseException:
            count(kind, 500)
            raise
        if not isinstance(response, _RelayedStream):  # a stream counts itself once it closes
            count(kind, response.status_code)
        return response

    async def answer(request: Request, kind: Kind) -> Response:
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        headers = {"x-request-id": request_id}
        # What a JSON log's request line and the request's span name (pdserve.web.logs, .tracing), read once
        # the answer is sent.
        request.scope.setdefault("state", {})["request_id"] = request_id
        try:
            body = await _client_body(request)
            prepared = await unless_disconnected(request.receive, orch.prepare(kind, body, request_id))
            request.scope["state"][LEGS_STATE_KEY] = prepared.record.members
            if orch.tracing is not None:
                orch.tracing.watch(request.scope, prepared)
            if not body.get("stream"):
                answer = await unless_disconnected(request.receive, orch.batch(prepared))
                return JSONResponse(answer, headers=headers | _server_timing(prepared.record))
            upstream = await unless_disconnected(request.receive, orch.open_stream(prepared))
        except UpstreamError as e:
            return JSONResponse(e.body, status_code=e.status, headers=headers | e.headers)
        except ClientGone:
            return Response(status_code=499)
        status = 499  # until the stream reaches [DONE] or an error event

        async def events() -> AsyncIterator[str]:
            nonlocal status
            async with contextlib.aclosing(orch.events(prepared, upstream)) as relayed:
                async for event in relayed:
                    if event.startswith('data: {"error"'):
                        status = int(json.loads(event[len("data: "):])["error"].get("code") or 500)
                    elif event == DONE and status == 499:
                        status = 200
                    yield event

        async def on_close() -> None:
            await upstream.aclose()
            count(kind, status)
            if orch.tracing is not None:
                orch.tracing.stream_closed(prepared, status)

        # The legs known before the first byte (render, prefill); the decode leg's times come after the
        # headers went out, so only the finishing chunk's metrics can carry them.
        return _RelayedStream(events(), on_close, headers | _server_timing(prepared.record))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await handle(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, "completions")

    @app.get("/v1/models")
    async def models() -> Response:
        try:
            _, response = await send(orch.client, orch.decode, "GET", "/v1/models", None, {})
        except UpstreamError as e:
            return JSONResponse(e.body, status_code=e.status, headers=e.headers)
        return Response(response.content, media_type="application/json")

    @app.get("/health")
    async def health_route() -> Response:
        if orch.draining:
            return JSONResponse(error_body("the proxy is shutting down", 503, "ServiceUnavailableError"), status_code=503)
        down = [p.unavailable_message() for p in orch.pools if not p.any_healthy]
        if down:
            return JSONResponse(error_body("; ".join(down), 503, "ServiceUnavailableError"), status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics_route() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def make_client(connect_timeout_s: float, read_timeout_s: float) -> httpx.AsyncClient:
    """The one upstream client: bounded connects (a dead member fails fast), long reads (a decode leg
    may stream for minutes), no pool limit below the servers' own, and idle connections dropped before a
    member with a 5 s keep-alive (stock vLLM) closes them (pdserve.protocol.keepalive)."""
    timeout = httpx.Timeout(connect=connect_timeout_s, read=read_timeout_s, write=30.0, pool=connect_timeout_s)
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100,
                          keepalive_expiry=CLIENT_KEEP_ALIVE_EXPIRY_S)
    return httpx.AsyncClient(timeout=timeout, limits=limits)
