"""The engine core in its own process: it drives its step loop and answers every frontend.

Why a process: the model loop and the HTTP/detokenize/parse work must never stall each
other, and ``--api-server-count N`` runs N frontend processes against one model. The
core binds one ZMQ ROUTER socket (ipc, under a private temp dir); each frontend's
:class:`~pdserve.engine.core_client.EngineCoreClient` connects a DEALER, so the core knows which
client added a request and routes its outputs back down that client's output stream (a Unix
socket the client listens on, :mod:`pdserve.engine.output_stream`), while an abort or stop from
*any* client works by request id. Messages are the msgspec Structs of :mod:`pdserve.engine.messages`.

The loop is :class:`~pdserve.engine.core_server.CoreServer` (``core_server.py``), over the step loop
:func:`~pdserve.engine.factory.build_core` returns: the one engine loop, which an in-process engine
runs on a thread over an ``inproc://`` socket instead (:mod:`pdserve.engine.inproc`).

Supervision: :func:`start_engine_core` spawns the core and waits for its handshake;
clients learn the core's pid and ``EngineInfo`` on connect and receive a heartbeat with
stats every ``core_server.HEARTBEAT_INTERVAL_S``. The core exits when a step fails (after telling its
clients) or when its parent process goes away.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import shutil
import tempfile
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import msgspec
import zmq

from pdserve.engine.api import EngineError
from pdserve.engine.core_server import CoreServer, EngineCoreAddresses
from pdserve.engine.factory import build_core
from pdserve.engine.spec import EngineSpec
from pdserve.protocol.engine import EngineInfo

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

