"""Server processes for the benchmark scenarios (and the e2e tests): start, wait healthy, stop.

Benchmarks ship with the package, so the scenarios start real ``pdserve`` processes themselves;
their CPU is read from outside, like any server's (:mod:`pdserve.bench.cpu`).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx


class BenchError(RuntimeError):
    """The benchmark cannot produce trustworthy numbers (server failure or wrong output)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """A ``python -m pdserve.cli ...`` child on a free loopback port, logging to a temp file."""

    def __init__(self, name: str, args: Sequence[str]):
        self.name = name
        self.args = list(args)  # what follows ``pdserve`` (host and port are added per run)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._cmd = [sys.executable, "-m", "pdserve.cli", *args, "--host", "127.0.0.1", "--port", str(self.port)]
        fd, log = tempfile.mkstemp(prefix=f"pdserve-bench-{name}-", suffix=".log")
        os.close(fd)
        self._log = Path(log)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise BenchError(f"{self.name} server was not started")
        return self.proc.pid

    def spawn(self) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with self._log.open("wb") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(self._cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise BenchError(f"{self.name} server exited at startup:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise BenchError(f"{self.name} server not healthy after {timeout_s:.0f}s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        return self._log.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.unlink(missing_ok=True)


def start_all(servers: Sequence[ServerProcess], timeout_s: float = 120.0) -> None:
    """Spawn every server first, then wait: their imports and tokenizer loads overlap."""
    for server in servers:
        server.spawn()
    for server in servers:
        server.wait_healthy(timeout_s)
