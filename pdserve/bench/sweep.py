"""The schedule of ``pdserve bench serve``: warm-up, idle window, then rounds → loads → arms.

Arms never overlap: each runs its batch of requests alone, so the CPU every server spent between
two reads belongs to that arm. Within a round the arm order rotates by round and load, so drift
and noise from a shared machine hit every arm alike. A load is a concurrency cap and a request
rate (Poisson arrivals, or all at once), as in ``vllm bench serve``.

While an arm runs, a probe task measures how late the client's event loop wakes up; with the
client's CPU use it tells whether the client itself fell behind (then the latencies measure the
client, and the result says so instead of passing them off as the server's).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from pdserve.bench.loadgen import Arm, ArmClient, Prompt
from pdserve.bench.metrics import SERVER_ROLES as ROLES
from pdserve.bench.metrics import RequestResult, summarize
from pdserve.bench.report import percentile
from pdserve.bench.servers import BenchError

# A client is reported as falling behind above either bound (one asyncio thread does all its work).
if TYPE_CHECKING:  # psutil loads only when server CPU is read
    from pdserve.bench.cpu import CpuMeter

CLIENT_CPU_LIMIT = 0.9  # of one core over the arm's window
CLIENT_LAG_LIMIT_MS = 20.0  # p99 lateness of a 5 ms timer
PROBE_S = 0.005


@dataclass(frozen=True)
class Load:
    """``concurrency`` None: no cap; ``request_rate`` inf: every request at once."""

    concurrency: int | None
    request_rate: float = math.inf

    @property
    def label(self) -> str:
        c = "∞" if self.concurrency is None else str(self.concurrency)
        rate = "" if math.isinf(self.request_rate) else f", {self.request_rate:g} req/s"
        return f"C={c}{rate}"


@dataclass(frozen=True)
class Schedule:
    num_prompts: int
    rounds: int = 1
    num_warmups: int = 1
    duration_s: float | None = None  # per arm batch: issue no new request after this
    idle_window_s: float = 1.0
    seed: int = 0
    timeout_s: float = 600.0


@dataclass
class Cell:
    """One (load, arm) accumulated over every round."""

    results: list[RequestResult] = field(default_factory=list)
    wall_s: float = 0.0
    server_cpu_s: dict[str, dict[str, float]] = field(default_factory=dict)  # url -> role -> s
    client_cpu_s: float = 0.0
    lag_ms: list[float] = field(default_factory=list)

    def add_cpu(self, servers: dict[str, dict[str, float]]) -> None:
        for url, roles in servers.items():
            mine = self.server_cpu_s.setdefault(url, dict.fromkeys(ROLES, 0.0))
            for role, seconds in roles.items():
                mine[role] += seconds


def cell_summary(cell: Cell, arm: Arm, slo: dict[str, float] | None, metered: bool) -> dict[str, Any]:
    """vLLM's fields for one cell, plus CPU per output token (µs) and the client's health."""
    out = summarize(cell.results, cell.wall_s, slo)
    tokens = out["total_output_tokens"]
    per_token = (lambda s: s / tokens * 1e6) if tokens else (lambda s: math.nan)
    if metered:
        mine = {url: roles for url, roles in cell.server_cpu_s.items() if url in arm.urls}
        out["server_cpu_us_per_output_token"] = {url: {r: per_token(s) for r, s in roles.items()}
                                                 for url, roles in mine.items()}
        for role in ROLES:
            out[f"{role}_cpu_us_per_output_token"] = per_token(sum(r[role] for r in mine.values()))
    out["client_cpu_us_per_output_token"] = per_token(cell.client_cpu_s)
    util = cell.client_cpu_s / cell.wall_s if cell.wall_s > 0 else math.nan
    lag = percentile(cell.lag_ms, 99)
    out["client_cpu_utilization"] = util
    out["client_loop_lag_p99_ms"] = lag
    out["client_fell_behind"] = bool(util > CLIENT_CPU_LIMIT or lag > CLIENT_LAG_LIMIT_MS)
    gaps = [g * 1000 for r in cell.results if r.success for g in r.itl]
    out["itl_cdf_ms"] = [percentile(gaps, q) for q in range(101)] if gaps else []
    out["errors"] = sorted({r.error for r in cell.results if r.error})[:5]
    modes = sorted({r.mode for r in cell.results})
    if len(modes) > 1:  # a mixed arm: each mode's latencies on their own
        out["by_mode"] = {m: summarize([r for r in cell.results if r.mode == m], cell.wall_s) for m in modes}
    return out


async def _lag_probe(samples: list[float]) -> None:
    while True:
        t = time.perf_counter()
        await asyncio.sleep(PROBE_S)
        samples.append(max(0.0, (time.perf_counter() - t - PROBE_S) * 1000))


async def run_batch(client: ArmClient, arm: Arm, prompts: Sequence[Prompt], load: Load, schedule: Schedule,
                    rng: random.Random, on_done: Callable[[], None]) -> list[RequestResult]:
    """``prompts`` through one arm under ``load``: Poisson gaps (or none), at most C in flight."""
    gate = asyncio.Semaphore(load.concurrency) if load.concurrency else None
    deadline = None if schedule.duration_s is None else time.perf_counter() + schedule.duration_s

    async def one(i: int, prompt: Prompt) -> RequestResult:
        try:
            return await client.run(arm, prompt, i)
        finally:
            if gate is not None:
                gate.release()
            on_done()

    tasks = []
    for i, prompt in enumerate(prompts):
        if i and not math.isinf(load.request_rate):
            await asyncio.sleep(rng.expovariate(load.request_rate))
        if i and deadline is not None and time.perf_counter() > deadline:
            break  # the first request always goes, so every cell has a measurement
        if gate is not None:
            await gate.acquire()
        tasks.append(asyncio.ensure_future(one(i, prompt)))
    return list(await asyncio.gather(*tasks))


class Progress:
    """A tqdm bar over every request of the run (stderr), named after the arm and load running."""

    def __init__(self, total: int, enabled: bool):
        from tqdm import tqdm

        self._bar = tqdm(total=total, unit="req", disable=not enabled, dynamic_ncols=True, leave=True)

    def step(self) -> None:
        self._bar.update(1)

    def describe(self, text: str) -> None:
        self._bar.set_description(text, refresh=True)

    def close(self) -> None:
        self._bar.close()


async def run_schedule(arms: Sequence[Arm], loads: Sequence[Load], prompts: Sequence[Prompt], schedule: Schedule,
                       meter: CpuMeter | None, progress: bool = True) -> dict[tuple[Load, str], Cell]:
    """Every arm under every load for ``schedule.rounds`` rounds; cells keyed by (load, arm label)."""
    if not prompts:
        raise BenchError("the workload has no prompts")
    labels = [a.label for a in arms]
    if len(set(labels)) != len(labels):
        raise BenchError(f"arm labels must be distinct: {labels}")
    cells = {(load, arm.label): Cell() for load in loads for arm in arms}
    biggest = max((load.concurrency or schedule.num_prompts) for load in loads)
    limits = httpx.Limits(max_connections=2 * biggest + 8, max_keepalive_connections=None)
    total = len(arms) * (schedule.num_warmups + len(loads) * schedule.rounds * schedule.num_prompts)
    bar = Progress(total, progress)
    try:
        async with httpx.AsyncClient(limits=limits, timeout=schedule.timeout_s) as http:
            client = ArmClient(http)
            for arm in arms:  # connections, lazy imports and first-request costs stay out of the numbers
                bar.describe(f"warm-up {arm.label}")
                warm = [prompts[i % len(prompts)] for i in range(schedule.num_warmups)]
                for result in await run_batch(client, arm, warm, Load(1), schedule, random.Random(0), bar.step):
                    if not result.success:
                        raise BenchError(f"warm-up of {arm.label} failed: {result.error}")
            if meter is not None:
                bar.describe(f"idle window {schedule.idle_window_s:g} s")
                await asyncio.to_thread(meter.measure_idle, schedule.idle_window_s)
            for r in range(schedule.rounds):
                for k, load in enumerate(loads):
                    batch = [prompts[(r * schedule.num_prompts + i) % len(prompts)]
                             for i in range(schedule.num_prompts)]
                    shift = (r + k) % len(arms)
                    for arm in [*arms[shift:], *arms[:shift]]:
                        bar.describe(f"round {r + 1}/{schedule.rounds} {load.label} {arm.label}")
                        # Every arm of a round and load gets the same Poisson arrival times.
                        rng = random.Random(f"{schedule.seed}-{r}-{k}")
                        await _measured(client, arm, batch, load, schedule, rng, meter, cells[(load, arm.label)],
                                        bar.step)
    finally:
        bar.close()
    return cells


async def _measured(client: ArmClient, arm: Arm, batch: Sequence[Prompt], load: Load, schedule: Schedule,
                    rng: random.Random, meter: CpuMeter | None, cell: Cell, on_done: Callable[[], None]) -> None:
    lag: list[float] = []
    probe = asyncio.ensure_future(_lag_probe(lag))
    before = meter.snapshot() if meter is not None else None
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        results = await run_batch(client, arm, batch, load, schedule, rng, on_done)
    finally:
        probe.cancel()
    cell.wall_s += time.perf_counter() - t0
    cell.client_cpu_s += time.process_time() - c0
    if meter is not None and before is not None:
        await asyncio.to_thread(meter.settle)  # a server's tail of work is this arm's
        cell.add_cpu(meter.since(before).servers)
    cell.results += results
    cell.lag_ms += lag
