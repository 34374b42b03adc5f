"""One member of a local topology: a ``pdserve`` child process in its own process group.

Own process group, so stopping a member stops everything it started (a server's engine-core
process too) and nothing outlives ``pdserve up``. Output goes to a log file per member, whose tail
is shown when the member fails to start.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

STOP_GRACE_S = 10.0


@dataclass(frozen=True)
class MemberSpec:
    """What to start: a name (``prefill-0``), its role, the ``pdserve`` arguments and its port."""

    name: str
    role: str  # render | prefill | decode | proxy
    args: tuple[str, ...]
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class MemberProcess:
    def __init__(self, spec: MemberSpec, log_dir: Path):
        self.spec = spec
        self.log_path = log_dir / f"{spec.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.exit_reported = False

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.name} was not started"
        return self.proc.pid

    def spawn(self) -> None:
        cmd = [sys.executable, "-m", "pdserve.cli", *self.spec.args]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with self.log_path.open("wb") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def exit_code(self) -> int | None:
        """None while it runs."""
        return None if self.proc is None else self.proc.poll()

    def is_healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def signal_group(self, sig: signal.Signals) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def wait_stopped(self, deadline: float) -> None:
        """Wait for the group leader until ``deadline``, then kill the whole group."""
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        self.signal_group(signal.SIGKILL)  # whatever the leader left behind goes too
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)


def stop_all(members: list[MemberProcess], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM every group at once (they shut down in parallel), then SIGKILL what is left."""
    for member in members:
        member.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for member in members:
        member.wait_stopped(deadline)
