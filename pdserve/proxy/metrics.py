"""Prometheus metrics of the proxy (own registry): requests by endpoint/mode/status, leg latencies,
requests in flight and each pool member's health, so an operator sees which leg is slow or down."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.proxy.pool import Member, Pool

LEG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "pdserve_proxy_requests", "Finished client requests by endpoint, mode and HTTP status "
            "(499: the client left)", ["endpoint", "mode", "status"], registry=self.registry,
        )
        self.leg_seconds = Histogram(
            "pdserve_proxy_leg_seconds", "Time per leg: render, prefill, decode (to the end of its stream), "
            "derender (every per-chunk call of a derender-tier request)", ["leg"], buckets=LEG_BUCKETS,
            registry=self.registry,
        )
        self.running = Gauge("pdserve_proxy_running_requests", "Client requests in flight", registry=self.registry)
        self.member_healthy = Gauge(
            "pdserve_proxy_member_healthy", "1 while a pool member is in rotation, else 0", ["pool", "url"],
            registry=self.registry,
        )

    def member_changed(self, pool: Pool, member: Member) -> None:
        self.member_healthy.labels(pool.name, member.url).set(1 if member.healthy else 0)
