"""The engine core in its own process, and the client every frontend uses to reach it.

Why a process: the model loop and the HTTP/detokenize/parse work must never stall each
other, and ``--api-server-count N`` runs N frontend processes against one model. The
core binds one ZMQ ROUTER socket (ipc, under a private temp dir); each frontend's
:class:`EngineCoreClient` connects a DEALER, so the core knows which client added a
request and routes its outputs back there, while an abort or stop from *any* client
works by request id. Messages are msgspec Structs tagged into one union per direction.

Supervision: :func:`start_engine_core` spawns the core and waits for its handshake;
clients learn the core's pid and ``EngineInfo`` on connect, receive a heartbeat with
stats every :data:`HEARTBEAT_INTERVAL_S`, and declare the engine dead (every in-flight
iterator raises :class:`EngineDeadError`) when the pid is gone or heartbeats stop.
The core exits when its engine dies or its parent process goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import AsyncIterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from pdserve.engine.api import (
    Engine,
    EngineDeadError,
    EngineError,
    EngineInfo,
    EngineOutput,
    EngineRequest,
    EngineStats,
)
from pdserve.engine.channels import DONE, OutputChannels
from pdserve.engine.factory import EngineSpec, build_engine

HEARTBEAT_INTERVAL_S = 0.5
# A client gives up on a core that has been silent this long (the pid check is faster
# when the core runs on the same host, which is always the case today).
HEARTBEAT_TIMEOUT_S = 10.0
# How often a client checks the core's pid.
LIVENESS_POLL_S = 0.2


# -- wire messages ----------------------------------------------------------------------


class Hello(msgspec.Struct, tag="hello"):
    """A client introduces itself; the core answers with :class:`Ready`."""


class Add(msgspec.Struct, tag="add"):
    request: EngineRequest


class Abort(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class StopSequence(msgspec.Struct, tag="stop"):
    request_id: str
    index: int


class Goodbye(msgspec.Struct, tag="bye"):
    """A client leaves: its unfinished requests are aborted."""


ClientMessage = Hello | Add | Abort | StopSequence | Goodbye


class Ready(msgspec.Struct, tag="ready"):
    info: EngineInfo
    pid: int


class Outputs(msgspec.Struct, tag="outputs"):
    outputs: list[EngineOutput]
    done: list[str]  # requests whose streams ended after these outputs


class RequestFailed(msgspec.Struct, tag="failed"):
    request_id: str
    message: str
    dead: bool


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    stats: EngineStats


class CoreDead(msgspec.Struct, tag="dead"):
    message: str


CoreMessage = Ready | Outputs | RequestFailed | Heartbeat | CoreDead


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
    """Spawn a core process serving ``build_engine(spec)`` and wait until it accepts clients.

    Raises :class:`EngineError` with the core's traceback if it fails to start.
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
        asyncio.run(_serve_core(spec, addresses, ready, parent_pid))
    except Exception:  # noqa: BLE001 - reported to the parent if startup never finished
        with contextlib.suppress(OSError):
            ready.send(("error", traceback.format_exc()))
        raise SystemExit(1) from None


async def _serve_core(spec: EngineSpec, addresses: EngineCoreAddresses, ready: Connection, parent_pid: int) -> None:
    engine = build_engine(spec)
    await engine.start()
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.SNDHWM, 0)  # a ROUTER drops messages at the high-water mark; never drop outputs
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(addresses.endpoint)
    ready.send(("ready", msgspec.msgpack.encode(engine.info)))
    ready.close()
    try:
        await _CoreServer(engine, sock).serve(parent_pid)
    finally:
        sock.close()
        ctx.term()
        await engine.shutdown()


