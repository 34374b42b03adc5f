"""The schedule of ``bench serve`` with a stand-in client: caps, bounds, rotation, and the client-health flags."""

from __future__ import annotations

import asyncio
import math
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.bench import sweep
from pdserve.bench.loadgen import Arm, Prompt
from pdserve.bench.metrics import RequestResult
from pdserve.bench.scenarios import check_result
from pdserve.bench.servers import BenchError
from pdserve.bench.sweep import Cell, Load, Schedule, cell_summary, run_batch

PROMPT = Prompt(chat={"messages": []}, rendered={"token_ids": [1, 2], "sampling_params": {}})


class FakeClient:
    """Answers every request after ``delay_s`` with 3 tokens, recording how many ran at once."""

    def __init__(self, delay_s: float = 0.002):
        self.delay_s = delay_s
        self.in_flight = 0
        self.peak = 0
        self.order: list[tuple[str, int]] = []
        self.started: list[float] = []

    async def run(self, arm: Arm, prompt: Prompt, index: int) -> RequestResult:
        self.order.append((arm.label, index))
        self.started.append(time.perf_counter())
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        result = RequestResult(start=0.0, prompt_len=prompt.prompt_len, mode=arm.mode_of(index))
        await asyncio.sleep(self.delay_s)
        result.arrivals = [(0.001, 1), (0.002, 2)]
        result.end, result.success = 0.003, True
        self.in_flight -= 1
        return result


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 6), st.integers(1, 20))
def test_concurrency_cap_holds_and_every_prompt_runs(cap: int, count: int) -> None:
    client = FakeClient()
    done: list[int] = []
    results = asyncio.run(run_batch(client, Arm("a", "http://x"), [PROMPT] * count, Load(cap), Schedule(count),  # type: ignore[arg-type]
                                    random.Random(0), lambda: done.append(1)))
    assert len(results) == count == len(done)
    assert client.peak <= cap
    assert client.peak == min(cap, count)  # the cap is also reached: requests do run concurrently


def test_duration_bound_stops_issuing_and_poisson_spreads_arrivals() -> None:
    client = FakeClient()
    bounded = asyncio.run(run_batch(client, Arm("a", "http://x"), [PROMPT] * 50, Load(4),  # type: ignore[arg-type]
                                    Schedule(50, duration_s=0.0), random.Random(0), lambda: None))
    assert len(bounded) == 1  # the first request always goes; nothing after the deadline
    paced = FakeClient(delay_s=0.0)
    asyncio.run(run_batch(paced, Arm("a", "http://x"), [PROMPT] * 6, Load(None, request_rate=200.0),  # type: ignore[arg-type]
                          Schedule(6), random.Random(7), lambda: None))
    expected = random.Random(7)
    gaps = [b - a for a, b in zip(paced.started, paced.started[1:], strict=False)]
    # Exponential gaps drawn from the seeded generator (a sleep never ends early).
    assert all(gap >= expected.expovariate(200.0) * 0.999 for gap in gaps) and len(gaps) == 5


def test_rounds_rotate_the_arm_order() -> None:
    client = FakeClient(delay_s=0.0)
    arms = [Arm("a", "http://x"), Arm("b", "http://x"), Arm("c", "http://x")]

    async def go() -> dict:
        original = sweep.ArmClient
        sweep.ArmClient = lambda http: client  # type: ignore[assignment,misc]
        try:
            return await sweep.run_schedule(arms, [Load(1)], [PROMPT], Schedule(1, rounds=3, num_warmups=0),
                                            None, progress=False)
        finally:
            sweep.ArmClient = original  # type: ignore[misc]

    cells = asyncio.run(go())
    assert [label for label, _ in client.order] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert all(len(c.results) == 3 for c in cells.values())


def test_a_busy_or_late_client_is_flagged() -> None:
    result = RequestResult(start=0.0, arrivals=[(0.1, 1), (0.2, 1)], end=0.2, success=True)
    arm = Arm("a", "http://x")
    calm = cell_summary(Cell(results=[result], wall_s=1.0, client_cpu_s=0.2, lag_ms=[1.0] * 100), arm, None, False)
    busy = cell_summary(Cell(results=[result], wall_s=1.0, client_cpu_s=0.95, lag_ms=[1.0]), arm, None, False)
    late = cell_summary(Cell(results=[result], wall_s=1.0, client_cpu_s=0.1, lag_ms=[50.0] * 10), arm, None, False)
    assert (calm["client_fell_behind"], busy["client_fell_behind"], late["client_fell_behind"]) == (False, True, True)
    assert calm["client_cpu_utilization"] == pytest.approx(0.2)
    assert calm["client_cpu_us_per_output_token"] == pytest.approx(0.2 / 2 * 1e6)


def test_cpu_per_token_counts_only_the_servers_an_arm_talks_to() -> None:
    result = RequestResult(start=0.0, arrivals=[(0.1, 4)], end=0.2, success=True)
    tier = Arm("t", "http://gen:1", endpoint="tier", derender_url="http://der:2")
    cell = Cell(results=[result], wall_s=1.0)
    cell.add_cpu({"http://gen:1": {"api": 0.004, "engine": 0.008}, "http://der:2": {"api": 0.004, "engine": 0.0},
                  "http://other:3": {"api": 1.0, "engine": 1.0}})
    s = cell_summary(cell, tier, None, True)
    assert s["api_cpu_us_per_output_token"] == pytest.approx(2000.0)
    assert s["engine_cpu_us_per_output_token"] == pytest.approx(2000.0)
    assert set(s["server_cpu_us_per_output_token"]) == {"http://gen:1", "http://der:2"}
    mixed = Arm("m", "http://gen:1", modes=("tokens", "text"))
    two = Cell(results=[RequestResult(start=0.0, arrivals=[(0.1, 2)], end=0.2, success=True, mode=m)
                        for m in ("tokens", "text")], wall_s=1.0)
    assert set(cell_summary(two, mixed, None, False)["by_mode"]) == {"tokens", "text"}


def test_scenario_results_must_complete_and_agree_on_token_totals() -> None:
    ok = {"cells": [{"label": "a", "load": "C=1", "failed": 0, "total_output_tokens": 10, "errors": []},
                    {"label": "b", "load": "C=1", "failed": 0, "total_output_tokens": 10, "errors": []}]}
    check_result(ok)
    drift = {"cells": [*ok["cells"][:1], {**ok["cells"][1], "total_output_tokens": 9}]}
    with pytest.raises(BenchError, match="different token totals"):
        check_result(drift)
    with pytest.raises(BenchError, match="requests failed"):
        check_result({"cells": [{**ok["cells"][0], "failed": 1}]})
    assert math.isinf(Load(1).request_rate)
