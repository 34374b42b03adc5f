"""Log lines for operators: text as before, or one JSON object per line (``--log-format json``).

A P/D request crosses the proxy, the render server, a prefill and a decode member. With JSON logs every
process writes a line per request it answered (method, path, status, milliseconds, the request id that every
leg carries in ``X-Request-Id``, the W3C trace id of a ``traceparent`` header, and the member: the process's
own address, or for the proxy the members that served each leg), so one ``grep``/``jq`` on the request id
finds a request's lines in every process's log. Other records (warnings, errors, startup) become JSON
objects too, with an ``exception`` field for a traceback. In the default text format nothing changes:
uvicorn's access lines, and no middleware in the request path.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from datetime import UTC, datetime
from typing import Any

from pdserve.web.trace_context import parse_traceparent

LOG_FORMATS = ("text", "json")
# Fields a record may carry (``logger.info(..., extra={...})``) that a JSON line keeps as its own keys.
REQUEST_FIELDS = ("request_id", "trace_id", "member", "legs", "method", "path", "status", "duration_ms")
# The scope["state"] key under which a handler leaves a callable that says which members served a request's
# legs (the proxy: its request record's, read when the answer has been sent, decode leg included).
LEGS_STATE_KEY = "pdserve_legs"

request_log = logging.getLogger("pdserve.request")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, process, logger, message, the request fields
    the record carries, and the traceback of an exception."""

    def __init__(self, process: str) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname, "process": self.process, "logger": record.name, "message": record.getMessage(),
        }
        for name in REQUEST_FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                line[name] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure_json_logging(level: str, process: str) -> None:
    """``--log-format json``: the process's root logger (and uvicorn's, which then propagate to it) writes
    :class:`JsonFormatter` lines; uvicorn's access lines are off, as :class:`RequestLines` writes richer ones.
    (Text, the default, keeps the logging each process set up before this option existed.)"""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter(process))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        uvicorn_logger = logging.getLogger(name)
        uvicorn_logger.handlers.clear()
        uvicorn_logger.propagate = True
    logging.getLogger("uvicorn.access").disabled = True
    request_log.setLevel(logging.INFO)  # a request line per request, whatever --log-level says of the rest


def uvicorn_logging(log_format: str) -> dict[str, Any]:
    """``uvicorn.Config`` keywords: in JSON, uvicorn leaves logging as :func:`configure_json_logging` set it."""
    return {"log_config": None} if log_format == "json" else {}


def serving(app: ASGIApp, log_format: str, member: str) -> ASGIApp:
    """``app`` as uvicorn should run it: behind :class:`RequestLines` in JSON, as it is in text (nothing added
    to the request path)."""
    return RequestLines(app, member) if log_format == "json" else app


def trace_id(traceparent: str | None) -> str | None:
    """The trace id of a W3C ``traceparent`` header, or None when there is none or it is malformed."""
    parsed = parse_traceparent(traceparent)
    return None if parsed is None else parsed.trace_id


class RequestLines:
    """ASGI middleware: a ``pdserve.request`` record when each HTTP request's answer has been sent (a stream:
    when it ends), with the request fields of :data:`REQUEST_FIELDS`."""

    def __init__(self, app: ASGIApp, member: str) -> None:
        self.app = app
        self.member = member

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500  # the app raised before it answered

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())}
            state = scope.get("state") or {}
            legs = state.get(LEGS_STATE_KEY)
            request_log.info(
                "%s %s %d", scope.get("method"), scope.get("path"), status,
                extra={"request_id": headers.get("x-request-id") or state.get("request_id"),
                       "trace_id": trace_id(headers.get("traceparent")), "member": self.member,
                       "legs": legs() if callable(legs) else None, "method": scope.get("method"), "path": scope.get("path"),
                       "status": status, "duration_ms": round((time.perf_counter() - start) * 1000, 3)},
            )