class _CoreServer:
    """Routes client messages into the engine and outputs back to the client that owns each request."""

    def __init__(self, engine: Engine, sock: zmq.asyncio.Socket) -> None:
        self.engine, self.sock = engine, sock
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(ClientMessage)
        self.clients: set[bytes] = set()
        self.owners: dict[str, bytes] = {}
        self.pumps: dict[str, asyncio.Task[None]] = {}
        # Outputs are batched per client and flushed once per event-loop turn.
        self.pending: dict[bytes, Outputs] = {}
        self.flush_scheduled = False

    async def serve(self, parent_pid: int) -> None:
        watchdog = asyncio.create_task(self._heartbeats(parent_pid))
        try:
            while not watchdog.done():
                receive = asyncio.ensure_future(self.sock.recv_multipart())
                await asyncio.wait({receive, watchdog}, return_when=asyncio.FIRST_COMPLETED)
                if not receive.done():
                    receive.cancel()
                    break
                identity, payload = receive.result()
                try:
                    message = self.decoder.decode(payload)
                except msgspec.DecodeError:
                    continue  # not one of ours; never let a bad frame take the core down
                await self._handle(identity, message)
        finally:
            watchdog.cancel()
            for pump in list(self.pumps.values()):
                pump.cancel()

    async def _handle(self, identity: bytes, message: Any) -> None:
        if isinstance(message, Hello):
            self.clients.add(identity)
            self._send(identity, Ready(info=self.engine.info, pid=os.getpid()))
        elif isinstance(message, Add):
            rid = message.request.request_id
            if rid in self.owners:
                self._send(identity, RequestFailed(rid, f"request id {rid!r} is already running", dead=False))
                return
            self.owners[rid] = identity
            self.pumps[rid] = asyncio.create_task(self._pump(identity, message.request))
            # Let the pump submit the request before the next message: an abort right behind
            # the add must find it in the engine.
            await asyncio.sleep(0)
        elif isinstance(message, Abort):
            await self.engine.abort(message.request_ids)
        elif isinstance(message, StopSequence):
            await self.engine.stop_sequence(message.request_id, message.index)
        elif isinstance(message, Goodbye):
            self.clients.discard(identity)
            await self.engine.abort([rid for rid, owner in self.owners.items() if owner == identity])

    async def _pump(self, identity: bytes, request: EngineRequest) -> None:
        rid = request.request_id
        try:
            async for output in self.engine.generate(request):
                self._queue(identity).outputs.append(output)
            self._queue(identity).done.append(rid)
        except Exception as exc:  # noqa: BLE001 - every failure must reach the client, or its request hangs
            self._flush()  # outputs before the failure first
            message = str(exc) if isinstance(exc, EngineError) else f"engine core error: {exc!r}"
            self._send(identity, RequestFailed(rid, message, dead=isinstance(exc, EngineDeadError)))
        finally:
            self.owners.pop(rid, None)
            self.pumps.pop(rid, None)

    def _queue(self, identity: bytes) -> Outputs:
        batch = self.pending.get(identity)
        if batch is None:
            batch = self.pending[identity] = Outputs(outputs=[], done=[])
        if not self.flush_scheduled:
            self.flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)
        return batch

    def _flush(self) -> None:
        self.flush_scheduled = False
        pending, self.pending = self.pending, {}
        for identity, batch in pending.items():
            self._send(identity, batch)

    def _send(self, identity: bytes, message: Any) -> None:
        self.sock.send_multipart([identity, self.encoder.encode(message)])

    async def _heartbeats(self, parent_pid: int) -> None:
        """Tell clients we are alive; exit (ending serve) when the engine died or the parent is gone."""
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)
            if not self.engine.is_healthy():
                self._flush()
                for identity in self.clients:
                    self._send(identity, CoreDead("the engine loop died; see the engine core's log"))
                return
            if os.getppid() != parent_pid:
                return
            beat = Heartbeat(self.engine.stats())
            for identity in self.clients:
                self._send(identity, beat)


