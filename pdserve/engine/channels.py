"""Per-request output queues behind ``Engine.generate`` iterators (the client side of a step loop).

Both the in-process torch engine (fed from its model thread) and the engine-core client (fed
from its socket reader) hand a step's :class:`~pdserve.engine.messages.StepOutputs` to request
iterators the same way: :meth:`OutputChannels.deliver`, one pass per step. An iterator that is
closed before its end reports it, so the engine can abort the request.

A request's consumer may also attach a *sink* (:meth:`OutputChannels.attach_sink`): while its
reader waits on an empty channel, an output is offered to the sink first, in the same pass, and
one the sink takes is never queued. A streamed answer uses it to write its chunk from here, so
one dispatch per step serves every stream without waking each stream's task
(:func:`pdserve.serve.driver.drive`). Whatever the sink declines (an end, an error, an output
while the reader is busy or the client's connection is full) is queued as before, and everything
after it too until the reader has caught up, so the order never changes.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable

from pdserve.engine.api import EngineDeadError, EngineError, KVLoadError
from pdserve.engine.messages import KV_LOAD_FAILED, RequestFailed, StepOutputs
from pdserve.protocol.engine import EngineOutput


class _StreamEnd:
    """Queued after a request's last output."""


_END = _StreamEnd()

_Item = EngineOutput | EngineError | _StreamEnd

# Takes one output at once (True) or declines it (False: it is queued for the reader). Runs inside
# OutputChannels.deliver, so it must not raise.
Sink = Callable[[EngineOutput], bool]


class _Channel:
    """One request's queue: a deque and at most one waiting reader.

    What ``asyncio.Queue`` would do, without its bookkeeping (waiter lists, size limits, task
    counts): this is on the hot path, one put and one get per request per engine step.
    """

    __slots__ = ("_waiter", "items", "sink")

    def __init__(self) -> None:
        self.items: deque[_Item] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self.sink: Sink | None = None

    def put(self, item: _Item) -> bool:
        """Queue ``item`` and wake the reader; True instead when the sink took it."""
        # Offered to the sink only while the reader waits (not cancelled) on an empty queue: everything
        # before was consumed. A channel without a sink (every batch request) checks nothing more.
        sink, waiter = self.sink, self._waiter
        if sink is not None and waiter is not None and not waiter.done() and type(item) is EngineOutput and sink(item):
            return True
        self.items.append(item)
        self._waiter = None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        return False

    async def get(self) -> _Item:
        while not self.items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self.items.popleft()

    def ends_next(self) -> bool:
        """The request's end is already queued (its last output was taken): nothing left to abort."""
        return bool(self.items) and isinstance(self.items[0], (_StreamEnd, EngineError))


def failure_error(failure: RequestFailed) -> EngineError:
    """The exception a request's consumer sees for a failure the step loop reported."""
    if failure.dead:
        return EngineDeadError(failure.message)
    if failure.kind == KV_LOAD_FAILED:
        return KVLoadError(failure.message)
    return EngineError(failure.message)


class OutputChannels:
    def __init__(self) -> None:
        self._queues: dict[str, _Channel] = {}
        self.batches_delivered = 0  # how many StepOutputs reached the iterators (one per step)
        self.direct_outputs = 0  # outputs a sink took (never queued, no reader woken)

    def deliver(self, batch: StepOutputs) -> None:
        """Hand one step's outputs, stream ends and failures to their iterators."""
        self.batches_delivered += 1
        for output in batch.outputs:
            self._put(output.request_id, output)
        for request_id in batch.finished:
            self._put(request_id, _END)
        for failure in batch.failed:
            self._put(failure.request_id, failure_error(failure))

    def attach_sink(self, request_id: str, sink: Sink) -> bool:
        """Offer the request's outputs to ``sink`` from now on (see the module docstring); False when
        the request's channel is gone."""
        channel = self._queues.get(request_id)
        if channel is None:
            return False
        channel.sink = sink
        return True

    def fail_all(self, error: EngineError) -> None:
        for channel in self._queues.values():
            channel.put(error)

    def _put(self, request_id: str, item: _Item) -> None:
        channel = self._queues.get(request_id)
        if channel is not None and channel.put(item):  # else the iterator is already gone
            self.direct_outputs += 1

    async def stream(
        self, request_id: str, submit: Callable[[], None], abandon: Callable[[], None]
    ) -> AsyncIterator[EngineOutput]:
        """Open the channel, ``submit`` the request, yield until its end or an error.

        ``abandon`` runs when the consumer stops early (the request must be aborted); a consumer that
        stops after the last output, before taking the end queued behind it, has not stopped early.
        """
        if request_id in self._queues:
            raise EngineError(f"request id {request_id!r} is already running")
        channel = _Channel()
        self._queues[request_id] = channel
        submit()
        complete = False
        try:
            while True:
                item = await channel.get()
                if isinstance(item, _StreamEnd):
                    complete = True
                    return
                if isinstance(item, EngineError):
                    complete = True
                    raise item
                yield item
        finally:
            del self._queues[request_id]
            if not complete and not channel.ends_next():
                abandon()
