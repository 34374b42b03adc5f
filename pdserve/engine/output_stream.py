"""The core-to-client stream: one Unix socket per client, carrying every message a core sends it.

Commands still go client → core over ZMQ. The way back used ZMQ too, and then each step cost the API
process two wake-ups: ZMQ's I/O thread read the message off the ipc socket and signalled its mailbox,
and only then did the event loop wake to read it. Here the core writes each message, length-prefixed,
straight into a Unix stream socket that the client's event loop watches itself (``add_reader``): one
wake-up per step, no thread in between.

The client listens (an abstract-namespace name: nothing on disk to clean up) and says where in its
``Hello``; the core connects, and everything it sends that client afterwards (``Ready``, each
``StepOutputs``, heartbeats, ``CoreDead``) goes down that one stream, so it arrives in the order sent.
A frame is a 4-byte little-endian length and that many bytes of msgpack.

The core never blocks on a slow client: a write the socket cannot take now is kept and finished on
later turns (:meth:`FrameWriter.flush`), in order; only the client that stopped reading waits.
"""

from __future__ import annotations

import os
import socket
import uuid

# Bytes the kernel buffers per stream before a write has to wait for the client (a long step of a big
# batch with logprobs is a few hundred KiB).
SEND_BUFFER_BYTES = 4 << 20
# Bytes one read takes at most (the buffer grows for a frame longer than this).
READ_CHUNK_BYTES = 256 << 10
_HEADER = 4


class OutputStreamClosed(ConnectionError):
    """The other end of an output stream is gone."""


def listening_socket() -> tuple[socket.socket, str]:
    """A non-blocking listener in the abstract namespace, and the name to put in ``Hello``."""
    name = f"\0pdserve-outputs-{os.getpid()}-{uuid.uuid4().hex}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(name)
    listener.listen(1)
    listener.setblocking(False)
    return listener, name


def frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(_HEADER, "little") + payload


class FrameWriter:
    """The core's end of one client's stream (connect once, then :meth:`send` per message)."""

    def __init__(self, name: str) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        try:
            self._sock.connect(name)
        except OSError as e:
            self._sock.close()
            raise OutputStreamClosed(f"cannot connect to the client's output stream: {e}") from e
        self._sock.setblocking(False)
        self._pending = bytearray()

    @property
    def backlog(self) -> int:
        """Bytes sent but not yet taken by the socket."""
        return len(self._pending)

    def send(self, payload: bytes) -> None:
        """Queue one message behind whatever is still pending, and write what the socket takes now."""
        if self._pending:
            self._pending += frame(payload)
            self.flush()
            return
        data = frame(payload)
        written = self._write(data)
        if written < len(data):
            self._pending += data[written:]

    def flush(self) -> None:
        """Write as much of the backlog as the socket takes now."""
        if self._pending:
            del self._pending[: self._write(self._pending)]

    def close(self) -> None:
        self._sock.close()

    def _write(self, data: bytes | bytearray) -> int:
        try:
            return self._sock.send(data)
        except BlockingIOError:
            return 0
        except OSError as e:  # EPIPE, ECONNRESET: the client is gone
            raise OutputStreamClosed(f"the client's output stream closed: {e}") from e


class FrameReader:
    """Reassembles frames from a byte stream, whatever the sizes of the reads (the client's end)."""

    def __init__(self) -> None:
        self._buffer = bytearray(READ_CHUNK_BYTES)
        self._start = 0  # first byte not yet returned in a frame
        self._end = 0  # end of the bytes read

    def read_from(self, sock: socket.socket) -> list[bytes]:
        """Read what ``sock`` has now (non-blocking) and return the whole frames it completes.

        Raises :class:`OutputStreamClosed` at the end of the stream.
        """
        self._make_room()
        try:
            count = sock.recv_into(memoryview(self._buffer)[self._end :])
        except BlockingIOError:
            return []
        if count == 0:
            raise OutputStreamClosed("the core closed its output stream")
        self._end += count
        return self._frames()

    def _frames(self) -> list[bytes]:
        frames = []
        buffer, start, end = self._buffer, self._start, self._end
        while end - start >= _HEADER:
            size = int.from_bytes(buffer[start : start + _HEADER], "little")
            if end - start - _HEADER < size:
                break
            frames.append(bytes(buffer[start + _HEADER : start + _HEADER + size]))
            start += _HEADER + size
        self._start = start
        return frames

    def _make_room(self) -> None:
        """Move the partial frame to the front; grow the buffer for a read of :data:`READ_CHUNK_BYTES` (or
        the rest of a frame longer than that)."""
        partial = self._end - self._start
        if self._start:
            self._buffer[:partial] = self._buffer[self._start : self._end]
            self._start, self._end = 0, partial
        frame_rest = 0
        if partial >= _HEADER:
            frame_rest = _HEADER + int.from_bytes(self._buffer[:_HEADER], "little") - partial
        need = partial + max(READ_CHUNK_BYTES, frame_rest)
        if need > len(self._buffer):
            self._buffer.extend(bytes(need - len(self._buffer)))
