"""A fake fleet for ``pdserve top``: real HTTP servers on loopback serving the /metrics pages of a proxy and
its members, built with the real metric classes (the proxy's ProxyMetrics, a server's Metrics fed engine
and KV stats), so a renamed series breaks these tests, not an operator's screen. Tests change the figures
between scrapes."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from pdserve.protocol.engine import EngineStats
from pdserve.protocol.kv import KVStats
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.serve.metrics import Metrics
from pdserve.top.view import TPOT, TTFT
from tests.loopback import LoopbackServer, reply


class MetricsServer(LoopbackServer):
    """GET /metrics answers ``page()``; anything else 404."""

    def __init__(self, page: Callable[[], str]) -> None:
        self.page = page

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's spelling)
                if self.path != "/metrics":
                    self.send_error(404)
                    return
                reply(self, 200, page().encode(), "text/plain; version=0.0.4")

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(Handler)


class FakeMember:
    """A pdserve server's page: engine and KV stats through serve.metrics, plus TTFT/TPOT histograms."""

    def __init__(self, engine: bool = True) -> None:
        self.stats = EngineStats(kv=KVStats(slots=32, free_slots=32))
        self.metrics = Metrics(engine_stats=(lambda: self.stats) if engine else None)
        self.latency = CollectorRegistry()
        self.ttft = Histogram(TTFT[0], "time to first token", registry=self.latency)
        self.tpot = Histogram(TPOT[0], "time per output token", registry=self.latency)
        self.server = MetricsServer(self.page)
        self.url = self.server.url

    def page(self) -> str:
        return (generate_latest(self.metrics.registry) + generate_latest(self.latency)).decode()

    def pull(self, n: int, seconds: float, nbytes: int) -> None:
        kv = self.stats.kv
        assert kv is not None
        for _ in range(n):
            kv.pulls_ok += 1
            kv.pulled_bytes += nbytes
            kv.observe_pull(seconds)


class FakeProxy:
    """The proxy's page: members registered as the proxy does (healthy, in flight), errors by cause."""

    def __init__(self) -> None:
        self.metrics = ProxyMetrics()
        self.server = MetricsServer(lambda: generate_latest(self.metrics.registry).decode())
        self.url = self.server.url

    def add(self, pool: str, url: str, healthy: bool = True, in_flight: int = 0) -> None:
        self.metrics.member_healthy.labels(pool, url).set(1 if healthy else 0)
        self.metrics.member_in_flight.labels(pool, url).set(in_flight)


def dead_url() -> str:
    """A loopback port nothing listens on: connection refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@contextmanager
def silent_url() -> Iterator[str]:
    """A port that accepts connections (the kernel's backlog) and never answers: a scrape times out."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


class Fleet:
    """A proxy with a render, a prefill, two decode members and a dead decode member."""

    def __init__(self) -> None:
        self.proxy = FakeProxy()
        self.render = FakeMember(engine=False)
        self.prefill = FakeMember()
        self.decode = FakeMember()
        self.decode2 = FakeMember()
        self.dead = dead_url()
        self.proxy.add("render", self.render.url)
        self.proxy.add("prefill", self.prefill.url, in_flight=1)
        self.proxy.add("decode", self.decode.url, in_flight=2)
        self.proxy.add("decode", self.decode2.url)
        self.proxy.add("decode", self.dead, healthy=False)
        self.proxy.metrics.member_errors.labels("decode", self.dead, "unreachable").inc(3)
        # History before top starts: slow, so a p50 since start and one over the interval differ.
        for _ in range(100):
            self.prefill.ttft.observe(2.0)
            self.decode.tpot.observe(0.5)
        self.decode.pull(20, 0.2, 1 << 20)
        for _ in range(40):
            self.proxy.metrics.requests.labels("chat", "inline", "200").inc()
            self.proxy.metrics.leg_seconds.labels("decode").observe(3.0)
        self.proxy.metrics.requests.labels("chat", "inline", "502").inc()

    def traffic(self) -> None:
        """One interval's work: fast requests, KV pulls, a migration, an error."""
        for _ in range(10):
            self.prefill.ttft.observe(0.15)
            self.decode.tpot.observe(0.02)
            self.proxy.metrics.requests.labels("chat", "inline", "200").inc()
            self.proxy.metrics.leg_seconds.labels("decode").observe(0.4)
        self.decode.pull(5, 0.004, 1 << 20)
        self.decode.metrics.running.set(4)  # in its frontend: 3 running in the engine, 1 waiting
        self.decode.stats.running_requests = 3
        self.decode.stats.waiting_requests = 1
        self.proxy.add("decode", self.decode.url, in_flight=4)
        self.proxy.metrics.member_errors.labels("decode", self.dead, "unreachable").inc(2)
        self.proxy.metrics.migrations.labels("dropped", "moved").inc()
        self.proxy.metrics.running.set(4)

    def close(self) -> None:
        for server in (self.proxy.server, self.render.server, self.prefill.server, self.decode.server,
                       self.decode2.server):
            server.close()
