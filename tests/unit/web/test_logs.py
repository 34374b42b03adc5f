"""JSON log lines (pdserve.web.logs): the formatter's fields, the W3C trace id, and the request line the
middleware writes once an answer has been sent, with the status the app sent (500 when it raised first)."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from typing import Any

import pytest

from pdserve.web.logs import LEGS_STATE_KEY, JsonFormatter, RequestLines, request_log, trace_id

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def test_trace_ids_come_only_from_well_formed_traceparents() -> None:
    assert trace_id(f"00-{TRACE}-00f067aa0ba902b7-01") == TRACE
    for bad in (None, "", f"00-{TRACE}-00f067aa0ba902b7", f"00-{TRACE.upper()}-00f067aa0ba902b7-01",
                f"00-{'0' * 32}-00f067aa0ba902b7-01"):
        assert trace_id(bad) is None, bad


def test_a_record_is_one_json_object_with_its_request_fields_and_traceback() -> None:
    record = logging.LogRecord("pdserve.x", logging.ERROR, __file__, 1, "failed %s", ("here",), None)
    record.request_id, record.status = "r-1", 502
    try:
        raise ValueError("boom")
    except ValueError:
        record.exc_info = sys.exc_info()
    line = json.loads(JsonFormatter("proxy").format(record))
    assert (line["level"], line["process"], line["logger"], line["message"]) == ("ERROR", "proxy", "pdserve.x", "failed here")
    assert (line["request_id"], line["status"]) == ("r-1", 502) and "trace_id" not in line
    assert "ValueError: boom" in line["exception"] and line["time"].endswith("+00:00")


async def _call(app: Any, headers: list[tuple[bytes, bytes]]) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers, "state": {}}
    await app(scope, receive, send)
    return sent


def test_the_request_line_names_the_request_its_trace_status_member_and_legs(caplog: pytest.LogCaptureFixture) -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        scope["state"][LEGS_STATE_KEY] = lambda: {"decode": "http://d:1"}  # read after the answer, not now
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    with caplog.at_level(logging.INFO, logger=request_log.name):
        asyncio.run(_call(RequestLines(app, "http://me:8000"), [
            (b"x-request-id", b"r-7"), (b"traceparent", f"00-{TRACE}-00f067aa0ba902b7-01".encode())]))
    (record,) = caplog.records
    assert (record.request_id, record.trace_id, record.member, record.status) == ("r-7", TRACE, "http://me:8000", 201)
    assert record.legs == {"decode": "http://d:1"} and record.duration_ms >= 0


def test_an_app_that_raises_before_answering_is_logged_as_500(caplog: pytest.LogCaptureFixture) -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise RuntimeError("bug")

    with caplog.at_level(logging.INFO, logger=request_log.name), pytest.raises(RuntimeError):
        asyncio.run(_call(RequestLines(app, "http://me:8000"), []))
    (record,) = caplog.records
    assert record.status == 500 and record.request_id is None and record.legs is None
