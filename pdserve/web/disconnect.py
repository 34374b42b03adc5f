"""The client-disconnect race, written once for the server and the proxy.

An ASGI app learns that its client left from ``receive()``: once the request body is read, the
next message is ``http.disconnect``. :func:`until_disconnect` waits for it; :func:`unless_disconnected`
races some work against it and, when the client goes first, cancels the work (its cleanup then aborts
what it started: engine requests, upstream connections) and raises :class:`ClientGone`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.types import Receive

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def until_disconnect(receive: Receive) -> None:
    """Returns once the client has gone (every message before that is the request's, already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """Await ``work``; if the client leaves first, cancel it (awaiting its cleanup) and raise ClientGone."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(until_disconnect(receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise ClientGone()
        return task.result()
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
