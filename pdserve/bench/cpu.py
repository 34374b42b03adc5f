"""Server and client CPU for ``pdserve bench serve`` (psutil): what each output token costs whom.

A server is a process tree. Its *API* processes are the ones that listen on the server's TCP port
(uvicorn frontends; vLLM's API servers); every other process of the tree is counted as *engine*
(pdserve's or vLLM's engine core; an idle supervisor or resource tracker adds ~nothing). That rule
needs nothing pdserve-specific from the other side, so the same run measures any server on this host.
The tree's root is the one listener, or the common parent of several (``--api-server-count N``).

CPU per process is user + system plus its reaped children's, so a child that exited is counted
once, through its parent. An idle window measured before the run gives each role's background
rate (heartbeats, pollers), which is subtracted from every measured window.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import psutil

from pdserve.bench.metrics import SERVER_ROLES as ROLES
from pdserve.bench.servers import BenchError


def _seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system + t.children_user + t.children_system


def listeners(port: int) -> list[int]:
    """Pids listening on TCP ``port`` (every local address)."""
    pids = {c.pid for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid}
    return sorted(pids)


def server_root(url: str) -> int:
    """The root pid of the server behind a loopback ``url``; BenchError if nothing local listens."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    pids = listeners(port)
    if not pids:
        raise BenchError(f"no local process listens on port {port} ({url}); pass --server-pid or drop --server-cpu")
    if len(pids) == 1:
        return pids[0]
    parents = {psutil.Process(p).ppid() for p in pids}
    if len(parents) != 1:
        raise BenchError(f"several unrelated processes listen on port {port}: {pids}; pass --server-pid")
    return parents.pop()


@dataclass
class ServerCpu:
    """CPU seconds of one server tree, split into API and engine processes, read on demand."""

    root: int
    port: int
    label: str = ""

    def read(self) -> dict[str, float]:
        try:
            root = psutil.Process(self.root)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            raise BenchError(f"server {self.label or self.root} (pid {self.root}) is gone") from None
        api = set(listeners(self.port))
        used = dict.fromkeys(ROLES, 0.0)
        for proc in procs:
            try:
                used["api" if proc.pid in api else "engine"] += _seconds(proc)
            except psutil.NoSuchProcess:
                continue  # exited meanwhile: its parent counts it once reaped
        return used


@dataclass
class Window:
    """CPU spent in one measured window, per server and role, and by this client."""

    wall_s: float
    servers: dict[str, dict[str, float]]
    client_s: float


# A server whose CPU rate is within this much of its idle rate (CPU seconds per second: 15% of a core) is
# quiet. /proc counts in 10 ms ticks, so a 0.2 s step cannot tell much less; a busy-waiting worker uses a
# whole core.
QUIET_CPU = 0.15


@dataclass
class CpuMeter:
    """Reads every server and this client together; knows each role's idle rate."""

    servers: dict[str, ServerCpu]
    idle_rate: dict[str, dict[str, float]] = field(default_factory=dict)  # server -> role -> CPU s per s

    def snapshot(self) -> tuple[float, dict[str, dict[str, float]], float]:
        return time.perf_counter(), {k: s.read() for k, s in self.servers.items()}, time.process_time()

    def since(self, before: tuple[float, dict[str, dict[str, float]], float]) -> Window:
        """The window from ``before`` to now, the idle rate already subtracted (never below zero)."""
        t0, s0, c0 = before
        t1, s1, c1 = self.snapshot()
        wall = t1 - t0
        servers = {
            name: {role: max(0.0, s1[name][role] - s0[name][role] - self.idle_rate.get(name, {}).get(role, 0.0) * wall)
                   for role in ROLES}
            for name in s1
        }
        return Window(wall, servers, c1 - c0)

    def measure_idle(self, seconds: float, max_windows: int = 10) -> None:
        """Each role's background rate while no request runs (call before the first request).

        Windows of ``seconds`` follow each other until a server's rate stops falling: some servers
        busy-wait for a while after their last request (vLLM-CPU's worker polls its shared-memory
        queue for about a second), and that is part of a request's cost, not background. Each role's
        rate is its lowest over the windows."""
        if not self.servers or seconds <= 0:
            return
        self.idle_rate = {}
        lowest: dict[str, dict[str, float]] = {}
        for _ in range(max_windows):
            before = self.snapshot()
            time.sleep(seconds)
            window = self.since(before)
            rates = {name: {role: v / window.wall_s for role, v in roles.items()}
                     for name, roles in window.servers.items()}
            # Settled: no server's rate fell by more than noise since the lowest before it.
            settled = bool(lowest) and all(sum(rates[n].values()) >= sum(lowest[n].values()) - QUIET_CPU
                                           for n in rates)
            lowest = {n: {r: min(v, lowest.get(n, {}).get(r, v)) for r, v in roles.items()}
                      for n, roles in rates.items()}
            if settled:
                break
        self.idle_rate = lowest

    def settle(self, max_s: float = 5.0, step_s: float = 0.2) -> None:
        """Wait until every server is back at its idle rate (at most ``max_s``), so that what a server
        spends after an arm's last answer (a busy-wait, a deferred free) is charged to that arm and does
        not run into the next one."""
        deadline = time.perf_counter() + max_s
        while time.perf_counter() < deadline:
            before = self.snapshot()
            time.sleep(step_s)
            window = self.since(before)  # above the idle rate only
            if all(sum(roles.values()) / window.wall_s <= QUIET_CPU for roles in window.servers.values()):
                return


def meter_for(urls: Sequence[str], pids: Sequence[int] | None) -> CpuMeter:
    """A meter over the servers behind ``urls`` (distinct; ``pids``: their roots, in the same order)."""
    servers: dict[str, ServerCpu] = {}
    for i, url in enumerate(urls):
        parts = urlsplit(url)
        port = parts.port or 80
        root = pids[i] if pids else server_root(url)
        servers[url] = ServerCpu(root, port, url)
    return CpuMeter(servers)
