"""The engine contract: the :class:`Engine` protocol and its errors.

The engine never sees text. Stop *strings* are matched by the frontend, which
then calls :meth:`Engine.stop_sequence`. The values it takes and returns are the
wire types of :mod:`pdserve.protocol.engine`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol, runtime_checkable

from pdserve.protocol.engine import EngineInfo, EngineOutput, EngineRequest, EngineStats


class EngineError(RuntimeError):
    """The engine failed: requests in flight end with this error, never with a hang."""


class EngineDeadError(EngineError):
    """The engine (or its core process) is gone; the server is unhealthy."""


class KVLoadError(EngineError):
    """A decode leg's KV could not be pulled from its prefill engine (``--kv-load-failure-policy fail``):
    the peer is gone, its lease expired, or the transfer failed. Answered as a 502."""


@runtime_checkable
class Engine(Protocol):
    """What every engine (scripted, torch in-process, engine-core client) offers the frontend."""

    info: EngineInfo

    async def start(self) -> None:
        """Bring the engine up (load weights, start loops)."""

    async def shutdown(self) -> None:
        """Stop all loops and free resources; in-flight requests end with EngineDeadError."""

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        """Run a request; yields outputs until every sequence has a finish_reason.

        An aborted request still ends with one ``finish_reason="abort"`` output per
        unfinished sequence. Raises EngineError / EngineDeadError on failure.
        Closing the iterator early aborts the request.
        """

    async def abort(self, request_ids: list[str]) -> None:
        """Abort whole requests by id; unknown ids are ignored."""

    async def stop_sequence(self, request_id: str, index: int) -> None:
        """The frontend finished one sequence itself (stop string): free it, emit nothing more for it."""

    def is_healthy(self) -> bool: ...

    def stats(self) -> EngineStats: ...