# -- the client -------------------------------------------------------------------------



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

    Use from one asyncio event loop: ``client = await EngineCoreClient.connect(addresses)``.
    """

    info: EngineInfo  # set by start() from the core's handshake
    core_pid: int

    def __init__(self, addresses: EngineCoreAddresses, *, connect_timeout: float = 30.0) -> None:
        self.addresses = addresses
        self.connect_timeout = connect_timeout
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreMessage)
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._channels = OutputChannels()
        self._tasks: list[asyncio.Task[None]] = []
        self._dead: EngineDeadError | None = None
        self._stats = EngineStats()
        self._last_heard = 0.0

    @classmethod
    async def connect(cls, addresses: EngineCoreAddresses, *, connect_timeout: float = 30.0) -> EngineCoreClient:
        client = cls(addresses, connect_timeout=connect_timeout)
        await client.start()
        return client

    async def start(self) -> None:
        """Connect and handshake: afterwards ``info`` and ``core_pid`` are the core's."""
        if self._sock is not None:
            return
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(self.addresses.endpoint)
        self._send(Hello())
        try:
            while True:
                reply = self._decoder.decode(await asyncio.wait_for(self._sock.recv(), self.connect_timeout))
                if isinstance(reply, Ready):
                    break
        except TimeoutError:
            self._close_socket()
            raise EngineDeadError(
                f"engine core at {self.addresses.endpoint} did not answer within {self.connect_timeout:.0f}s"
            ) from None
        self.info, self.core_pid = reply.info, reply.pid
        self._last_heard = time.monotonic()
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._watch())]

    async def shutdown(self) -> None:
        """Disconnect this client (the core keeps serving others); its in-flight requests end."""
        if self._sock is None:
            return
        if self._dead is None:
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

    async def abort(self, request_ids: list[str]) -> None:
        if request_ids and self._dead is None:
            self._send(Abort(list(request_ids)))

    async def stop_sequence(self, request_id: str, index: int) -> None:
        if self._dead is None:
            self._send(StopSequence(request_id, index))

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        if self._dead is not None:
            raise self._dead
        if self._sock is None:
            raise EngineDeadError("engine client is not connected (call start() first)")
        rid = request.request_id

        def abandon() -> None:
            if self._dead is None:
                self._send(Abort([rid]))

        # aclosing: closing this iterator must close the channel's at once (its cleanup aborts).
        async with contextlib.aclosing(self._channels.stream(rid, lambda: self._send(Add(request)), abandon)) as outputs:
            async for output in outputs:
                yield output

    # -- internals ---------------------------------------------------------------------------

    def _send(self, message: Any) -> None:
        assert self._sock is not None
        self._sock.send(self._encoder.encode(message))

    async def _receive(self) -> None:
        assert self._sock is not None
        while True:
            frame = await self._sock.recv()
            self._last_heard = time.monotonic()
            try:
                message = self._decoder.decode(frame)
            except msgspec.DecodeError:
                continue
            if isinstance(message, Outputs):
                for output in message.outputs:
                    self._channels.put(output.request_id, output)
                for rid in message.done:
                    self._channels.put(rid, DONE)
            elif isinstance(message, Heartbeat):
                self._stats = message.stats
            elif isinstance(message, RequestFailed):
                error = EngineDeadError if message.dead else EngineError
                self._channels.put(message.request_id, error(message.message))
            elif isinstance(message, CoreDead):
                self._die(f"engine core reported its engine dead: {message.message}")
                return

    async def _watch(self) -> None:
        while self._dead is None:
            await asyncio.sleep(LIVENESS_POLL_S)
            if not _pid_alive(self.core_pid):
                self._die(f"engine core process {self.core_pid} exited")
            elif time.monotonic() - self._last_heard > HEARTBEAT_TIMEOUT_S:
                self._die(f"engine core process {self.core_pid} sent no heartbeat for {HEARTBEAT_TIMEOUT_S:.0f}s")

    def _die(self, reason: str) -> None:
        if self._dead is not None:
            return
        self._dead = EngineDeadError(reason)
        self._channels.fail_all(self._dead)

    def _close_socket(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
