"""Drive one engine request through its request state.

Shared by every endpoint that generates: it feeds engine outputs into the
state, tells the engine when the frontend finished a sequence itself (stop
string), and aborts the engine request whenever the consumer stops early
(client disconnect, error), so nothing keeps running for a request nobody reads.
With a stream interval above 1 it folds each sequence's outputs into one per chunk first
(:mod:`pdserve.engine.coalesce`).

Aborts are honest: only an abort the client asked for (``/abort_requests``) ends a
sequence with ``finish_reason: "abort"``. One the client did not ask for (the engine
shut down or dropped the request, the server is shutting down) raises
:class:`~pdserve.engine.api.RequestAborted`, which the responses turn into an error
naming the cause; so does an engine that ends a request before it finished.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from pdserve.engine.api import Engine, EngineError, RequestAborted
from pdserve.engine.coalesce import OutputCoalescer
from pdserve.output.request_state import ChoiceUpdate, RequestState
from pdserve.protocol.engine import ABORT_BY_CLIENT, EngineRequest


async def drive(engine: Engine, request: EngineRequest, state: RequestState) -> AsyncIterator[ChoiceUpdate]:
    outputs = engine.generate(request)
    # An engine core already holds the outputs (pdserve.engine.core); this folding is for the engines
    # that run in this process, and passes a folded stream through unchanged.
    coalescer = OutputCoalescer(request.stream_interval) if request.stream_interval > 1 else None
    try:
        async for out in outputs:
            if out.finish_reason == "abort" and out.abort_cause != ABORT_BY_CLIENT:
                raise RequestAborted(out.abort_cause)
            for ready in (out,) if coalescer is None else coalescer.push(out):
                update = state.add(ready)
                if update is None:
                    continue
                choice = state.choices[update.index]
                if update.finished and choice.stopped_by_string and ready.finish_reason is None:
                    await engine.stop_sequence(request.request_id, update.index)
                yield update
            if state.finished:
                break
        else:
            raise EngineError("the engine ended the request before every sequence finished")
    finally:
        await outputs.aclose()
        if not state.finished:
            await engine.abort([request.request_id])
