"""Per-request output queues behind ``Engine.generate`` iterators (the client side of a step loop).

Both the in-process torch engine (fed from its model thread) and the engine-core client (fed
from its socket reader) hand a step's :class:`~pdserve.engine.messages.StepOutputs` to request
iterators the same way: :meth:`OutputChannels.deliver`, one pass per step. An iterator that is
closed before its end reports it, so the engine can abort the request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from pdserve.engine.api import EngineDeadError, EngineError, KVLoadError
from pdserve.engine.messages import KV_LOAD_FAILED, RequestFailed, StepOutputs
from pdserve.protocol.engine import EngineOutput


class _StreamEnd:
    """Queued after a request's last output."""


_END = _StreamEnd()


def failure_error(failure: RequestFailed) -> EngineError:
    """The exception a request's consumer sees for a failure the step loop reported."""
    if failure.dead:
        return EngineDeadError(failure.message)
    if failure.kind == KV_LOAD_FAILED:
        return KVLoadError(failure.message)
    return EngineError(failure.message)


class OutputChannels:
    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue[EngineOutput | EngineError | _StreamEnd]] = {}
        self.batches_delivered = 0  # how many StepOutputs reached the iterators (one per step)

    def deliver(self, batch: StepOutputs) -> None:
        """Hand one step's outputs, stream ends and failures to their iterators."""
        self.batches_delivered += 1
        for output in batch.outputs:
            self._put(output.request_id, output)
        for request_id in batch.finished:
            self._put(request_id, _END)
        for failure in batch.failed:
            self._put(failure.request_id, failure_error(failure))

    def fail_all(self, error: EngineError) -> None:
        for queue in self._queues.values():
            queue.put_nowait(error)

    def _put(self, request_id: str, item: EngineOutput | EngineError | _StreamEnd) -> None:
        queue = self._queues.get(request_id)
        if queue is not None:  # else the iterator is already gone
            queue.put_nowait(item)

    async def stream(
        self, request_id: str, submit: Callable[[], None], abandon: Callable[[], None]
    ) -> AsyncIterator[EngineOutput]:
        """Open the channel, ``submit`` the request, yield until its end or an error.

        ``abandon`` runs when the consumer stops early (the request must be aborted).
        """
        if request_id in self._queues:
            raise EngineError(f"request id {request_id!r} is already running")
        queue: asyncio.Queue[EngineOutput | EngineError | _StreamEnd] = asyncio.Queue()
        self._queues[request_id] = queue
        submit()
        complete = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, _StreamEnd):
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
