"""The kit's HTTP client: JSON posts and SSE streams, read as a client sees them (nothing parsed away)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class Stream:
    """One SSE answer: its status, the parsed events, whether ``data: [DONE]`` came last, and any
    protocol breakage seen while reading (data after [DONE], an event that is not JSON)."""

    status: int
    events: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    problems: list[str] = field(default_factory=list)
    body: str = ""

    def choices(self) -> list[dict[str, Any]]:
        return [c for ev in self.events for c in ev.get("choices") or []]

    def ids(self, index: int = 0) -> list[int]:
        return [t for c in self.choices() if c.get("index", 0) == index for t in c.get("token_ids") or []]

    def text(self, index: int = 0) -> str:
        return "".join(c.get("text") or "" for c in self.choices() if c.get("index", 0) == index)

    def finish(self, index: int = 0) -> str | None:
        finishes = [c.get("finish_reason") for c in self.choices() if c.get("index", 0) == index]
        return next((f for f in reversed(finishes) if f is not None), None)


class Wire:
    """Requests against one server (``base`` without a trailing slash), with its API key if any."""

    def __init__(self, base: str, api_key: str | None = None, timeout: float = 120.0):
        self.base = base.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.base, headers=headers, timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def get(self, path: str) -> httpx.Response:
        return self.http.get(path)

    def post(self, path: str, body: Any) -> httpx.Response:
        return self.http.post(path, json=body)

    def post_raw(self, path: str, content: bytes, content_type: str = "application/json") -> httpx.Response:
        return self.http.post(path, content=content, headers={"content-type": content_type})

    def stream(self, path: str, body: Any, on_event: Any = None) -> Stream:
        """POST ``body`` and read the SSE answer to its end; ``on_event(n)`` runs after the n-th event."""
        with self.http.stream("POST", path, json=body) as r:
            out = Stream(status=r.status_code)
            if r.status_code != 200:
                out.body = r.read().decode(errors="replace")
                return out
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: ") :]
                if out.done:
                    out.problems.append(f"data after [DONE]: {payload[:80]}")
                if payload == "[DONE]":
                    out.done = True
                    continue
                try:
                    out.events.append(json.loads(payload))
                except json.JSONDecodeError:
                    out.problems.append(f"event is not JSON: {payload[:80]}")
                    continue
                if on_event is not None:
                    on_event(len(out.events))
            return out
