"""Server processes for the benchmarks (and the e2e tests): start, wait healthy, read CPU from ``/proc``.

Benchmarks ship with the package, so this module starts real ``pdserve`` processes itself and reads
their CPU from ``/proc``, which is the only way to charge a server's work to the arm that caused it
on a machine where client and servers share two cores.
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

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class BenchError(RuntimeError):
    """The benchmark cannot produce trustworthy numbers (server failure or wrong output)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stat_fields(stat_line: str) -> tuple[int, int]:
    """(ppid, utime+stime+cutime+cstime in clock ticks) from one ``/proc/<pid>/stat`` line.

    The command name may hold spaces or parentheses, so fields are counted from the last ``)``.
    """
    rest = stat_line[stat_line.rindex(")") + 2 :].split()
    # rest[0] is field 3 (state): ppid is field 4, utime..cstime are fields 14..17.
    return int(rest[1]), sum(int(v) for v in rest[11:15])


def process_tree_cpu_seconds(pid: int, proc_root: Path = Path("/proc")) -> float:
    """CPU seconds of ``pid`` and every live descendant (user + system, reaped children included).

    Summing ``cutime``/``cstime`` of each live process counts a finished child exactly once: in
    its parent after it was reaped, and never again since it is no longer listed.
    """
    ticks: dict[int, int] = {}
    children: dict[int, list[int]] = {}
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid, used = stat_fields((entry / "stat").read_text())
        except (OSError, ValueError, IndexError):
            continue  # exited while we looked
        ticks[int(entry.name)] = used
        children.setdefault(ppid, []).append(int(entry.name))
    if pid not in ticks:
        raise BenchError(f"process {pid} is gone; see its log")
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        total += ticks.get(current, 0)
        todo.extend(children.get(current, ()))
    return total / CLOCK_TICKS


class ServerProcess:
    """A ``python -m pdserve.cli ...`` child on a free loopback port, logging to a temp file."""

    def __init__(self, name: str, args: Sequence[str]):
        self.name = name
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

    def cpu_seconds(self) -> float:
        try:
            return process_tree_cpu_seconds(self.pid)
        except BenchError:
            raise BenchError(f"{self.name} server died:\n{self.log_tail()}") from None

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
