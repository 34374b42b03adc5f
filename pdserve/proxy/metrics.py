"""Prometheus metrics of the proxy (own registry): requests by endpoint/mode/status, leg latencies and
the phases within a leg, requests in flight, and each pool member's health, requests in flight and failures
by cause, so an operator sees which leg is slow or down and which member the routing steers away from.

A leg's whole time is ``pdserve_proxy_leg_seconds{leg}`` (``pdserve top`` and dashboards read it); its
phases are ``pdserve_proxy_leg_phase_seconds{leg,phase}`` (:mod:`pdserve.proxy.record` says where each
comes from), so the total is not kept twice."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.proxy.pool import Member, Pool
from pdserve.proxy.record import Phase

LEG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# Phases reach down to a per-token time of a millisecond or two.
PHASE_BUCKETS = (0.001, 0.0025, *LEG_BUCKETS)


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
        self.leg_phase_seconds = Histogram(
            "pdserve_proxy_leg_phase_seconds", "Time per phase of a leg (its whole time is pdserve_proxy_leg_seconds): "
            "prefill queue and compute, as the prefill member reports them; decode queue (the member's), ttft (decode "
            "leg sent to first output) and tpot (per output token after the first), the proxy's own on streams and "
            "the member's on batch answers. Phases a member does not report are not observed",
            ["leg", "phase"], buckets=PHASE_BUCKETS, registry=self.registry,
        )
        self.running = Gauge("pdserve_proxy_running_requests", "Client requests in flight", registry=self.registry)
        self.member_healthy = Gauge(
            "pdserve_proxy_member_healthy", "1 while a pool member is in rotation, else 0", ["pool", "url"],
            registry=self.registry,
        )

        self.member_in_flight = Gauge(
            "pdserve_proxy_member_in_flight", "Requests sent to a pool member and not yet answered (a stream: "
            "until it closes); the routing picks the less busy of two members", ["pool", "url"],
            registry=self.registry,
        )
        self.member_errors = Counter(
            "pdserve_proxy_member_errors", "Failed requests to a pool member by cause: unreachable, dropped "
            "(failed mid-request), status_<code> (a 5xx answer; 503 sends the request to another member)",
            ["pool", "url", "cause"], registry=self.registry,
        )

        self.migrations = Counter(
            "pdserve_proxy_migrations", "Decode legs that broke mid-stream, by cause (dropped, stalled, truncated, "
            "garbage, error_event) and outcome: moved (the stream went on on another decode member), failed "
            "(no member took it), not_moved (--migration-limit reached, or the stream cannot be resumed exactly)",
            ["cause", "outcome"], registry=self.registry,
        )

        self.retries = Counter(
            "pdserve_proxy_retries", "Legs sent again to another member after theirs failed mid-request: prefill "
            "legs (their output is never shown, so a second run is safe) and decode streams that broke before their "
            "first byte", ["leg"], registry=self.registry,
        )

    def observe_phases(self, phases: Iterable[Phase]) -> None:
        for leg, phase, seconds in phases:
            self.leg_phase_seconds.labels(leg, phase).observe(seconds)

    def member_changed(self, pool: Pool, member: Member) -> None:
        self.member_healthy.labels(pool.name, member.url).set(1 if member.healthy else 0)
        self.member_in_flight.labels(pool.name, member.url).set(member.in_flight)

    def member_failed(self, pool: Pool, member: Member, cause: str) -> None:
        self.member_errors.labels(pool.name, member.url, cause).inc()
