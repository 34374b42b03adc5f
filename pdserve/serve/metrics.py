"""Prometheus metrics of one frontend process (own registry, so apps in tests don't collide)."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.output import live
from pdserve.output.derender_cache import DerenderCache
from pdserve.output.request_state import RequestState
from pdserve.protocol.engine import EngineInfo, EngineStats
from pdserve.protocol.kv import PULL_SECONDS_BUCKETS, KVStats

TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                  40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                  80.0)

# KV hand-off counters (cumulative) and gauges (now): (KVStats field, metric name, help).
_KV_COUNTERS = (
    ("exported_blocks", "pdserve_kv_exported_blocks", "KV blocks of finished prefill legs held for a remote decode"),
    ("exported_requests", "pdserve_kv_exported_requests", "Prefill legs whose KV was held for a remote decode"),
    ("leases_pulled", "pdserve_kv_leases_pulled", "Held KV freed because its decode engine pulled it"),
    ("leases_expired", "pdserve_kv_leases_expired", "Held KV freed because nobody pulled it within --kv-lease-s"),
    ("pulls_ok", "pdserve_kv_pulls_ok", "Decode legs whose prompt KV was pulled from a prefill engine"),
    ("pulls_failed", "pdserve_kv_pulls_failed", "Decode legs whose KV pull failed"),
    ("recomputes", "pdserve_kv_recomputes", "Failed pulls answered by prefilling here (--kv-load-failure-policy)"),
    ("pulled_blocks", "pdserve_kv_pulled_blocks", "KV blocks pulled from prefill engines"),
    ("pulled_bytes", "pdserve_kv_pulled_bytes", "KV bytes pulled from prefill engines"),
    ("pulled_tokens", "pdserve_kv_pulled_tokens", "Prompt positions whose KV was pulled from prefill engines"),
    ("local_prefix_blocks", "pdserve_kv_local_prefix_blocks",
     "Blocks of decode legs' prompts found in this engine's prefix cache, so not pulled"),
)
_KV_GAUGES = (
    ("slots", "pdserve_kv_slots", "Slots of the NIXL-registered KV cache (running batch and hand-offs)"),
    ("free_slots", "pdserve_kv_free_slots", "Free slots of the KV cache"),
    ("held_blocks", "pdserve_kv_held_blocks", "KV blocks held for remote decode (leases)"),
    ("held_requests", "pdserve_kv_held_requests", "Prefill legs whose KV is held for remote decode"),
)


def _kv_metrics(kv: KVStats) -> Iterator[Metric]:
    for field, name, doc in _KV_COUNTERS:
        yield CounterMetricFamily(name, doc, value=getattr(kv, field))
    for field, name, doc in _KV_GAUGES:
        yield GaugeMetricFamily(name, doc, value=getattr(kv, field))
    running, buckets = 0, []
    for bound, count in zip((*PULL_SECONDS_BUCKETS, float("inf")), kv.pull_seconds_counts, strict=True):
        running += count
        buckets.append(("+Inf" if bound == float("inf") else str(bound), running))
    yield HistogramMetricFamily(
        "pdserve_kv_pull_seconds", "KV pull latency (READ start to end)", buckets=buckets, sum_value=kv.pull_seconds_sum
    )


class _EngineStatsCollector(Collector):
    """Reads the engine's live counters at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats], info: Callable[[], EngineInfo | None]):
        self._info = info
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
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
        yield CounterMetricFamily(
            "pdserve_engine_prompt_tokens_computed", "Prompt positions the engine's model computed (prefill)",
            value=stats.prompt_tokens_computed,
        )
        info = self._info()
        # Before the core's first heartbeat the series exist already (at 0): from the engine's info.
        if stats.prefix_cache_queries is not None or (info is not None and info.prefix_cache_blocks):
            yield CounterMetricFamily(
                "pdserve_prefix_cache_queries", "Prompt positions looked up in the prefix cache (vLLM's "
                "prefix_cache_queries)", value=stats.prefix_cache_queries or 0,
            )
            yield CounterMetricFamily(
                "pdserve_prefix_cache_hits", "Prompt positions served from the prefix cache (vLLM's prefix_cache_hits)",
                value=stats.prefix_cache_hits or 0,
            )
        if stats.kv is not None:
            yield from _kv_metrics(stats.kv)
        elif info is not None and (pool := info.kv) is not None:
            yield from _kv_metrics(KVStats(slots=pool.num_slots, free_slots=pool.num_slots))


class TokenCounter(Collector):
    """``pdserve_generation_tokens``, counted once per chunk of every stream: a plain int (the frontend is
    one event loop), where prometheus_client's Counter takes a lock per increment (3% of a tokens stream's
    API CPU in a profile)."""

    def __init__(self) -> None:
        self.value = 0

    def inc(self, amount: int) -> None:
        self.value += amount

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily("pdserve_generation_tokens", "Generated tokens sent to clients", value=self.value)


