"""Prometheus metrics of one frontend process (own registry, so apps in tests don't collide)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from pdserve.protocol.engine import EngineStats


class _EngineStatsCollector(Collector):
    """Reads the engine's live counters at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats]):
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = self._stats()
        yield GaugeMetricFamily(
            "pdserve_engine_running_requests", "Requests the engine is running", value=stats.running_requests
        )
        yield GaugeMetricFamily(
            "pdserve_engine_running_sequences", "Sequences the engine is running", value=stats.running_sequences
        )
        yield GaugeMetricFamily(
            "pdserve_engine_waiting_requests", "Requests waiting in the engine", value=stats.waiting_requests
        )


class Metrics:
    def __init__(self, engine_stats: Callable[[], EngineStats] | None = None):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "pdserve_requests",
            "Finished requests by endpoint, output mode and HTTP status",
            ["endpoint", "output_mode", "status"],
            registry=self.registry,
        )
        self.tokens_out = Counter(
            "pdserve_generation_tokens", "Generated tokens sent to clients", registry=self.registry
        )
        self.running = Gauge(
            "pdserve_running_requests", "Requests in flight in this frontend process", registry=self.registry
        )
        if engine_stats is not None:
            self.registry.register(_EngineStatsCollector(engine_stats))
