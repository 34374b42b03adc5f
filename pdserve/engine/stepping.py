"""The step-loop contract the one engine loop (:mod:`pdserve.engine.core_server`) drives, in an engine-core
process or on an in-process engine's thread: the torch step loop and the scripted core both keep it.

A :class:`StepCore` owns all request state and is only ever touched by one thread. Its driver, each
turn, drains its inbox (``validate`` then ``add`` per new request; ``abort``, ``stop_sequence``),
calls ``poll()``, calls ``step()`` when there is work, and sends what :meth:`StepCore.take_outputs`
returns as one :class:`~pdserve.engine.messages.StepOutputs`.
"""

from __future__ import annotations

from typing import Protocol

from pdserve.engine.messages import StepOutputs
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

