"""The in-process scripted engine: each request replays its script from its own iterator.

The replay rules and state are :class:`~pdserve.engine.runners.scripted_core.ScriptedCore`'s (see
there). Here a request advances one step each time its consumer asks for more, after ``step_ms``,
so it never runs ahead of the frontend; an abort or a shutdown is seen at the next step. A request
streamed with a stream interval above 1 has its outputs folded here, as the engine core does
(:mod:`pdserve.engine.coalesce`), so its consumer gets one output per chunk.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from pdserve.engine.api import EngineDeadError
from pdserve.engine.coalesce import OutputCoalescer
from pdserve.engine.runners.scripted_core import ScriptedCore, spec_options
from pdserve.engine.spec import EngineSpec, TokenScript
from pdserve.protocol.engine import ABORT_BY_CLIENT, EngineOutput, EngineRequest, EngineStats


class ScriptedEngine:
    """An in-process :class:`~pdserve.engine.api.Engine` that replays scripts (see module docstring)."""

    def __init__(self, scripts: Sequence[TokenScript], **options: Any) -> None:
        """``options`` are :class:`ScriptedCore`'s: vocab_size, eos_token_ids, tokens_per_step, step_ms, ..."""
        self._core = ScriptedCore(scripts, **options)
        self.info = self._core.info
        self._alive = False

    @classmethod
    def from_spec(cls, spec: EngineSpec) -> ScriptedEngine:
        return cls(spec.scripts, **spec_options(spec))

    async def start(self) -> None:
        self._alive = True

    async def shutdown(self) -> None:
        self._alive = False
        self._core.abort_all()

    def is_healthy(self) -> bool:
        return self._alive

    def stats(self) -> EngineStats:
        return self._core.stats()

    async def abort(self, request_ids: list[str], cause: str = ABORT_BY_CLIENT) -> None:
        self._core.abort(request_ids, cause)

    async def stop_sequence(self, request_id: str, index: int) -> None:
        self._core.stop_sequence(request_id, index)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        if not self._alive:
            raise EngineDeadError("the scripted engine is not running")
        live = self._core.start(request)
        coalescer = OutputCoalescer(request.stream_interval) if request.stream_interval > 1 else None
        try:
            while True:
                # A plain sleep per step (an abort is seen at the next step): waiting on the abort
                # event with a timeout would cost a task and a timer per token.
                await asyncio.sleep(self._core.pace_s)
                if not self._alive:
                    raise EngineDeadError("the scripted engine was shut down")
                outputs, failure = self._core.advance(live)
                if coalescer is not None:
                    outputs = [ready for output in outputs for ready in coalescer.push(output)]
                for output in outputs:
                    yield output
                if failure is not None:
                    raise failure
                if live.over:
                    return
        finally:
            self._core.forget(request.request_id)
