"""Streams that break on purpose, and what a client makes of them: shared by the migration tests on
loopback (tests/e2e/test_migration.py), the fleet fault suite and the fleet soak."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx

from tests.sse import parse_sse

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def assembled(events: list[dict[str, Any]]) -> dict[str, Any]:
    """What a client makes of an OpenAI stream: text, reasoning, content, tool calls (names and arguments),
    every token id, the finish and the usage. An error event fails it."""
    out: dict[str, Any] = {"text": "", "reasoning": "", "content": "", "tools": {}, "ids": [], "finish": None,
                           "usage": None}
    for event in events:
        assert "error" not in event, event
        out["usage"] = event.get("usage") or out["usage"]
        for choice in event.get("choices", []):
            out["finish"] = choice.get("finish_reason") or out["finish"]
            out["text"] += choice.get("text") or ""
            out["ids"] += choice.get("token_ids") or []
            delta = choice.get("delta") or {}
            out["reasoning"] += delta.get("reasoning") or delta.get("reasoning_content") or ""
            out["content"] += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                tool = out["tools"].setdefault(call["index"], {"name": "", "arguments": ""})
                tool["name"] += (call.get("function") or {}).get("name") or ""
                tool["arguments"] += (call.get("function") or {}).get("arguments") or ""
    return out


def carries_output(line: str) -> bool:
    """An SSE line whose event carries output (text or token ids)."""
    if not line.startswith("data: {"):
        return False
    event = json.loads(line[len("data: "):])
    return any(c.get("text") or c.get("token_ids") for c in event.get("choices") or [])


def stream(url: str, body: dict[str, Any], fault: Callable[[], None] | None = None, *, after_output: bool = True,
           timeout: float = 120, headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """A stream's events (a refused request: its error body as the one event). ``fault()`` runs once output
    arrived (``after_output``) or once the stream opened; the stream must end with [DONE]."""
    with httpx.stream("POST", url, json=body, timeout=timeout, headers=headers) as r:
        if r.status_code != 200:
            return [json.loads(r.read())]
        lines = r.iter_lines()
        head: list[str] = []
        if fault is not None:
            if after_output:
                for line in lines:
                    head.append(line)
                    if carries_output(line):
                        break
            fault()
        events, done = parse_sse(head + list(lines))
    assert done, "the stream ended without [DONE]"
    return events
