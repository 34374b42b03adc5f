"""The engine contract: the :class:`Engine` protocol and its errors.

The engine never sees text. Stop *strings* are matched by the frontend, which
then calls :meth:`Engine.stop_sequence`. The values it takes and returns are the
wire types of :mod:`pdserve.protocol.engine`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Protocol, runtime_checkable

from pdserve.protocol.engine import (
    ABORT_BY_CLIENT,
    ABORT_FOR_SHUTDOWN,
    EngineInfo,
    EngineOutput,
    EngineRequest,
    EngineStats,
)


class EngineError(RuntimeError):
    """The engine failed: requests in flight end with this error, never with a hang."""


class EngineDeadError(EngineError):
    """The engine (or its core process) is gone; the server is unhealthy."""


class KVLoadError(EngineError):
    """A decode leg's KV could not be pulled from its prefill engine (``--kv-load-failure-policy fail``):
    the peer is gone, its lease expired, or the transfer failed. Answered as a 502."""


class RequestAborted(EngineError):
    """A request ended with an abort its client did not ask for: the engine's own (it shut down, vLLM
    dropped it; ``cause`` None) or the server's (shutdown). Answered as an error naming the cause, never
    as a success-shaped ``finish_reason: "abort"``."""

    def __init__(self, cause: str | None) -> None:
        self.cause = cause
        if cause == ABORT_FOR_SHUTDOWN:
            text = "the server is shutting down: the request did not finish within --shutdown-timeout"
        elif cause is None:
            text = "the engine aborted the request on its own (it shut down or dropped it) before it finished"
        else:
            text = f"the server aborted the request ({cause}) before it finished"
        super().__init__(text)


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
        unfinished sequence, carrying the ``cause`` its :meth:`abort` gave (None when the
        engine aborted it on its own). Raises EngineError / EngineDeadError on failure.
        Closing the iterator early aborts the request.
        """

    async def abort(self, request_ids: list[str], cause: str = ABORT_BY_CLIENT) -> None:
        """Abort whole requests by id (engine ids or client ids, see request_ids.matching); unknown ids
        are ignored. ``cause`` comes back as the abort outputs' ``abort_cause``."""

    async def stop_sequence(self, request_id: str, index: int) -> None:
        """The frontend finished one sequence itself (stop string): free it, emit nothing more for it."""

    def is_healthy(self) -> bool: ...

    def stats(self) -> EngineStats: ...


@runtime_checkable
class DirectDelivery(Protocol):
    """An engine whose outputs reach the frontend on its event loop, one pass per step
    (:class:`~pdserve.engine.channels.OutputChannels`): a consumer may take them there, without a
    wake-up of its own (:func:`pdserve.serve.driver.drive`)."""

    def attach_sink(self, request_id: str, sink: Callable[[EngineOutput], bool]) -> bool:
        """Offer the running request's outputs to ``sink`` first (it returns False to decline one);
        False when the request is not running."""

    def direct_outputs(self) -> int:
        """Outputs a sink took so far (for /metrics)."""
