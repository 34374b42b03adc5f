"""50,000 mixed generate requests at concurrency 256, streamed and batch, every answer checked against its
script, while another process keeps every CPU of this machine busy: 0 errors (issue 26). Its figures go
to docs/reliability.md; ``make soak`` prints them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from pdserve.text.tokenizer import Tokenizer
from tests.mixed_load import SCRIPTS, run_mixed_load, write_scripts
from tests.serverproc import ServerProcess

TOTAL, CONCURRENCY = 50_000, 256

# One spinning process per CPU this test may use: the cores are never idle, so the server, its engine
# and the client run as they would on a machine shared with other work.
BUSY = """
import multiprocessing, os
def spin():
    while True:
        pass
for _ in range(len(os.sched_getaffinity(0))):
    multiprocessing.Process(target=spin, daemon=True).start()
multiprocessing.Event().wait()
"""


@pytest.fixture
def competitor() -> Iterator[psutil.Process]:
    proc = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        yield psutil.Process(proc.pid)
    finally:
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()
        proc.wait()


def cpu_seconds(proc: psutil.Process) -> float:
    """User + system CPU of ``proc`` and its children so far."""
    total = 0.0
    for p in (proc, *proc.children(recursive=True)):
        times = p.cpu_times()
        total += times.user + times.system
    return total


@pytest.mark.timeout(3600)
def test_soak_every_answer_matches_its_script_under_a_busy_machine(tmp_path: Path,
                                                                    competitor: psutil.Process) -> None:
    tok = Tokenizer.load("qwen3")
    scripts = write_scripts(tmp_path / "scripts.jsonl")
    with ServerProcess("serve", "--engine", "scripted", "--tokenizer", "qwen3", "--script", str(scripts),
                       "--reasoning-parser", "qwen3", "--max-num-seqs", str(CONCURRENCY)) as srv:
        busy_before, started = cpu_seconds(competitor), time.monotonic()

        def progress(done: int) -> None:
            if done % 5000 == 0:
                print(f"soak: {done}/{TOTAL} answered in {time.monotonic() - started:.0f} s", file=sys.stderr)

        result = run_mixed_load(srv.url, TOTAL, CONCURRENCY, [tok.encode(s["text"]) for s in SCRIPTS], progress)
        busy_cores = (cpu_seconds(competitor) - busy_before) / (time.monotonic() - started)
        print(f"soak: {result.summary()}; the competitor kept {busy_cores:.2f} of "
              f"{len(os.sched_getaffinity(0))} CPUs busy meanwhile")
        assert result.done == TOTAL
        assert not result.failures, f"{len(result.failures)} of {TOTAL} failed; first: {result.failures[:3]}"
        assert busy_cores > 0.5  # the machine really was shared (each of its spinners takes what it can get)
        assert srv.metric("pdserve_live_request_states") == 0
        metrics = httpx.get(srv.url + "/metrics", timeout=30).text
        server_errors = [line for line in metrics.splitlines() if line.startswith("pdserve_server_errors_total{")]
        assert all(float(line.rsplit(" ", 1)[1]) == 0 for line in server_errors), server_errors
