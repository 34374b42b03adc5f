"""A uvicorn server whose main loop wakes once a second instead of ten times, and at once to exit.

Why: uvicorn's main loop sleeps 0.1 s between ticks only to notice ``should_exit`` soon; its other work
(the ``date`` header, ``--limit-max-requests``) needs a tick a second. An idle pdserve server spent about
a third of its CPU on those wake-ups, and on a slow model, where tokens come 35 ms apart, a process's idle
CPU is a large part of what each token costs it. Here the loop waits a second or until ``should_exit`` is
set, from a signal handler, a drain or a test, whichever comes first.

Depends on uvicorn's ``main_loop`` / ``on_tick`` pair (uvicorn 0.55): ``on_tick(counter)`` refreshes the
headers when ``counter % 10 == 0`` and answers whether to stop, so every tick here counts ten.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import socket
from types import FrameType

import uvicorn

TICK_S = 1.0
_TICKS_PER_SECOND = 10  # what uvicorn's on_tick counts in


class QuietServer(uvicorn.Server):
    """``uvicorn.Server`` with a 1 s main-loop tick that ``should_exit = True`` cuts short. ``_loop`` is the
    loop it serves on (set at startup), for subclasses that schedule work on it from a signal handler."""

    def __init__(self, config: uvicorn.Config) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = asyncio.Event()
        self._exit = False
        super().__init__(config)

    @property
    def should_exit(self) -> bool:
        return self._exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self._exit = value
        if value and self._loop is not None and not self._loop.is_closed():
            # Thread-safe: uvicorn sets it from its signal handler, pdserve from a drain task.
            self._loop.call_soon_threadsafe(self._wake.set)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    async def main_loop(self) -> None:
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + _TICKS_PER_SECOND) % 864000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), TICK_S)
            should_exit = await self.on_tick(counter)


class DrainingServer(QuietServer, abc.ABC):
    """A ``QuietServer`` that stops gracefully: the first SIGTERM/SIGINT runs ``drain`` on the serving loop
    and stops the server when it returns; a second signal (or one before the loop runs) stops at once.

    Why here: pdserve's server and proxy drain different things (engine requests, proxied streams) under
    the same signal rules, and those rules lean on uvicorn's private ``_captured_signals`` (re-raised at
    exit, so a supervisor sees the signal it sent)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._draining = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining or self.should_exit or self._loop is None:
            super().handle_exit(sig, frame)
            return
        self._captured_signals.append(sig)
        self._draining = True
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain_then_exit()))

    async def _drain_then_exit(self) -> None:
        try:
            await self.drain()
        finally:
            self.should_exit = True

    @abc.abstractmethod
    async def drain(self) -> None:
        """Refuse new work and let what runs finish (or cut it) within the server's shutdown timeout."""
