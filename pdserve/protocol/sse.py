"""Server-sent events framing: ``data: <json>\\n\\n`` and the closing ``data: [DONE]``."""

from __future__ import annotations

from typing import Any

import msgspec

DONE = "data: [DONE]\n\n"

_encode = msgspec.json.Encoder().encode


def sse_event(payload: Any) -> str:
    """One event: compact JSON, UTF-8 as is (json.dumps(ensure_ascii=False)'s text, at a fraction of its
    cost per chunk; a non-finite float, which JSON cannot carry, becomes null)."""
    return sse_event_bytes(payload).decode()


def sse_event_bytes(payload: Any) -> bytes:
    """:func:`sse_event` as the bytes that go on the wire, for a stream's per-token chunks: no round trip
    through ``str`` (a chunk with 21 logprob candidates is a couple of KB, often not ASCII)."""
    return b"data: " + _encode(payload) + b"\n\n"