class _LiveObjectsCollector(Collector):
    """Per-request objects still alive (pdserve.output.live): 0 when nothing runs, unless something leaks;
    the ids the server's tokenizer turned into text; the outputs streams took from the engine's dispatch."""

    def __init__(self, decoded_ids: Callable[[], int | None], direct_outputs: Callable[[], int | None]) -> None:
        self._decoded_ids = decoded_ids
        self._direct_outputs = direct_outputs

    def collect(self) -> Iterator[Metric]:
        direct = self._direct_outputs()
        if direct is not None:
            yield CounterMetricFamily(
                "pdserve_direct_outputs", "Engine outputs a stream wrote from the engine's dispatch itself, without "
                "waking its own task (serve.driver)", value=direct,
            )
        decoded = self._decoded_ids()
        if decoded is not None:
            yield CounterMetricFamily(
                "pdserve_detokenized_tokens", "Token ids this process turned into text (decode calls and incremental "
                "detokenizer steps); tokens-mode generate without stop strings adds none", value=decoded,
            )
        yield GaugeMetricFamily(
            "pdserve_frozen_objects", "Objects built at startup that the garbage collector no longer walks "
            "(serve.runner.freeze_startup_heap: the tokenizer's tables, the app, the engine client)",
            value=gc.get_freeze_count(),
        )
        yield GaugeMetricFamily(
            "pdserve_live_request_states", "Request states alive in this process (0 when idle; more: a leak)",
            value=len(live.request_states),
        )
        yield GaugeMetricFamily(
            "pdserve_live_parsers", "Reasoning/tool parsers alive in this process, cached derender states included",
            value=len(live.parsers),
        )


class _DerenderCacheCollector(Collector):
    """The streaming /derender state cache (pdserve.output.derender_cache): its size now, its use so far."""

    def __init__(self, cache: DerenderCache):
        self._cache = cache

    def collect(self) -> Iterator[Metric]:
        self._cache.expire()  # the size counts live states only, also when no chunk came for a while
        cache = self._cache
        yield GaugeMetricFamily("pdserve_derender_cache_entries", "Streaming /derender states cached now",
                                value=len(cache))
        yield CounterMetricFamily("pdserve_derender_cache_hits", "Streaming /derender chunks that continued a cached "
                                  "state", value=cache.hits)
        yield CounterMetricFamily("pdserve_derender_cache_misses", "Streaming /derender chunks with earlier output "
                                  "that found no cached state and replayed it", value=cache.misses)
        yield CounterMetricFamily("pdserve_derender_cache_evictions", "Cached streaming /derender states dropped "
                                  "unused (LRU bound, TTL, or replaced)", value=cache.evictions)


class Metrics:
    def __init__(
        self, engine_stats: Callable[[], EngineStats] | None = None,
        engine_info: Callable[[], EngineInfo | None] = lambda: None,
        decoded_ids: Callable[[], int | None] = lambda: None,
        direct_outputs: Callable[[], int | None] = lambda: None,
    ):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "pdserve_requests",
            "Finished requests by endpoint, output mode and HTTP status",
            ["endpoint", "output_mode", "status"],
            registry=self.registry,
        )
        self.tokens_out = TokenCounter()
        self.registry.register(self.tokens_out)
        self.running = Gauge(
            "pdserve_running_requests", "Requests in flight in this frontend process", registry=self.registry
        )
        self.server_errors = Counter(
            "pdserve_server_errors",
            "Answers that were server errors (a 5xx status, or a stream that ended with a 5xx error event), "
            "by route and status; counted once per request, for every route",
            ["path", "status"],
            registry=self.registry,
        )
        # vLLM's buckets (time_to_first_token_seconds, request_time_per_output_token_seconds).
        self.ttft = Histogram(
            "pdserve_time_to_first_token_seconds", "Arrival (parsed, validated) to the first output token, per "
            "finished request", buckets=TTFT_BUCKETS_S, registry=self.registry,
        )
        self.tpot = Histogram(
            "pdserve_time_per_output_token_seconds", "First to last output token over the tokens after the first, "
            "per finished request of two tokens or more", buckets=TPOT_BUCKETS_S, registry=self.registry,
        )
        self.idle_streams_closed = Counter(
            "pdserve_idle_streams_closed", "Streams cut off because their client read nothing for --stream-idle-timeout",
            registry=self.registry,
        )
        self.registry.register(_LiveObjectsCollector(decoded_ids, direct_outputs))
        if engine_stats is not None:
            self.registry.register(_EngineStatsCollector(engine_stats, engine_info))

    def observe_timing(self, states: Iterable[RequestState]) -> None:
        """A finished client request's engine requests, into the TTFT and TPOT histograms."""
        for rstate in states:
            ttft, tpot = rstate.timing.ttft_and_tpot_s(rstate.completion_tokens)
            if ttft is not None:
                self.ttft.observe(ttft)
            if tpot is not None:
                self.tpot.observe(tpot)

    def watch_derender_cache(self, cache: DerenderCache | None) -> DerenderCache | None:
        """Export the streaming /derender cache's size and counters (none when it is off); returns it."""
        if cache is not None:
            self.registry.register(_DerenderCacheCollector(cache))
        return cache
