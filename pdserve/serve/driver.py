"""Drive one engine request through its request state.

Shared by every endpoint that generates: it feeds engine outputs into the
state, tells the engine when the frontend finished a sequence itself (stop
string), and aborts the engine request whenever the consumer stops early
(client disconnect, error), so nothing keeps running for a request nobody reads.
With a stream interval above 1 the engine has already folded each sequence's outputs into one per
chunk (:mod:`pdserve.engine.coalesce`): the driver forwards what the engine sends.

A stream may pass an :class:`Outlet`. Then, on an engine that delivers on the event loop
(:class:`~pdserve.engine.api.DirectDelivery`), an ordinary output (one that ends nothing) is
folded in and its update emitted from the engine's dispatch itself, while this generator
stays parked: one pass per engine step writes every stream's chunk, without a task wake-up and
a chain of generator resumptions per stream. Everything else comes through this generator as
before, in order: the first output, the last, aborts, failures, and any output that arrives
while the outlet cannot take it (the client's connection is full, the previous update is still
being written). A request with stop strings never uses it: the frontend may end a sequence
there, which needs the engine told and the stream closed.

Aborts are honest: only an abort the client asked for (``/abort_requests``) ends a
sequence with ``finish_reason: "abort"``. One the client did not ask for (the engine
shut down or dropped the request, the server is shutting down) raises
:class:`~pdserve.engine.api.RequestAborted`, which the responses turn into an error
naming the cause; so does an engine that ends a request before it finished.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from pdserve.engine.api import DirectDelivery, Engine, EngineError, RequestAborted
from pdserve.output.request_state import ChoiceUpdate, RequestState
from pdserve.protocol.engine import ABORT_BY_CLIENT, EngineOutput, EngineRequest


class Outlet(Protocol):
    """Where a stream's updates can go at once (serve.event_stream.DirectEvents). Only for a consumer
    that takes :func:`drive`'s updates straight to the client: nothing may buffer them in between,
    or the two ways would reorder."""

    def ready(self) -> bool:
        """The next update can be emitted now."""

    def emit(self, update: ChoiceUpdate) -> None:
        """Send one update on (what the consumer does with an update this generator yields)."""


async def drive(
    engine: Engine, request: EngineRequest, state: RequestState, outlet: Outlet | None = None
) -> AsyncIterator[ChoiceUpdate]:
    outputs = engine.generate(request)
    direct = outlet is not None and not state.config.stop.stop and isinstance(engine, DirectDelivery)
    failure: list[Exception] = []

    def take(out: EngineOutput) -> bool:
        """The sink (engine.channels): fold an ordinary output in and emit its update, or decline."""
        if failure or out.finish_reason is not None or not outlet.ready():  # type: ignore[union-attr]
            return False
        try:
            update = state.add(out)
            if update is not None:
                outlet.emit(update)  # type: ignore[union-attr]
        except Exception as e:  # noqa: BLE001 - a sink must not raise: the reader raises it instead
            failure.append(e)
            return False
        return True

    try:
        async for out in outputs:
            if failure:
                raise failure[0]
            if out.finish_reason == "abort" and out.abort_cause != ABORT_BY_CLIENT:
                raise RequestAborted(out.abort_cause)
            update = state.add(out)
            if update is not None:
                choice = state.choices[update.index]
                if update.finished and choice.stopped_by_string and out.finish_reason is None:
                    await engine.stop_sequence(request.request_id, update.index)
                yield update
            if state.finished:
                break
            if direct:  # once, after the first output came this way (the response has started by then)
                direct = False
                engine.attach_sink(request.request_id, take)  # type: ignore[attr-defined]
        else:
            raise EngineError("the engine ended the request before every sequence finished")
    finally:
        await outputs.aclose()
        if not state.finished:
            await engine.abort([request.request_id])
