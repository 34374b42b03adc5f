"""Honest aborts in the driver, and the in-flight registry's admission and idle-stream checks (unit level:
a fake engine that emits exactly the outputs under test; the e2e tests in tests/e2e/test_reliability.py
drive real servers)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from pdserve.engine.api import EngineError, RequestAborted
from pdserve.output.request_state import OutputConfig, RequestState
from pdserve.protocol.engine import (
    ABORT_BY_CLIENT,
    ABORT_FOR_SHUTDOWN,
    EngineOutput,
    EngineRequest,
    SequenceSampling,
)
from pdserve.protocol.errors import RequestError
from pdserve.serve.driver import drive
from pdserve.serve.inflight import InFlight, StreamWatch, drain


class FakeEngine:
    """Replays ``outputs`` for any request; records aborts."""

    def __init__(self, outputs: list[EngineOutput]) -> None:
        self.outputs = outputs
        self.aborted: list[tuple[list[str], str]] = []

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        for out in self.outputs:
            yield out

    async def abort(self, request_ids: list[str], cause: str = ABORT_BY_CLIENT) -> None:
        self.aborted.append((request_ids, cause))

    async def stop_sequence(self, request_id: str, index: int) -> None:
        pass


def request(rid: str = "r#1") -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=[1, 2], sampling=SequenceSampling(max_tokens=8))


def run(engine: FakeEngine) -> list:
    state = RequestState("r#1", 1, OutputConfig(mode="tokens", prompt_token_ids=[1, 2]))

    async def collect() -> list:
        return [u async for u in drive(engine, request(), state)]  # type: ignore[arg-type]

    return asyncio.run(collect())


def test_a_client_abort_ends_the_choice_with_finish_reason_abort() -> None:
    updates = run(FakeEngine([EngineOutput(request_id="r#1", new_token_ids=[5]),
                              EngineOutput(request_id="r#1", finish_reason="abort", abort_cause=ABORT_BY_CLIENT)]))
    assert updates[-1].finished and updates[-1].finish_reason == "abort"


@pytest.mark.parametrize("cause", [None, ABORT_FOR_SHUTDOWN, "idle stream"])
def test_an_abort_the_client_did_not_ask_for_raises_naming_its_cause(cause: str | None) -> None:
    engine = FakeEngine([EngineOutput(request_id="r#1", new_token_ids=[5]),
                         EngineOutput(request_id="r#1", finish_reason="abort", abort_cause=cause)])
    with pytest.raises(RequestAborted) as raised:
        run(engine)
    assert raised.value.cause == cause
    text = str(raised.value)
    assert ("shutting down" in text) if cause == ABORT_FOR_SHUTDOWN else ("aborted" in text)
    assert engine.aborted == [(["r#1"], ABORT_BY_CLIENT)], "the unfinished engine request is still aborted"


def test_an_engine_that_stops_early_is_an_error_not_an_abort() -> None:
    with pytest.raises(EngineError, match="before every sequence finished"):
        run(FakeEngine([EngineOutput(request_id="r#1", new_token_ids=[5])]))


def prepared(rid: str) -> tuple[EngineRequest, RequestState]:
    return request(rid), RequestState(rid, 1, OutputConfig(mode="tokens", prompt_token_ids=[1]))


def test_admission_refuses_past_capacity_and_while_draining_with_retry_after() -> None:
    inflight = InFlight(capacity=2)
    inflight.admit([prepared("a")])
    inflight.admit([prepared("b")])
    with pytest.raises(RequestError) as full:
        inflight.admit([prepared("c")])
    assert full.value.status == 503 and full.value.headers == {"retry-after": "1"}
    assert "overloaded" in full.value.message
    inflight.release([prepared("a")])
    inflight.admit([prepared("c")])  # room again
    inflight.draining = True
    with pytest.raises(RequestError, match="shutting down"):
        inflight.admit([prepared("d")])


def test_only_streams_waiting_longer_than_the_timeout_are_closed_once() -> None:
    inflight = InFlight(capacity=None)
    closed: list[str] = []
    waiting = StreamWatch(close_connection=lambda: closed.append("waiting"), sending_since=100.0)
    fresh = StreamWatch(close_connection=lambda: closed.append("fresh"), sending_since=104.5)
    reading = StreamWatch(close_connection=lambda: closed.append("reading"), sending_since=None)
    inflight.streams |= {waiting, fresh, reading}
    assert inflight.expire_idle_streams(5.0, now=105.0) == 1
    assert inflight.expire_idle_streams(5.0, now=105.0) == 0, "a stream is closed once"
    assert closed == ["waiting"]


def test_drain_aborts_what_outlives_the_timeout_with_the_shutdown_cause() -> None:
    inflight = InFlight(capacity=None)
    inflight.admit([prepared("slow")])
    aborted: list[list[str]] = []

    async def abort(ids: list[str]) -> None:
        aborted.append(ids)
        inflight.release([prepared("slow")])  # the request ends once aborted

    asyncio.run(drain(inflight, 0.05, abort))
    assert inflight.draining and aborted == [["slow"]] and not inflight.requests
