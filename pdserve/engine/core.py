"""The engine core in its own process: it drives its step loop and answers every frontend.

Why a process: the model loop and the HTTP/detokenize/parse work must never stall each
other, and ``--api-server-count N`` runs N frontend processes against one model. The
core binds one ZMQ ROUTER socket (ipc, under a private temp dir); each frontend's
:class:`~pdserve.engine.core_client.EngineCoreClient` connects a DEALER, so the core knows which
client added a request and routes its outputs back there, while an abort or stop from *any*
client works by request id. Messages are the msgspec Structs of :mod:`pdserve.engine.messages`.

The loop (:class:`CoreServer`): drain the socket's inbox, run one ``step()`` of the step loop
(:func:`~pdserve.engine.factory.build_core`), send each client **one** ``StepOutputs`` with
everything that turn produced for it. No per-request task, queue or iterator lives here. A request
streamed with a stream interval has its outputs held until a chunk is due (:mod:`pdserve.engine.coalesce`),
so a frontend is not woken for steps it would not send.

Supervision: :func:`start_engine_core` spawns the core and waits for its handshake;
clients learn the core's pid and ``EngineInfo`` on connect and receive a heartbeat with
stats every :data:`HEARTBEAT_INTERVAL_S`. The core exits when a step fails (after telling its
clients) or when its parent process goes away.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import multiprocessing
import os
import shutil
import tempfile
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec
import zmq

from pdserve.engine.api import EngineError
from pdserve.engine.coalesce import StreamIntervals
from pdserve.engine.factory import build_core
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
from pdserve.engine.spec import EngineSpec
from pdserve.engine.stepping import StepCore
from pdserve.protocol.engine import ABORT_BY_CLIENT, EngineInfo

HEARTBEAT_INTERVAL_S = 0.5

log = logging.getLogger(__name__)


# -- where clients find the core ----------------------------------------------------------


class EngineCoreAddresses(msgspec.Struct, frozen=True):
    """Where clients find a core (picklable/serialisable, handed to frontend processes)."""

    endpoint: str


# -- starting and supervising the core process ------------------------------------------


@dataclass
class EngineCoreHandle:
    """The parent's handle on a running core process."""

    process: BaseProcess
    addresses: EngineCoreAddresses
    info: EngineInfo
    run_dir: str

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the core (SIGTERM, then SIGKILL after ``timeout``) and remove its socket dir."""
        _stop_process(self.process, timeout)
        shutil.rmtree(self.run_dir, ignore_errors=True)


def start_engine_core(spec: EngineSpec, *, ready_timeout: float = 600.0) -> EngineCoreHandle:
    """Spawn a core process that drives the step loop ``build_core(spec)`` and wait until it accepts clients.

    The core loads its model before it answers, so this returns once the model is loaded (or after
    ``ready_timeout`` seconds). Raises :class:`EngineError` with the core's traceback if it fails to start.
    """
    run_dir = tempfile.mkdtemp(prefix="pdserve-core-")
    addresses = EngineCoreAddresses(endpoint=f"ipc://{run_dir}/engine.sock")
    ctx = multiprocessing.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    process = ctx.Process(
        target=run_engine_core, args=(spec, addresses, writer, os.getpid()), name="pdserve-engine-core", daemon=True
    )
    try:
        process.start()
        writer.close()
        info = _wait_ready(process, reader, ready_timeout)
    except BaseException:
        if process.pid is not None:
            _stop_process(process, 5.0)
        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    finally:
        reader.close()
        writer.close()
    return EngineCoreHandle(process, addresses, info, run_dir)


def _wait_ready(process: BaseProcess, reader: Connection, timeout: float) -> EngineInfo:
    deadline = time.monotonic() + timeout
    while not reader.poll(0.1):
        if not process.is_alive():
            raise EngineError(f"engine core exited during startup (exit code {process.exitcode})")
        if time.monotonic() > deadline:
            raise EngineError(f"engine core did not become ready within {timeout:.0f}s")
    try:
        kind, payload = reader.recv()
    except EOFError:
        process.join(5.0)
        raise EngineError(f"engine core exited during startup (exit code {process.exitcode})") from None
    if kind != "ready":
        raise EngineError(f"engine core failed to start:\n{payload}")
    return msgspec.msgpack.decode(payload, type=EngineInfo)


def _stop_process(process: BaseProcess, timeout: float) -> None:
    if process.is_alive():
        process.terminate()
        process.join(timeout)
        if process.is_alive():
            process.kill()
    process.join()


def run_engine_core(spec: EngineSpec, addresses: EngineCoreAddresses, ready: Connection, parent_pid: int) -> None:
    """Entry point of the core process."""
    try:
        core = build_core(spec)
        # The model and its tables live as long as the process: out of the collector's reach, so a
        # full collection between steps walks only what steps made (serve.runner.freeze_startup_heap).
        gc.collect()
        gc.freeze()
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.SNDHWM, 0)  # a ROUTER drops messages at the high-water mark; never drop outputs
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(addresses.endpoint)
        ready.send(("ready", msgspec.msgpack.encode(core.info)))
        ready.close()
    except Exception:  # noqa: BLE001 - reported to the parent, whose start_engine_core raises it
        with contextlib.suppress(OSError):
            ready.send(("error", traceback.format_exc()))
        raise SystemExit(1) from None
    try:
        CoreServer(core, sock, parent_pid).serve()
    finally:
        sock.close()
        ctx.term()


class CoreServer:
    """Drains client messages into the step loop and sends each client one batch per turn."""

    def __init__(self, core: StepCore, sock: zmq.Socket[Any], parent_pid: int) -> None:
        self.core, self.sock, self.parent_pid = core, sock, parent_pid
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(ClientMessage)
        self.clients: set[bytes] = set()
        self.owners: dict[str, bytes] = {}  # request id -> the client that added it
        self.pending: dict[bytes, StepOutputs] = {}  # this turn's batch per client
        # Requests streamed with a stream interval above 1: their outputs wait here for a full chunk.
        self.held = StreamIntervals()
        self.steps = 0
        self._last_step = -math.inf

    def serve(self) -> None:
        """Run until the parent process is gone or a step fails."""
        next_beat = time.monotonic() + HEARTBEAT_INTERVAL_S
        while True:
            try:
                self.turn(self._wait_s(next_beat))
            except Exception:  # a failed step kills the engine loudly, never silently
                log.exception("engine core step failed; the engine is dead")
                self.flush()
                self._broadcast(CoreDead("the engine loop died; see the engine core's log"))
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

    def _wait_s(self, next_beat: float) -> float:
        now = time.monotonic()
        if self.core.has_work():
            return max(0.0, self._last_step + self.core.pace_s - now)
        return max(0.0, next_beat - now)

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
            self.clients.add(identity)
            self._send(identity, Ready(info=self.core.info, pid=os.getpid()))
        elif isinstance(message, AddRequest):
            self._add(identity, message)
        elif isinstance(message, AbortRequests):
            self.core.abort(message.request_ids, message.cause)
        elif isinstance(message, StopSequence):
            self.core.stop_sequence(message.request_id, message.index)
        elif isinstance(message, Goodbye):
            self.clients.discard(identity)
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
        for identity in self.clients:
            self._send(identity, message)

    def _send(self, identity: bytes, message: Any) -> None:
        self.sock.send_multipart([identity, self.encoder.encode(message)])
