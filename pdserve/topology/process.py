"""One ``pdserve`` child process: the launcher that ``pdserve up``, the benchmark scenarios and the e2e
tests all use.

A :class:`ServerProcess` runs ``python -m pdserve.cli ARGS`` in its own process group (so stopping it
stops everything it started, a server's engine-core process too, and nothing outlives its owner),
logging to a file whose tail is shown when it fails to start. By default it listens on a free
loopback port (``--host 127.0.0.1 --port N`` added to its arguments); a caller that plans its own
ports passes them in the arguments and ``address=False``.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

STOP_GRACE_S = 10.0
LOOPBACK = "127.0.0.1"


class ServerFailed(RuntimeError):
    """A server exited while starting, or did not become healthy in time (the message has its log tail)."""


# Where free_port looks: from here up to the kernel's ephemeral range.
FREE_PORT_FLOOR = 15000
_handed_out: set[int] = set()


def _ephemeral_floor() -> int:
    """The lowest port the kernel hands out by itself (``net.ipv4.ip_local_port_range``; 32768 by default)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback port free right now, below the kernel's ephemeral range, and not handed out before by this
    process. The kernel takes the local ports of outgoing connections and of binds to port 0 from that range
    by itself, so a port picked there (as a bind to port 0 picks) could be taken by any connection before the
    child binds it: a vLLM server's NIXL side channel, given such a port, found it in use and hung at start.
    Below the range only another explicit bind can take it."""
    ceiling = _ephemeral_floor()
    for _ in range(200):
        port = random.randrange(FREE_PORT_FLOOR, ceiling) if ceiling > FREE_PORT_FLOOR + 1000 else 0
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((LOOPBACK, port))
            except OSError:
                continue
            port = int(s.getsockname()[1])
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free loopback port between {FREE_PORT_FLOOR} and {ceiling}")


class ServerProcess:
    """A ``pdserve ARGS`` child in its own process group.

    ``args``: what follows ``pdserve``. With ``address=True`` (the default) the child gets
    ``--host 127.0.0.1 --port PORT`` appended (``port`` defaults to a free one); with ``address=False``
    the arguments already say where it listens and ``port`` must be given. ``log_path``: where its output
    goes; by default a temporary file, removed by :meth:`stop`.
    """

    def __init__(self, name: str, args: Sequence[str], *, port: int | None = None, address: bool = True,
                 log_path: Path | None = None) -> None:
        if not address and port is None:
            raise ValueError("address=False: the port the arguments name must be given")
        self.name = name
        self.args = list(args)
        self.port = port if port is not None else free_port()
        self.url = f"http://{LOOPBACK}:{self.port}"
        self._address = address
        self._cmd = [sys.executable, "-m", "pdserve.cli", *self.args]
        if address:
            self._cmd += ["--host", LOOPBACK, "--port", str(self.port)]
        self._temp_log = log_path is None
        if log_path is None:
            fd, temp = tempfile.mkstemp(prefix=f"pdserve-{name}-", suffix=".log")
            os.close(fd)
            log_path = Path(temp)
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise ServerFailed(f"{self.name} server was not started")
        return self.proc.pid

    def use_port(self, port: int) -> None:
        """Listen on ``port`` from the next :meth:`spawn` on."""
        if not self._address:
            raise ValueError(f"{self.name}: its arguments name its port")
        self.port, self.url, self._cmd[-1] = port, f"http://{LOOPBACK}:{port}", str(port)

    def spawn(self) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with self.log_path.open("wb") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(self._cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)

    def exit_code(self) -> int | None:
        """None while it runs (or before it was started)."""
        return None if self.proc is None else self.proc.poll()

    def is_healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_healthy(self, timeout_s: float) -> None:
        """Until ``/health`` answers 200; :class:`ServerFailed` (with the log tail) if it exits first or
        ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise ServerFailed(f"{self.name} server exited at startup:\n{self.log_tail()}")
            if self.is_healthy():
                return
            time.sleep(0.1)
        raise ServerFailed(f"{self.name} server not healthy after {timeout_s:.0f}s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
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
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        self.signal_group(signal.SIGKILL)  # whatever the leader left behind goes too
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the server (it stops what it started), SIGKILL its group after ``grace_s``; a temporary
        log goes too."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
        self.wait_stopped(time.monotonic() + grace_s)
        if self._temp_log:
            self.log_path.unlink(missing_ok=True)


def start_all(servers: Sequence[ServerProcess], timeout_s: float = 120.0) -> None:
    """Spawn every server first, then wait: their imports and tokenizer loads overlap."""
    for server in servers:
        server.spawn()
    for server in servers:
        server.wait_healthy(timeout_s)


def stop_all(servers: Sequence[ServerProcess], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM every group at once (they shut down in parallel), then SIGKILL what is left."""
    for server in servers:
        server.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for server in servers:
        server.wait_stopped(deadline)
