"""The step-loop contract every driver runs: the engine core process's loop and the in-process torch thread.

A :class:`StepCore` owns all request state and is only ever touched by one thread. Its driver, each
turn, drains its inbox (:func:`apply` per command), calls ``poll()``, calls ``step()`` when there is
work, and sends what :meth:`StepCore.take_outputs` returns as one
:class:`~pdserve.engine.messages.StepOutputs`.
"""

from __future__ import annotations

from typing import Protocol

from pdserve.engine.messages import AbortRequests, AddRequest, Command, StepOutputs, StopSequence
from pdserve.protocol.engine import EngineInfo, EngineRequest, EngineStats


class StepCore(Protocol):
    info: EngineInfo
    pace_s: float  # the least time between two steps (the scripted engine's --step-ms)

    def validate(self, request: EngineRequest) -> None:
        """Raise :class:`~pdserve.engine.api.EngineError` for a request that would break a step."""

    def add(self, request: EngineRequest) -> None: ...

    def abort(self, request_ids: list[str], cause: str | None) -> None:
        """End the requests; each unfinished sequence emits ``finish_reason="abort"`` with ``cause``."""

    def stop_sequence(self, request_id: str, index: int) -> None: ...

    def has_work(self) -> bool: ...

    def poll(self) -> None:
        """Housekeeping between steps (KV leases, notifications); cheap, called every turn, idle or not."""

    def step(self) -> None:
        """Advance every running request by one step."""

    def take_outputs(self) -> StepOutputs:
        """What the commands and steps since the last call produced (then start a new batch)."""

    def stats(self) -> EngineStats: ...


def apply(core: StepCore, command: Command) -> None:
    """Run one (already validated) command on the core; its outputs join the next batch."""
    if isinstance(command, AddRequest):
        core.add(command.request)
    elif isinstance(command, AbortRequests):
        core.abort(command.request_ids, command.cause)
    elif isinstance(command, StopSequence):
        core.stop_sequence(command.request_id, command.index)
