"""A ``pdserve up`` child for tests: its output as it comes, its members once it is ready, a clean stop."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

from tests.serverproc import PORT_ATTEMPTS
from tests.waiting import wait_until

MEMBER_LINE = re.compile(r"^  (render|prefill-\d+|decode-\d+|proxy)\s+(http://\S+)\s+pid (\d+)$", re.MULTILINE)


class Up:
    """A running ``pdserve up``: its output so far, its members (name -> (url, pid)) once ready."""

    def __init__(self, *args: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", "up", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, bound_s: float = 240) -> str:
        found = wait_until(lambda: re.search(r"OpenAI base URL: (\S+)", self.output) or self.proc.poll() is not None,
                           lambda: f"pdserve up is ready; its output:\n{self.output}", bound_s=bound_s)
        assert found is not True and self.proc.poll() is None, self.output
        return found.group(1)  # type: ignore[union-attr]

    @property
    def members(self) -> dict[str, tuple[str, int]]:
        return {name: (url, int(pid)) for name, url, pid in MEMBER_LINE.findall(self.output)}

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: the test's children only
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def start_up(*args: str) -> tuple[Up, str]:
    """A ready ``pdserve up``, started again (on other free ports) when a member lost its port: with
    ``--port 0`` it picks each member's free port, and the member binds it seconds later, so another
    process on the host may take it in between (tests/serverproc.py, PORT_ATTEMPTS)."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        topology = Up(*args)
        try:
            return topology, topology.wait_ready()
        except AssertionError:
            topology.stop()
            if attempt == PORT_ATTEMPTS or "address already in use" not in topology.output.lower():
                raise
    raise AssertionError("unreachable")


def alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"
