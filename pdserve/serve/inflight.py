"""What this frontend process has in flight: admission, shutdown drain and slow-reader watch.

Every engine request enters through :meth:`InFlight.admit` and leaves through :meth:`InFlight.release`
(the batch answer's or the SSE response's cleanup, which always runs). That one registry answers:

* overload: past the engine's ``max_num_seqs`` plus ``--max-waiting-requests`` a request is refused
  with 503 and ``Retry-After``, before anything is queued (memory stays bounded);
* shutdown: once draining, new requests are refused; what is left after ``--shutdown-timeout`` is
  aborted with the shutdown as its cause, so each answer ends with an error naming it;
* slow readers: an SSE stream whose client has not taken a chunk for ``--stream-idle-timeout`` has its
  connection closed, which ends the stream as a disconnect does (its engine request is aborted).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from pdserve.output.request_state import RequestState
from pdserve.protocol.engine import EngineRequest
from pdserve.protocol.errors import RequestError

logger = logging.getLogger("pdserve")

Prepared = tuple[EngineRequest, RequestState]

RETRY_AFTER_S = 1


@dataclass(eq=False)
class StreamWatch:
    """One SSE response's send state: when the chunk being sent started waiting for the client."""

    close_connection: Callable[[], None] | None = None
    sending_since: float | None = None
    expired: bool = False


@dataclass
class InFlight:
    capacity: int | None  # engine requests this process may hold (None: unbounded)
    draining: bool = False
    requests: dict[str, RequestState] = field(default_factory=dict)
    streams: set[StreamWatch] = field(default_factory=set)

    def admit(self, prepared: Sequence[Prepared]) -> None:
        """Register the engine requests of one client request, or refuse it with a 503."""
        if self.draining:
            raise RequestError("the server is shutting down; send the request to another server", status=503,
                               kind="ServiceUnavailableError", headers={"retry-after": str(RETRY_AFTER_S)})
        if self.capacity is not None and len(self.requests) + len(prepared) > self.capacity:
            raise RequestError(
                f"the server is overloaded: {len(self.requests)} requests in flight, at most {self.capacity} "
                "(--max-num-seqs plus --max-waiting-requests); retry later",
                status=503, kind="ServiceUnavailableError", headers={"retry-after": str(RETRY_AFTER_S)},
            )
        for ereq, rstate in prepared:
            self.requests[ereq.request_id] = rstate

    def release(self, prepared: Sequence[Prepared]) -> None:
        for ereq, _ in prepared:
            self.requests.pop(ereq.request_id, None)

    def expire_idle_streams(self, idle_timeout_s: float, now: float | None = None) -> int:
        """Close the connection of every stream whose current chunk has waited over ``idle_timeout_s``
        for its client; how many were closed."""
        now = time.monotonic() if now is None else now
        closed = 0
        for watch in list(self.streams):
            since = watch.sending_since
            if since is None or watch.expired or now - since < idle_timeout_s:
                continue
            watch.expired = True
            closed += 1
            if watch.close_connection is not None:
                watch.close_connection()
        return closed


async def watch_idle_streams(inflight: InFlight, idle_timeout_s: float, on_expired: Callable[[int], None]) -> None:
    """Runs for the app's lifetime: checks streams a few times per timeout (cost: one pass over open
    streams, never per chunk)."""
    period = min(1.0, idle_timeout_s / 4)
    while True:
        await asyncio.sleep(period)
        closed = inflight.expire_idle_streams(idle_timeout_s)
        if closed:
            logger.warning("pdserve: closed %d stream(s) whose client read nothing for %.1f s (--stream-idle-timeout)",
                           closed, idle_timeout_s)
            on_expired(closed)


async def drain(inflight: InFlight, timeout_s: float, abort: Callable[[list[str]], Awaitable[None]]) -> None:
    """Shutdown: refuse new requests, give those in flight ``timeout_s`` to finish, then abort the rest
    (``abort`` sends them the shutdown cause) and give their answers a moment to go out."""
    inflight.draining = True
    deadline = time.monotonic() + timeout_s
    while inflight.requests and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if inflight.requests:
        logger.warning("pdserve: shutdown: aborting %d request(s) still in flight after %.1f s",
                       len(inflight.requests), timeout_s)
        await abort(list(inflight.requests))
        final = time.monotonic() + 2.0
        while inflight.requests and time.monotonic() < final:
            await asyncio.sleep(0.02)
