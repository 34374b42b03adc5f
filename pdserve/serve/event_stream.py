"""The SSE answer, written with the raw ASGI ``send``.

It does what Starlette's StreamingResponse does (write each event, stop when the client leaves) and
two things that one cannot: it marks when each chunk starts waiting for the client, so a slow reader
can be found (:class:`~pdserve.serve.inflight.StreamWatch`), and its cleanup runs even when the
stream never started (the client left first), so what was admitted is always released.

The response start goes through the middleware's ``send`` (they record the status); under pdserve's
HTTP protocol the body chunks then go to the connection's own ``send`` (:data:`SEND_BODY`), sparing
three wrappers per chunk that only look for the start (CountServerErrors, Starlette's error and
exception middleware).

A response may also lend its connection to the engine's dispatch (:class:`DirectBody`): while the
response waits for its next event, an event can be written from there at once
(:class:`DirectEvents`, :func:`pdserve.serve.driver.drive`), sparing the stream's task a wake-up per
chunk. The lending ends when the response does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Protocol

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from pdserve.serve.inflight import StreamWatch
from pdserve.web.disconnect import until_disconnect

if TYPE_CHECKING:
    from pdserve.output.request_state import ChoiceUpdate

# The scope key under which pdserve's HTTP protocol (http.BoundedHttpToolsProtocol) puts a callable
# that closes the request's connection: how an idle stream is cut off while its send waits.
CLOSE_CONNECTION = "pdserve.close_connection"
# The scope key under which the same protocol puts the request cycle's own ``send``.
SEND_BODY = "pdserve.send_body"
# The scope key under which the same protocol puts a BodyWriter for the request's connection.
DIRECT_BODY = "pdserve.direct_body"

_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


class BodyWriter(Protocol):
    """Writes a body chunk from plain code when the connection can take it (http.ChunkedBodyWriter)."""

    def writable(self) -> bool: ...

    def write(self, body: bytes) -> None: ...


class DirectBody:
    """The connection an :class:`EventStreamResponse` lends while it waits for its next event: its
    :class:`BodyWriter` then, None before the response started, after it ended, and under a server
    that offers none (the events then all go through the response's own loop)."""

    __slots__ = ("writer",)

    def __init__(self) -> None:
        self.writer: BodyWriter | None = None


class DirectEvents:
    """A stream's outlet for :func:`~pdserve.serve.driver.drive`: writes an update's event straight to
    the lent connection. ``event`` is the same function the response's own loop uses for an update, so
    both ways give the same bytes."""

    __slots__ = ("_body", "_event")

    def __init__(self, body: DirectBody, event: Callable[[ChoiceUpdate], bytes | None]) -> None:
        self._body = body
        self._event = event

    def ready(self) -> bool:
        writer = self._body.writer
        return writer is not None and writer.writable()

    def emit(self, update: ChoiceUpdate) -> None:
        event = self._event(update)
        if event is not None:
            assert self._body.writer is not None
            self._body.writer.write(event)


class EventStreamResponse(Response):
    """A Starlette Response (so routes may return it) that writes itself; no body is rendered up front."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str | bytes], watch: StreamWatch, on_close: Callable[[], None],
                 direct: DirectBody | None = None) -> None:
        self.status_code = 200
        self.background = None
        self.events = events
        self.watch = watch
        self.on_close = on_close
        self.direct = direct

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.watch.close_connection = scope.get(CLOSE_CONNECTION)
        try:
            writer = asyncio.ensure_future(self._write(send, scope.get(SEND_BODY, send), scope.get(DIRECT_BODY)))
            listener = asyncio.ensure_future(until_disconnect(receive))
            try:
                await asyncio.wait((writer, listener), return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (writer, listener):
                    task.cancel()
                await asyncio.gather(writer, listener, return_exceptions=True)
            if not writer.cancelled() and writer.exception() is not None:
                raise writer.exception()  # type: ignore[misc]
        finally:
            if self.direct is not None:
                self.direct.writer = None
            # Closes the events however the writer ended; also when they never started (the client left
            # first), so the endpoint's cleanup always runs.
            await self.events.aclose()
            self.on_close()

    async def _write(self, send: Send, send_body: Send, direct_writer: BodyWriter | None) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
        if self.direct is not None:
            self.direct.writer = direct_writer
        watch = self.watch
        async for event in self.events:
            watch.sending_since = time.monotonic()
            body = event.encode() if isinstance(event, str) else event
            await send_body({"type": "http.response.body", "body": body, "more_body": True})
            watch.sending_since = None
        await send_body({"type": "http.response.body", "body": b"", "more_body": False})
