"""The run of ``pdserve bench frontend``: two real servers, every arm, rounds interleaved.

Only ratios measured in the same run survive a noisy shared host, so one run starts
both servers (a scripted generate server whose ``--step-ms`` pace stands in for the
GPU, and a ``launch render`` server for render/derender), warms every arm up, then
sweeps rounds → cells → arms with the arm order rotated, charging each arm the CPU
both servers spent while only that arm ran. Every record goes through the
:class:`~pdserve.bench.verify.Verifier` before its numbers count.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from pdserve.bench.loadgen import Arm, ArmClient, Job, rendered_jobs
from pdserve.bench.report import ArmSummary, ArmTotals, request_latency
from pdserve.bench.servers import BenchError, ServerProcess, start_all
from pdserve.bench.verify import Verifier
from pdserve.bench.workload import Script, build_scripts, chat_request
from pdserve.text.tokenizer import Tokenizer

PARSER_FLAGS = ("--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--enable-auto-tool-choice")
DERENDER_SERVER_ARGS = ("launch", "render", "--tokenizer", "qwen3", *PARSER_FLAGS)


@dataclass(frozen=True)
class Profile:
    """The knobs of one run; the defaults and ``--quick`` are two profiles."""

    lengths: tuple[int, ...]
    concurrency: tuple[int, ...]
    rounds: int
    step_ms: float
    scripts_per_length: int
    time_budget_s: float


# Sized for a 2-vCPU host: the chat-derender arm at N=1024, C=4 is CPU-bound and dominates the run.
DEFAULT_PROFILE = Profile(lengths=(256, 1024), concurrency=(1, 4), rounds=2, step_ms=5.0, scripts_per_length=4,
                          time_budget_s=150.0)
QUICK_PROFILE = Profile(lengths=(64,), concurrency=(1, 2), rounds=1, step_ms=2.0, scripts_per_length=2,
                        time_budget_s=30.0)


def generate_server_args(profile: Profile, script_file: str) -> list[str]:
    """``pdserve`` arguments of the generate server; the docs print these, so they cannot drift from the run."""
    return [
        "serve", "--engine", "scripted", "--tokenizer", "qwen3", "--script", script_file,
        "--tokens-per-step", "1", "--step-ms", f"{profile.step_ms:g}", *PARSER_FLAGS,
        "--max-num-seqs", str(max(64, *profile.concurrency)),
    ]


@dataclass(frozen=True)
class Cell:
    length: int
    concurrency: int

    @property
    def label(self) -> str:
        return f"N={self.length}, C={self.concurrency}"


@dataclass
class RunResult:
    profile: Profile
    scripts: list[Script]
    cells: dict[Cell, dict[Arm, ArmSummary]]
    rounds_done: int
    wall_s: float
    checked: int
    compared: int


class CpuMeter:
    """CPU seconds of the generate server, the derender server and this client, read together."""

    def __init__(self, generate: ServerProcess, derender: ServerProcess):
        self._generate = generate
        self._derender = derender

    def read(self) -> tuple[float, float, float]:
        return self._generate.cpu_seconds(), self._derender.cpu_seconds(), time.process_time()


async def run_arm(
    arm_client: ArmClient, meter: CpuMeter, arm: Arm, jobs: Sequence[Job], totals: ArmTotals, verifier: Verifier
) -> None:
    """``len(jobs)`` concurrent requests of one arm, charged the CPU both servers spent meanwhile.

    Arms never overlap, so a server's CPU between the two reads belongs to this arm alone.
    """
    before = meter.read()
    records = await asyncio.gather(*(arm_client.run(arm, job) for job in jobs))
    after = meter.read()
    totals.cpu_generate_s += after[0] - before[0]
    totals.cpu_derender_s += after[1] - before[1]
    totals.cpu_client_s += after[2] - before[2]
    for record in records:
        verifier.check(record)
        totals.latencies.append(request_latency(record.start, record.arrivals, record.end))
        totals.output_tokens += record.output_tokens


async def run_rounds(
    profile: Profile, arms: Sequence[Arm], jobs: Sequence[Job], scripts: Sequence[Script],
    generate: ServerProcess, derender: ServerProcess, verifier: Verifier, timeout_s: float,
) -> tuple[dict[Cell, dict[Arm, ArmTotals]], int]:
    """Rounds → cells → arms (order rotated), so drift and noise spread over every arm and cell.

    Rounds are the outer loop so that, when the time budget stops the run early, every
    cell has completed the same number of rounds. Round 1 always runs in full.
    """
    cells = [Cell(n, c) for n in profile.lengths for c in profile.concurrency]
    results = {cell: {arm: ArmTotals() for arm in arms} for cell in cells}
    by_length = {n: [j for j in jobs if scripts[j.script_index].length == n] for n in profile.lengths}
    meter = CpuMeter(generate, derender)
    limits = httpx.Limits(max_connections=2 * max(profile.concurrency) + 4, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=timeout_s) as client:
        arm_client = ArmClient(client, generate.url, derender.url)
        for arm in arms:  # first-request costs (connections, lazy imports) stay out of the numbers
            await run_arm(arm_client, meter, arm, by_length[min(profile.lengths)][:1], ArmTotals(), verifier)
        deadline = time.monotonic() + profile.time_budget_s
        rounds_done = 0
        for r in range(profile.rounds):
            if r and time.monotonic() > deadline:
                break
            for k, cell in enumerate(cells):
                pool = by_length[cell.length]
                batch = [pool[(r * cell.concurrency + w) % len(pool)] for w in range(cell.concurrency)]
                shift = (r + k) % len(arms)
                for arm in [*arms[shift:], *arms[:shift]]:
                    await run_arm(arm_client, meter, arm, batch, results[cell][arm], verifier)
            rounds_done += 1
    return results, rounds_done


def run(profile: Profile, arms: tuple[Arm, ...], seed: int, timeout_s: float) -> RunResult:
    """Start both servers, replay the workload through every arm, stop the servers."""
    started = time.monotonic()
    tokenizer = Tokenizer.load("qwen3")
    scripts = build_scripts(tokenizer, profile.lengths, profile.scripts_per_length, seed)
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-") as tmp:
        script_file = Path(tmp) / "scripts.jsonl"
        script_file.write_text("".join(json.dumps({"text": s.output}, ensure_ascii=False) + "\n" for s in scripts))
        generate = ServerProcess("generate", generate_server_args(profile, str(script_file)))
        derender = ServerProcess("derender", DERENDER_SERVER_ARGS)
        try:
            start_all([generate, derender])
            jobs = rendered_jobs(derender.url, [chat_request(s, i) for i, s in enumerate(scripts)])
            verifier = Verifier(tokenizer, scripts)
            totals, rounds_done = asyncio.run(
                run_rounds(profile, arms, jobs, scripts, generate, derender, verifier, timeout_s)
            )
        except httpx.HTTPError as e:
            raise BenchError(f"HTTP failure ({e!r}); generate server log:\n{generate.log_tail()}\n"
                             f"derender server log:\n{derender.log_tail()}") from e
        finally:
            generate.stop()
            derender.stop()
    cells = {cell: {arm: t.summary() for arm, t in by_arm.items()} for cell, by_arm in totals.items()}
    return RunResult(profile, scripts, cells, rounds_done, time.monotonic() - started, verifier.checked,
                     verifier.compared)
