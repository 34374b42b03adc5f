"""Per-request output queues behind ``Engine.generate`` iterators.

Both the in-process torch engine (fed from its model thread) and the engine-core
client (fed from its socket reader) hand outputs to request iterators the same
way; this is that one piece: put outputs, end a stream, fail every stream, and an
iterator that reports being abandoned (closed before its end) so the engine can
abort the request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from pdserve.engine.api import EngineError, EngineOutput

DONE = object()  # end of a request's output stream


class OutputChannels:
    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue[Any]] = {}

    def put(self, request_id: str, item: EngineOutput | EngineError | object) -> None:
        """Deliver an output, an error, or DONE (ignored when the iterator is already gone)."""
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(item)

    def fail_all(self, error: EngineError) -> None:
        for queue in self._queues.values():
            queue.put_nowait(error)

    async def stream(
        self, request_id: str, submit: Callable[[], None], abandon: Callable[[], None]
    ) -> AsyncIterator[EngineOutput]:
        """Open the channel, ``submit`` the request, yield until DONE or an error.

        ``abandon`` runs when the consumer stops early (the request must be aborted).
        """
        if request_id in self._queues:
            raise EngineError(f"request id {request_id!r} is already running")
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[request_id] = queue
        submit()
        complete = False
        try:
            while True:
                item = await queue.get()
                if item is DONE:
                    complete = True
                    return
                if isinstance(item, EngineError):
                    complete = True
                    raise item
                yield item
        finally:
            del self._queues[request_id]
            if not complete:
                abandon()
