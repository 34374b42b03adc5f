"""HTTP edges shared by every route: JSON body parsing, the error body, error handlers and auth.

Every error leaves as :class:`~pdserve.protocol.errors.ErrorResponse`: a client's mistake is its
own status (400 unless the error says otherwise); anything unexpected is a 500 with a log line,
so a server bug is never reported as the client's fault.
"""

from __future__ import annotations

import json
import logging
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.engine.api import EngineDeadError, EngineError
from pdserve.protocol.errors import ErrorInfo, ErrorResponse, RequestError
from pdserve.serve.state import app_state

logger = logging.getLogger("pdserve")
ModelT = TypeVar("ModelT", bound=BaseModel)


def format_validation_error(err: ValidationError | RequestValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e.get("loc", ()) if x not in ("body",))
        msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts) or "invalid request"


async def parse_body(request: Request, model: type[ModelT] | TypeAdapter[Any]) -> Any:
    """Read a JSON body into ``model`` (a model class or a TypeAdapter of a union); every failure
    is a 400 that says what was wrong."""
    state = app_state(request)
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise RequestError(f"Content-Type must be application/json (got {content_type or 'none'!r})")
    declared = request.headers.get("content-length")
    limit = state.config.max_body_bytes
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(f"request body of {declared} bytes is over the limit of {limit} bytes")
    raw = await request.body()
    if len(raw) > limit:
        raise RequestError(f"request body of {len(raw)} bytes is over the limit of {limit} bytes")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"JSON decode error: {e}") from None
    if not isinstance(data, dict):
        raise RequestError("request body must be a JSON object")
    try:
        if isinstance(model, TypeAdapter):
            return model.validate_python(data)
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestError(format_validation_error(e)) from None


def error_body(message: str, status: int, kind: str, param: str | None = None) -> dict[str, Any]:
    """The wire error object, as a JSON-ready dict (an SSE stream ends with one)."""
    return ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=status)).model_dump()


def error_json(message: str, status: int, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, kind, param), status_code=status)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(exc.to_response().model_dump(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_json(format_validation_error(exc), 400, "BadRequestError")

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_json(f"engine unavailable: {exc}", 503, "ServiceUnavailableError")

    @app.exception_handler(EngineError)
    async def _engine_error(_: Request, exc: EngineError) -> JSONResponse:
        return error_json(f"engine error: {exc}", 500, "InternalServerError")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_json(str(exc.detail), exc.status_code, "NotFoundError" if exc.status_code == 404 else "Error")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # One line here; the server's own handler logs the traceback after this response is sent.
        logger.error("pdserve: %s %s failed: %r", request.method, request.url.path, exc)
        return error_json(f"internal server error: {type(exc).__name__}", 500, "InternalServerError")


def install_auth(app: FastAPI, api_key: str) -> None:
    """Every route but /health needs ``Authorization: Bearer <key>``."""

    @app.middleware("http")
    async def _check_key(request: Request, call_next):  # type: ignore[no-untyped-def]
        if request.url.path != "/health" and request.headers.get("authorization") != f"Bearer {api_key}":
            return error_json("missing or wrong API key (Authorization: Bearer <key>)", 401, "AuthenticationError")
        return await call_next(request)
