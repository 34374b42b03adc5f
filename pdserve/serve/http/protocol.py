"""uvicorn's httptools protocol, bounded: the request head's size, and the direct body writer that streams
write their chunks with."""

from __future__ import annotations

import json
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pdserve.protocol.limits import MAX_HEADER_BYTES
from pdserve.serve.event_stream import CLOSE_CONNECTION, DIRECT_BODY, SEND_BODY
from pdserve.serve.http.errors import error_body


class _HeadTooLarge(Exception):
    """Raised from a parser callback to stop parsing a request head over MAX_HEADER_BYTES."""


class ChunkedBodyWriter:
    """Writes a chunk of a streamed body at once, from plain code (no coroutine): what uvicorn's ``send``
    does for a chunked body when nothing holds it back. :meth:`writable` says when that is: the response
    has started and not ended, the client is still there and the connection's buffer is below its high
    mark (flow control). Otherwise the chunk must go through ``send``, which waits."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle

    def writable(self) -> bool:
        c = self._cycle
        return (
            c.response_started and not c.response_complete and not c.disconnected and c.chunked_encoding is True
            and not c.flow.write_paused and not c.transport.is_closing()
        )

    def write(self, body: bytes) -> None:
        self._cycle.transport.write(b"%x\r\n%b\r\n" % (len(body), body))


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a bound on request head bytes (request line + headers), which
    httptools itself lacks: past MAX_HEADER_BYTES the connection gets a 431 and is closed, before the
    parser buffers more (a 64 MB header would otherwise be read whole)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._parsed_head = 0  # url + header names and values of this request, as parsed
        self._raw_head = 0  # bytes received while this request's head was still incomplete
        self._reading_head = True
        self._head_too_large = False

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._parsed_head = self._raw_head = 0
        self._reading_head = True
        # How an idle stream's connection is cut (serve.inflight): abort, not close, which would wait for
        # the unread buffer to drain first; its pending send then returns and the stream ends as a
        # disconnect does.
        self.scope[CLOSE_CONNECTION] = self.transport.abort  # type: ignore[typeddict-unknown-key]

    def _count(self, size: int) -> None:
        self._parsed_head += size
        if self._parsed_head > MAX_HEADER_BYTES:
            self._head_too_large = True
            raise _HeadTooLarge()  # stops the parser; uvicorn then answers through send_400_response

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value))
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._reading_head = False
        super().on_headers_complete()
        # The stream's body chunks go straight to the connection (serve.event_stream); the app still
        # gets the request's cycle as it did, and the middleware still see the response start.
        cycle = getattr(self, "cycle", None)
        if cycle is not None and cycle.scope is self.scope:
            self.scope[SEND_BODY] = cycle.send  # type: ignore[typeddict-unknown-key]
            self.scope[DIRECT_BODY] = ChunkedBodyWriter(cycle)  # type: ignore[typeddict-unknown-key]

    def send_400_response(self, msg: str) -> None:
        if self._head_too_large:
            self._send_431()
        else:
            super().send_400_response(msg)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # A header still arriving is buffered by httptools before on_header sees it: bound that too.
        if self._reading_head and not self.transport.is_closing():
            self._raw_head += len(data)
            if self._raw_head > MAX_HEADER_BYTES:
                self._send_431()

    def _send_431(self) -> None:
        body = json.dumps(error_body(
            f"request headers are over the limit of {MAX_HEADER_BYTES} bytes", 431, "RequestHeaderFieldsTooLargeError"
        )).encode()
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body
        )
        self.transport.close()
