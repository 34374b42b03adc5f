"""The engine loop: drain the commands, step the step loop, send each client one batch per turn.

The only engine loop there is. The engine core process runs it on its main thread over an ipc ROUTER
socket (:mod:`pdserve.engine.core`); an in-process engine runs it on a thread over an ``inproc://``
socket (:mod:`pdserve.engine.inproc`). Commands arrive on that socket; everything for a client goes
down the client's own output stream (:mod:`pdserve.engine.output_stream`), which its event loop reads
without a ZMQ thread in between. Each turn (:meth:`CoreServer.turn`) drains the socket's inbox,
runs one ``step()`` of the :class:`~pdserve.engine.stepping.StepCore` (no sooner than its ``pace_s``
after the last one) and sends each client **one** ``StepOutputs`` with everything that turn produced
for it. No per-request task, queue or iterator lives here. A request streamed with a stream interval
has its outputs held until a chunk is due (:mod:`pdserve.engine.coalesce`), so a frontend is not woken
for steps it would not send.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from pdserve.engine.api import EngineError
from pdserve.engine.coalesce import StreamIntervals
from pdserve.engine.messages import (
    AbortRequests,
    AddRequest,
    ClientMessage,
    CoreDead,
    Goodbye,
    Heartbeat,
    Hello,
    Ready,
    RequestFailed,
    StepOutputs,
    StopSequence,
)
from pdserve.engine.output_stream import FrameWriter, OutputStreamClosed
from pdserve.engine.stepping import StepCore
from pdserve.protocol.engine import ABORT_BY_CLIENT, EngineStats

HEARTBEAT_INTERVAL_S = 0.5
# How often a turn retries writing to a client whose output stream is full (it stopped reading).
BACKLOG_RETRY_S = 0.001

log = logging.getLogger(__name__)


class EngineCoreAddresses(msgspec.Struct, frozen=True):
    """Where clients find a core (picklable/serialisable, handed to frontend processes)."""

    endpoint: str


class CoreServer:
    """Drains client messages into the step loop and sends each client one batch per turn.

    ``serve()`` returns when the parent process is gone, a step fails or ``stopped`` is set (an
    in-process engine's shutdown sets it, then wakes the loop with its client's goodbye). With
    ``stats_each_turn`` the step loop's stats are read after every turn into ``last_stats`` (for an
    in-process engine, whose caller reads them there, fresher than the heartbeat's).
    """

    def __init__(
        self,
        core: StepCore,
        sock: zmq.Socket[Any],
        parent_pid: int,
        *,
        stats_each_turn: bool = False,
        connect_stream: Callable[[str], FrameWriter] = FrameWriter,
    ) -> None:
        self.core, self.sock, self.parent_pid = core, sock, parent_pid
        self._connect_stream = connect_stream
        self.streams: dict[bytes, FrameWriter] = {}  # client -> its output stream
        self.stopped = False
        self.stats_each_turn = stats_each_turn
        self.last_stats = EngineStats()
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(ClientMessage)
        self.owners: dict[str, bytes] = {}  # request id -> the client that added it
        self.pending: dict[bytes, StepOutputs] = {}  # this turn's batch per client
        # Requests streamed with a stream interval above 1: their outputs wait here for a full chunk.
        self.held = StreamIntervals()
        self.steps = 0
        self._last_step = -math.inf

    def serve(self) -> None:
        """Run until the parent process is gone or a step fails."""
        next_beat = time.monotonic() + HEARTBEAT_INTERVAL_S
        while not self.stopped:
            try:
                self.turn(self._wait_s(next_beat))
            except Exception as exc:  # a failed step kills the engine loudly, never silently
                log.exception("engine core step failed; the engine is dead")
                self.flush()
                self._broadcast(CoreDead(f"the engine loop died ({exc!r}); see the engine core's log"))
                return
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + HEARTBEAT_INTERVAL_S
                if os.getppid() != self.parent_pid:
                    return
                self._broadcast(Heartbeat(self.core.stats()))

    def turn(self, wait_s: float) -> None:
        """One turn: drain the inbox (waiting up to ``wait_s`` for its first message), step, send."""
        self.receive(wait_s)
        self.core.poll()
        if self.core.has_work() and time.monotonic() - self._last_step >= self.core.pace_s:
            self._last_step = time.monotonic()
            self.core.step()
            self.steps += 1
        self.route(self.core.take_outputs())
        self.flush()
        if self.stats_each_turn:
            self.last_stats = self.core.stats()

    def _wait_s(self, next_beat: float) -> float:
        now = time.monotonic()
        if self.core.has_work():
            wait = max(0.0, self._last_step + self.core.pace_s - now)
        else:
            wait = max(0.0, next_beat - now)
        if any(stream.backlog for stream in self.streams.values()):
            wait = min(wait, BACKLOG_RETRY_S)
        return wait

    def receive(self, wait_s: float) -> None:
        if not self.sock.poll(int(wait_s * 1000)):
            return
        while True:
            try:
                identity, payload = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = self.decoder.decode(payload)
            except msgspec.DecodeError:
                continue  # not one of ours; never let a bad frame take the core down
            self.handle(identity, message)

    def handle(self, identity: bytes, message: ClientMessage) -> None:
        if isinstance(message, Hello):
            try:
                self.streams[identity] = self._connect_stream(message.outputs)
            except OutputStreamClosed as e:
                log.warning("a client said hello but its output stream is unreachable: %s", e)
                return
            self._send(identity, Ready(info=self.core.info, pid=os.getpid()))
        elif isinstance(message, AddRequest):
            self._add(identity, message)
        elif isinstance(message, AbortRequests):
            self.core.abort(message.request_ids, message.cause)
        elif isinstance(message, StopSequence):
            self.core.stop_sequence(message.request_id, message.index)
        elif isinstance(message, Goodbye):
            self._drop_client(identity)

    def _drop_client(self, identity: bytes) -> None:
        """The client left (or its output stream broke): close its stream, abort its requests."""
        stream = self.streams.pop(identity, None)
        if stream is not None:
            stream.close()
        self.core.abort([rid for rid, owner in self.owners.items() if owner == identity], ABORT_BY_CLIENT)

    def _add(self, identity: bytes, message: AddRequest) -> None:
        rid = message.request.request_id
        if rid in self.owners:
            self._batch(identity).failed.append(RequestFailed(rid, f"request id {rid!r} is already running"))
            return
        try:
            self.core.validate(message.request)
            self.core.add(message.request)
        except Exception as exc:  # noqa: BLE001 - every failure must reach the client, or its request hangs
            text = str(exc) if isinstance(exc, EngineError) else f"engine core error: {exc!r}"
            self._batch(identity).failed.append(RequestFailed(rid, text))
            return
        self.owners[rid] = identity
        self.held.add(message.request)

    def route(self, batch: StepOutputs) -> None:
        """Split what of one turn's outputs goes out now by the client that owns each request."""
        batch = self.held.release(batch)
        for output in batch.outputs:
            if (owner := self.owners.get(output.request_id)) is not None:
                self._batch(owner).outputs.append(output)
        for rid in batch.finished:
            if (owner := self.owners.pop(rid, None)) is not None:
                self._batch(owner).finished.append(rid)
        for failure in batch.failed:
            if (owner := self.owners.pop(failure.request_id, None)) is not None:
                self._batch(owner).failed.append(failure)

    def flush(self) -> None:
        for identity, stream in list(self.streams.items()):
            if stream.backlog:
                self._write(identity, stream.flush)
        pending, self.pending = self.pending, {}
        for identity, batch in pending.items():
            batch.step = self.steps
            self._send(identity, batch)

    def _batch(self, identity: bytes) -> StepOutputs:
        batch = self.pending.get(identity)
        if batch is None:
            batch = self.pending[identity] = StepOutputs()
        return batch

    def _broadcast(self, message: Heartbeat | CoreDead) -> None:
        for identity in list(self.streams):
            self._send(identity, message)

    def _send(self, identity: bytes, message: Any) -> None:
        stream = self.streams.get(identity)
        if stream is not None:
            payload = self.encoder.encode(message)
            self._write(identity, lambda: stream.send(payload))

    def _write(self, identity: bytes, write: Callable[[], None]) -> None:
        try:
            write()
        except OutputStreamClosed as e:
            if not self.stopped:  # a stopping loop's clients close theirs as it ends (an in-process engine's shutdown)
                log.warning("a client's output stream closed (%s): its requests are aborted", e)
            self._drop_client(identity)
