"""The SSE answer, written with the raw ASGI ``send``.

It does what Starlette's StreamingResponse does (write each event, stop when the client leaves) and
two things that one cannot: it marks when each chunk starts waiting for the client, so a slow reader
can be found (:class:`~pdserve.serve.inflight.StreamWatch`), and its cleanup runs even when the
stream never started (the client left first), so what was admitted is always released.

The response start goes through the middleware's ``send`` (they record the status); under pdserve's
HTTP protocol the body chunks then go to the connection's own ``send`` (:data:`SEND_BODY`), sparing
three wrappers per chunk that only look for the start (CountServerErrors, Starlette's error and
exception middleware).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from pdserve.serve.inflight import StreamWatch

# The scope key under which pdserve's HTTP protocol (http.BoundedHttpToolsProtocol) puts a callable
# that closes the request's connection: how an idle stream is cut off while its send waits.
CLOSE_CONNECTION = "pdserve.close_connection"
# The scope key under which the same protocol puts the request cycle's own ``send``.
SEND_BODY = "pdserve.send_body"

_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


class EventStreamResponse(Response):
    """A Starlette Response (so routes may return it) that writes itself; no body is rendered up front."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str | bytes], watch: StreamWatch, on_close: Callable[[], None]) -> None:
        self.status_code = 200
        self.background = None
        self.events = events
        self.watch = watch
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.watch.close_connection = scope.get(CLOSE_CONNECTION)
        try:
            writer = asyncio.ensure_future(self._write(send, scope.get(SEND_BODY, send)))
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
            # Closes the events however the writer ended; also when they never started (the client left
            # first), so the endpoint's cleanup always runs.
            await self.events.aclose()
            self.on_close()

    async def _write(self, send: Send, send_body: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
        watch = self.watch
        async for event in self.events:
            watch.sending_since = time.monotonic()
            body = event.encode() if isinstance(event, str) else event
            await send_body({"type": "http.response.body", "body": body, "more_body": True})
            watch.sending_since = None
        await send_body({"type": "http.response.body", "body": b"", "more_body": False})


async def until_disconnect(receive: Receive) -> None:
    """Returns once the client has gone (every message before that is the request's, already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass
