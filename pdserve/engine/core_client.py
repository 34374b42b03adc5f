"""The engine-core client: the :class:`~pdserve.engine.api.Engine` every frontend uses to reach a core.

It sends typed commands (:mod:`pdserve.engine.messages`) over a ZMQ DEALER and owns the only
per-request async iterators: each ``StepOutputs`` the core sends (one per step) is dispatched
to them in one pass (:meth:`~pdserve.engine.channels.OutputChannels.deliver`).

What the core sends back arrives on the client's own output stream (a Unix socket it listens on and
names in its ``Hello``; :mod:`pdserve.engine.output_stream`), read by the event loop's reader callback
on that socket: one wake-up per step, with no ZMQ I/O thread in between (pyzmq's own reader thread
and ``zmq.asyncio`` each cost a wake-up or a future per message; docs/benchmarks.md). The DEALER
only sends.

Supervision: a client declares the engine dead (every in-flight iterator raises
:class:`EngineDeadError`) when the core's pid is gone, the core says its engine died, its output
stream ends, or heartbeats stop for :data:`HEARTBEAT_TIMEOUT_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import zmq

from pdserve.engine.api import EngineDeadError
from pdserve.engine.channels import OutputChannels, Sink
from pdserve.engine.core_server import EngineCoreAddresses
from pdserve.engine.messages import (
    AbortRequests,
    AddRequest,
    CoreDead,
    CoreMessage,
    Goodbye,
    Heartbeat,
    Hello,
    Ready,
    StepOutputs,
    StopSequence,
)
from pdserve.engine.output_stream import FrameReader, OutputStreamClosed, listening_socket
from pdserve.protocol.engine import ABORT_BY_CLIENT, EngineInfo, EngineOutput, EngineRequest, EngineStats

# A client gives up on a core that has been silent this long (the pid check is faster
# when the core runs on the same host, which is always the case today). The core beats
# between steps only, so this must exceed the longest step: a whole 8k-token prefill on a
# loaded 2-core machine took over 10 s (and a 10 s bound declared a healthy core dead for good).
HEARTBEAT_TIMEOUT_S = 120.0
# How often a client checks the core's pid where it cannot wait on a pidfd for the core's exit; and how often
# it checks its output stream and heartbeat where it can (those only need seconds).
LIVENESS_POLL_S = 0.2
SLOW_CHECKS_S = 1.0
# How long an output stream may have ended before a core whose pid still runs counts as dead anyway (a
# killed core closes its sockets just before its pid goes; the pid watch then names the exit).
STREAM_END_GRACE_S = 1.0


def _open_pidfd(pid: int) -> int | None:
    """A pidfd of ``pid``, readable once it exits (Linux 5.3+); None where there is none (another OS, an
    older kernel, a pid already gone: the poll then finds it)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


