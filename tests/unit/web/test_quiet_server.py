"""QuietServer: a real uvicorn server on loopback whose main loop ticks once a second while idle, still
refreshes the ``date`` header, and stops at once when told to exit (not at its next tick). DrainingServer:
the first signal drains, the server stops when the drain ends, a second signal stops it at once."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import uvicorn

from pdserve.topology.process import free_port
from pdserve.web.quiet_server import TICK_S, DrainingServer, QuietServer
from tests.waiting import wait_until


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


class CountingServer(QuietServer):
    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ticks: list[float] = []

    async def on_tick(self, counter: int) -> bool:
        self.ticks.append(time.monotonic())
        return await super().on_tick(counter)


def test_an_idle_server_ticks_once_a_second_and_exits_at_once() -> None:
    port = free_port()
    server = CountingServer(uvicorn.Config(_app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run)
    thread.start()
    try:
        wait_until(lambda: server.started, "the server listens")
        first = httpx.get(f"http://127.0.0.1:{port}/").headers["date"]
        time.sleep(2.5 * TICK_S)
        assert 2 <= len(server.ticks) <= 4, server.ticks  # uvicorn's own loop would have ticked ~25 times
        assert httpx.get(f"http://127.0.0.1:{port}/").headers["date"] != first  # refreshed each tick
        asked = time.monotonic()
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    assert not thread.is_alive()
    # The main loop left its wait when told (uvicorn's shutdown after it takes its own few ms).
    assert server.ticks[-1] - asked < 0.3 * TICK_S


class GatedDrain(DrainingServer):
    """A drain that lasts until the test opens its gate."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.drains = 0
        self.gate = threading.Event()

    async def drain(self) -> None:
        self.drains += 1
        while not self.gate.is_set():
            await asyncio.sleep(0.01)


@contextlib.contextmanager
def _serving(server: GatedDrain) -> Iterator[tuple[threading.Thread, int]]:
    """``server`` running on a thread (its thread and port); stopped however the test ends."""
    port = free_port()
    server.config = uvicorn.Config(_app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    thread = threading.Thread(target=server.run)
    thread.start()
    try:
        wait_until(lambda: server.started, "the server listens")
        yield thread, port
    finally:
        server.gate.set()
        server.should_exit = True
        thread.join(timeout=10)


def test_the_first_signal_drains_and_the_server_stops_when_the_drain_ends() -> None:
    server = GatedDrain(uvicorn.Config(_app))
    with _serving(server) as (thread, port):
        server.handle_exit(signal.SIGTERM, None)
        wait_until(lambda: server.drains == 1, "the drain starts")
        time.sleep(0.2)
        assert not server.should_exit and thread.is_alive()
        assert httpx.get(f"http://127.0.0.1:{port}/").status_code == 200  # serving while it drains
        server.gate.set()
        thread.join(timeout=10)
        assert not thread.is_alive() and server.drains == 1


def test_a_second_signal_stops_the_server_while_it_drains() -> None:
    server = GatedDrain(uvicorn.Config(_app))
    with _serving(server) as (thread, _):
        server.handle_exit(signal.SIGTERM, None)
        wait_until(lambda: server.drains == 1, "the drain starts")
        server.handle_exit(signal.SIGTERM, None)
        thread.join(timeout=10)
        assert not thread.is_alive() and server.drains == 1  # stopped with its drain still waiting
