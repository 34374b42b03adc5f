"""Real ``pdserve`` processes on loopback for e2e tests (pdserve.topology.process's launcher, plus test niceties)."""

from __future__ import annotations

import re
import time

import httpx
import psutil

from pdserve.bench.cpu import listeners
from pdserve.topology.process import ServerFailed, free_port
from pdserve.topology.process import ServerProcess as _Launcher

# How many ports a server start tries. The launcher picks a free port, closes it, and the child binds
# it seconds later (after its imports): in between any other process on the host (another test run,
# a NIXL/UCX or ZMQ socket, an outgoing connection) may take it. A start that lost its port is retried
# on a fresh one; losing it three times in a row would mean something else is wrong.
PORT_ATTEMPTS = 3


class ServerProcess(_Launcher):
    """``ServerProcess(*cli_args)`` started by ``with`` (or ``start()``); ``url`` once healthy.

    ``wait_healthy`` (and so ``start()`` and ``pdserve.topology.process.start_all``) makes sure the
    answering server is this child (it holds the listening socket), and restarts the child on a fresh
    port when it lost its port to another process (see :data:`PORT_ATTEMPTS`): read ``url`` and
    ``port`` after the server is healthy, not before.
    """

    def __init__(self, *args: str, api_key: str | None = None, startup_timeout: float = 120.0):
        self.api_key = api_key
        super().__init__("test", [*args, *(["--api-key", api_key] if api_key else [])])
        self._timeout = startup_timeout

    def start(self) -> ServerProcess:
        self.spawn()
        try:
            self.wait_healthy(self._timeout)
        except Exception:
            self.stop()
            raise
        return self

    def wait_healthy(self, timeout_s: float) -> None:
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                super().wait_healthy(timeout_s)
                self._wait_until_it_holds_its_port(timeout_s)
                return
            except ServerFailed:
                if attempt == PORT_ATTEMPTS or not self._lost_its_port():
                    raise
            self.stop()
            self.use_port(free_port())
            self.spawn()

    def _lost_its_port(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None and "address already in use" in self.log().lower()

    def _wait_until_it_holds_its_port(self, timeout_s: float) -> None:
        """A 200 from /health may come from another process that took the port; this child then exits
        (address in use) once its imports are done. Healthy means: the child, or a process it started,
        holds the listening socket."""
        deadline = time.monotonic() + timeout_s
        while not self._holds_its_port():
            if self.proc is not None and self.proc.poll() is not None:
                raise ServerFailed(f"{self.name} server exited at startup:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise ServerFailed(f"{self.name} server: another process answers on port {self.port}")
            time.sleep(0.1)

    def _holds_its_port(self) -> bool:
        """Whether the child or a process it started listens on the port (``--api-server-count N``: the
        frontends listen, not the parent)."""
        try:
            tree = {self.pid, *(p.pid for p in psutil.Process(self.pid).children(recursive=True))}
        except psutil.NoSuchProcess:
            return False
        return not tree.isdisjoint(listeners(self.port))

    def log(self) -> str:
        return self.log_tail(100_000)

    def run_to_exit(self, timeout_s: float) -> tuple[int, str]:
        """Start a server that is expected to stop by itself (a refusal at start): its exit code and output."""
        self.spawn()
        try:
            assert self.proc is not None
            code = self.proc.wait(timeout=timeout_s)
            return code, self.log()
        finally:
            self.stop()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def metric(self, name: str, missing: float | None = None, via: httpx.Client | None = None) -> float:
        """The value of one ``/metrics`` sample, ``name`` written as exposed (labels included).

        A labelled counter has no sample until it is first counted: pass ``missing=0`` for it,
        so that a misspelt name still fails everywhere else. ``via``: ask over that client's
        open connection (with several frontends, that is how to ask one particular process).
        """
        url = self.url + "/metrics"
        if via is None:
            text = httpx.get(url, headers=self.headers, timeout=10).text
        else:
            text = via.get(url, headers=self.headers, timeout=10).text
        found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
        if found is None and missing is not None:
            return missing
        assert found, f"{name} missing from /metrics"
        return float(found.group(1))

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def metric_sum(url: str, name: str, labels: str = "", missing: float | None = None) -> float:
    """The sum of the ``/metrics`` samples named ``name`` whose labels contain ``labels`` (vLLM labels every
    sample with its engine and model; a pdserve counter has one unlabelled sample). A missing name fails,
    unless ``missing`` says what it counts as (a labelled counter has no sample before its first count)."""
    return samples_sum(httpx.get(url + "/metrics", timeout=10).text, name, labels, missing, where=url)


def samples_sum(text: str, name: str, labels: str = "", missing: float | None = None, where: str = "") -> float:
    """:func:`metric_sum` over a ``/metrics`` text already read (``where``: whose, for the failure message)."""
    found = re.findall(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE)
    if not found and missing is not None:
        return missing
    assert found, f"{name} missing from {where}/metrics"
    return sum(float(value) for label, value in found if labels in (label or ""))