class EngineCoreClient:
    """:class:`~pdserve.engine.api.Engine` backed by a core process (see module docstring).

    ``step_messages`` counts the ``StepOutputs`` received, each dispatched in one pass.

    Use from one asyncio event loop: ``client = await EngineCoreClient.connect(addresses)``.
    """

    info: EngineInfo  # set by start() from the core's handshake
    core_pid: int

    def __init__(
        self, addresses: EngineCoreAddresses, *, connect_timeout: float = 30.0, context: zmq.Context | None = None
    ) -> None:
        """``context``: the ZMQ context to connect in (an ``inproc://`` core's, which its owner terminates);
        by default the client makes and terminates its own."""
        self.addresses = addresses
        self.connect_timeout = connect_timeout
        self._shared_ctx = context
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreMessage)
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outputs: socket.socket | None = None  # the core's stream to this client
        self._frames = FrameReader()
        self._stream_ended_at: float | None = None
        self._ready: asyncio.Future[Ready] | None = None
        self._channels = OutputChannels()
        self._tasks: list[asyncio.Task[None]] = []
        self._dead: EngineDeadError | None = None
        self._stats = EngineStats()
        self._last_heard = 0.0
        self.step_messages = 0

    @classmethod
    async def connect(cls, addresses: EngineCoreAddresses, *, connect_timeout: float = 30.0) -> EngineCoreClient:
        client = cls(addresses, connect_timeout=connect_timeout)
        await client.start()
        return client

    async def start(self) -> None:
        """Connect and handshake: afterwards ``info`` and ``core_pid`` are the core's."""
        if self._sock is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._ctx = self._shared_ctx if self._shared_ctx is not None else zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # Never block a send (the DEALER only sends: what the core sends back comes on the output stream).
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.connect(self.addresses.endpoint)
        self._ready = self._loop.create_future()
        listener, name = listening_socket()
        try:
            self._send(Hello(outputs=name))
            async with asyncio.timeout(self.connect_timeout):
                self._outputs, _ = await self._loop.sock_accept(listener)
                self._outputs.setblocking(False)
                self._loop.add_reader(self._outputs.fileno(), self._read)
                reply = await self._ready
        except TimeoutError:
            self._close_socket()
            raise EngineDeadError(
                f"engine core at {self.addresses.endpoint} did not answer within {self.connect_timeout:.0f}s"
            ) from None
        finally:
            listener.close()
        self.info, self.core_pid = reply.info, reply.pid
        self._last_heard = time.monotonic()
        self._tasks = [asyncio.create_task(self._watch())]

    async def shutdown(self) -> None:
        """Disconnect this client (the core keeps serving others); its in-flight requests end."""
        if self._sock is None:
            return
        if self._dead is None:
            # zmq.Again: the DEALER has no peer left, the core closed its socket first (an in-process loop that
            # saw its stop flag on a turn something else woke): there is no one to say goodbye to.
            with contextlib.suppress(zmq.Again):
                self._send(Goodbye())
        self._die("engine client shut down")
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._close_socket()

    def is_healthy(self) -> bool:
        return self._sock is not None and self._dead is None

    def stats(self) -> EngineStats:
        return self._stats

    async def abort(self, request_ids: list[str], cause: str = ABORT_BY_CLIENT) -> None:
        if request_ids and self._dead is None:
            self._send(AbortRequests(list(request_ids), cause))

    async def stop_sequence(self, request_id: str, index: int) -> None:
        if self._dead is None:
            self._send(StopSequence(request_id, index))

    def attach_sink(self, request_id: str, sink: Sink) -> bool:
        return self._channels.attach_sink(request_id, sink)

    def direct_outputs(self) -> int:
        return self._channels.direct_outputs

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        """The request's channel itself (no generator around it: one fewer resumption per token)."""
        if self._dead is not None:
            raise self._dead
        if self._sock is None:
            raise EngineDeadError("engine client is not connected (call start() first)")
        rid = request.request_id

        def abandon() -> None:
            if self._dead is None:
                self._send(AbortRequests([rid]))

        return self._channels.stream(rid, lambda: self._send(AddRequest(request)), abandon)

    # -- internals ---------------------------------------------------------------------------

    def _send(self, message: Any) -> None:
        assert self._sock is not None
        self._sock.send(self._encoder.encode(message), zmq.NOBLOCK)

    def _read(self) -> None:
        """Dispatch every whole message the output stream brought (the loop's reader callback)."""
        assert self._outputs is not None
        try:
            frames = self._frames.read_from(self._outputs)
        except OutputStreamClosed:
            self._stop_reading()
            self._stream_ended_at = time.monotonic()  # the pid watch says why (or gives up, see _watch)
            return
        if frames:
            self._last_heard = time.monotonic()
        for frame in frames:
            try:
                message = self._decoder.decode(frame)
            except msgspec.DecodeError:
                continue
            if isinstance(message, StepOutputs):
                self.step_messages += 1
                self._channels.deliver(message)
            elif isinstance(message, Heartbeat):
                self._stats = message.stats
            elif isinstance(message, Ready):
                if self._ready is not None and not self._ready.done():
                    self._ready.set_result(message)
            elif isinstance(message, CoreDead):
                self._die(f"engine core reported its engine dead: {message.message}")
                return

    async def _watch(self) -> None:
        """Die when the core does: on its exit (a pidfd the event loop waits on, so an idle server does not
        wake five times a second to read /proc; polled where pidfds are missing), its output stream closed
        for :data:`STREAM_END_GRACE_S` while its pid runs, or :data:`HEARTBEAT_TIMEOUT_S` without a heartbeat."""
        assert self._loop is not None
        exited = f"engine core process {self.core_pid} exited"
        pidfd = _open_pidfd(self.core_pid)
        if pidfd is not None:

            def on_exit() -> None:  # a pidfd stays readable: read it once
                assert self._loop is not None and pidfd is not None
                self._loop.remove_reader(pidfd)
                self._die(exited)

            self._loop.add_reader(pidfd, on_exit)
        try:
            while self._dead is None:
                await asyncio.sleep(LIVENESS_POLL_S if pidfd is None else SLOW_CHECKS_S)
                if pidfd is None and not _pid_alive(self.core_pid):
                    self._die(exited)
                elif self._stream_ended_at is not None and time.monotonic() - self._stream_ended_at > STREAM_END_GRACE_S:
                    self._die(f"engine core process {self.core_pid} closed its output stream")
                elif time.monotonic() - self._last_heard > HEARTBEAT_TIMEOUT_S:
                    self._die(f"engine core process {self.core_pid} sent no heartbeat for {HEARTBEAT_TIMEOUT_S:.0f}s")
        finally:
            if pidfd is not None:
                if not self._loop.is_closed():
                    self._loop.remove_reader(pidfd)
                os.close(pidfd)

    def _die(self, reason: str) -> None:
        if self._dead is not None:
            return
        self._dead = EngineDeadError(reason)
        self._channels.fail_all(self._dead)

    def _stop_reading(self) -> None:
        if self._outputs is not None:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._outputs.fileno())
            self._outputs.close()
            self._outputs = None

    def _close_socket(self) -> None:
        self._stop_reading()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._ctx is not None:
            if self._ctx is not self._shared_ctx:
                self._ctx.term()
            self._ctx = None
