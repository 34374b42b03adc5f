"""Drive one engine request through its request state.

Shared by every endpoint that generates: it feeds engine outputs into the
state, tells the engine when the frontend finished a sequence itself (stop
string), and aborts the engine request whenever the consumer stops early
(client disconnect, error), so nothing keeps running for a request nobody reads.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from pdserve.engine.api import Engine
from pdserve.output.request_state import ChoiceUpdate, RequestState
from pdserve.protocol.engine import EngineRequest


async def drive(engine: Engine, request: EngineRequest, state: RequestState) -> AsyncIterator[ChoiceUpdate]:
    outputs = engine.generate(request)
    try:
        async for out in outputs:
            update = state.add(out)
            if update is None:
                continue
            choice = state.choices[update.index]
            if update.finished and choice.stopped_by_string and out.finish_reason is None:
                await engine.stop_sequence(request.request_id, update.index)
            yield update
            if state.finished:
                break
        else:
            # The engine ended without finishing every sequence: report them aborted.
            for update in state.abort_unfinished():
                yield update
    finally:
        await outputs.aclose()
        if not state.finished:
            await engine.abort([request.request_id])
