"""Engine request ids: unique per request, whatever id the client sent.

Clients reuse ids (retries, RL pipelines resend the same ``request_id`` / ``X-Request-Id``), and two
requests with one engine id would collide: the second rejected, and its cleanup (an abort by id)
ending the first. So the frontend gives every request its own engine id, the client's id plus a
unique suffix, and answers with the client's id. An abort by a client id (``/abort_requests``)
reaches every in-flight request that carries it; a request's own cleanup aborts its engine id only.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable

SEPARATOR = "#"


def engine_request_id(client_id: str) -> str:
    return f"{client_id}{SEPARATOR}{uuid.uuid4().hex[:12]}"


def matching(ids: Iterable[str], live: Iterable[str]) -> list[str]:
    """The live engine ids an abort of ``ids`` (engine ids or client ids) reaches."""
    wanted = set(ids)
    return [rid for rid in live if rid in wanted or rid.rpartition(SEPARATOR)[0] in wanted]
