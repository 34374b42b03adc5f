"""The wire error body, as a JSON-ready dict or response, and an engine failure's status and body."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from pdserve.engine.api import EngineDeadError, EngineError, KVLoadError, RequestAborted
from pdserve.protocol.engine import ABORT_FOR_SHUTDOWN
from pdserve.protocol.errors import ErrorInfo, ErrorResponse


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
