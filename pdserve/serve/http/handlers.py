"""Error handlers (every error leaves as the wire error body) and the one place server errors are counted."""

from __future__ import annotations

import logging
from contextvars import ContextVar
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.engine.api import EngineError
from pdserve.protocol.errors import RequestError
from pdserve.serve.http.body import format_validation_error
from pdserve.serve.http.errors import engine_error_body, error_json

logger = logging.getLogger("pdserve")


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
