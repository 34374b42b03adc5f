"""The engine loop in this process: :class:`~pdserve.engine.core_server.CoreServer` on a thread, over
an ``inproc://`` ZMQ socket, and an :class:`~pdserve.engine.core_client.EngineCoreClient` in front of it.

So an in-process engine (tests, ``pdserve bench engine``) runs the very loop the engine core process
runs: the same commands, the same batch per turn, the same stream-interval holding, the same channels
on the event loop side. Only the command transport differs (``inproc://`` in one shared ZMQ context
instead of an ipc socket between processes; the output stream is the same Unix socket) and the
supervision: the thread's loop stops when the engine
shuts down, and a failed step tells the client (``CoreDead``) as a core process would.

The step loop is built on the loop's thread (``load``): the torch runner sizes its thread pool and
prepacks its weights on the thread that will run every step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import zmq

from pdserve.engine.api import EngineDeadError
from pdserve.engine.channels import Sink
from pdserve.engine.core_client import EngineCoreClient
from pdserve.engine.core_server import CoreServer, EngineCoreAddresses
from pdserve.engine.stepping import StepCore
from pdserve.protocol.engine import ABORT_BY_CLIENT, EngineInfo, EngineOutput, EngineRequest, EngineStats

_endpoints = itertools.count()


class InProcessCore:
    """An :class:`~pdserve.engine.api.Engine` whose loop runs on a thread of this process (see module docstring).

    ``info`` is known before ``start()`` (the caller's, which ``load`` may complete, as the torch
    runner does with its thread count); ``start()`` builds the step loop and connects.
    """

    def __init__(self, load: Callable[[], StepCore], info: EngineInfo, *, thread_name: str) -> None:
        self.info = info
        self._load = load
        self._thread_name = thread_name
        self._ctx: zmq.Context[Any] | None = None
        self._thread: threading.Thread | None = None
        self._server: CoreServer | None = None
        self._client: EngineCoreClient | None = None

    async def start(self) -> None:
        """Build the step loop on the loop's thread and connect to it (raises if building fails)."""
        if self._thread is not None:
            return
        self._ctx = zmq.Context()
        endpoint = f"inproc://pdserve-core-{os.getpid()}-{next(_endpoints)}"
        loaded: concurrent.futures.Future[StepCore] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._serve, args=(endpoint, loaded), name=self._thread_name, daemon=True
        )
        self._thread.start()
        try:
            await asyncio.wrap_future(loaded)
            self._client = EngineCoreClient(EngineCoreAddresses(endpoint=endpoint), context=self._ctx)
            await self._client.start()
        except BaseException:
            await self._stop()
            raise

    async def shutdown(self) -> None:
        """Stop the loop; in-flight requests and later ones fail with :class:`EngineDeadError`."""
        await self._stop()

    def is_healthy(self) -> bool:
        return self._client is not None and self._client.is_healthy()

    def stats(self) -> EngineStats:
        return self._server.last_stats if self._server is not None else EngineStats()

    async def abort(self, request_ids: list[str], cause: str = ABORT_BY_CLIENT) -> None:
        if self._client is not None:
            await self._client.abort(request_ids, cause)

    async def stop_sequence(self, request_id: str, index: int) -> None:
        if self._client is not None:
            await self._client.stop_sequence(request_id, index)

    def attach_sink(self, request_id: str, sink: Sink) -> bool:
        return self._client is not None and self._client.attach_sink(request_id, sink)

    def direct_outputs(self) -> int:
        return self._client.direct_outputs() if self._client is not None else 0

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        """The request's channel (the loop validates the request; a bad one fails its iterator)."""
        if self._client is None:
            raise EngineDeadError("engine is not running (call start() first)")
        return self._client.generate(request)

    # -- the loop's thread -------------------------------------------------------------------

    def _serve(self, endpoint: str, loaded: concurrent.futures.Future[StepCore]) -> None:
        assert self._ctx is not None
        try:
            steps = self._load()
            sock = self._ctx.socket(zmq.ROUTER)
        except BaseException as exc:  # noqa: BLE001 - start() raises it
            loaded.set_exception(exc)
            return
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(endpoint)
            self._server = CoreServer(steps, sock, os.getppid(), stats_each_turn=True)
        except BaseException as exc:  # noqa: BLE001 - start() raises it
            sock.close()
            loaded.set_exception(exc)
            return
        loaded.set_result(steps)
        try:
            self._server.serve()
        finally:
            sock.close()

    # -- stopping ----------------------------------------------------------------------------

    async def _stop(self) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        if self._server is not None:
            self._server.stopped = True  # seen after the turn the goodbye below wakes
        if self._client is not None:  # kept: later calls raise its "shut down" error
            await self._client.shutdown()
        await asyncio.to_thread(thread.join)
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
