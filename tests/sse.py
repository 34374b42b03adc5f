"""A small SSE client for tests (httpx streaming)."""

from __future__ import annotations

import json
from typing import Any

import httpx


def parse_sse(lines: list[str]) -> tuple[list[dict[str, Any]], bool]:
    """Events (parsed JSON) and whether the stream ended with [DONE]."""
    events: list[dict[str, Any]] = []
    done = False
    for line in lines:
        if not line.startswith("data: "):
            continue
        payload = line[len("data: ") :]
        if payload == "[DONE]":
            done = True
            continue
        assert not done, "data after [DONE]"
        events.append(json.loads(payload))
    return events, done


def stream_post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None, timeout: float = 60.0):
    with httpx.stream("POST", url, json=body, headers=headers, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return parse_sse(list(r.iter_lines()))
