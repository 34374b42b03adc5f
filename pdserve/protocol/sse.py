"""Server-sent events framing: ``data: <json>\\n\\n`` and the closing ``data: [DONE]``."""

from __future__ import annotations

import json
from typing import Any

DONE = "data: [DONE]\n\n"


def sse_event(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"
