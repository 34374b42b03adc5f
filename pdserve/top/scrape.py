"""Fetch and parse the ``/metrics`` of a proxy and of the members it routes to.

The proxy's ``pdserve_proxy_member_healthy{pool,url}`` series name every member it knows, healthy or
not, so the proxy's own page is the fleet's roster: ``pdserve top`` needs only the proxy's URL. Each
member is then scraped directly (its engine, KV and latency figures live there, not at the proxy).

Scrapes never raise: a member that refuses, times out or answers garbage comes back as a :class:`Scrape`
with ``error`` set, and the view shows it as unreachable. Members are scraped in parallel with a short
timeout, so one dead host costs a refresh at most one timeout, not one per member.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.top.quantile import Bucket

Labels = Mapping[str, str]


@dataclass(frozen=True)
class Scrape:
    """One ``/metrics`` page, its samples by sample name (``x_total``, ``x_bucket``, ...), or why there is
    none (``error``: a short reason fit for a table cell)."""

    url: str
    samples: Mapping[str, Sequence[tuple[Labels, float]]] = field(default_factory=dict)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def series(self, name: str) -> Sequence[tuple[Labels, float]]:
        return self.samples.get(name, ())

    def value(self, names: str | Iterable[str], **labels: str) -> float | None:
        """The sum of the first of ``names`` that this page has, over its samples whose labels include
        ``labels``; None when the page has none of the names. Several names: the same figure as pdserve
        and as stock vLLM spell it."""
        for name in (names,) if isinstance(names, str) else names:
            if name in self.samples:
                return sum(v for lb, v in self.samples[name] if _matches(lb, labels))
        return None

    def counter(self, names: str | Iterable[str], **labels: str) -> float | None:
        """A counter's value: the exposition's ``_total`` sample, or the bare name (older exporters)."""
        spelled = [names] if isinstance(names, str) else list(names)
        return self.value([f"{n}_total" for n in spelled] + spelled, **labels)

    def histogram(self, names: str | Iterable[str], **labels: str) -> list[Bucket] | None:
        """The cumulative buckets of the first of ``names`` this page has, summed over the label sets that
        include ``labels`` (one histogram per leg, per model, ...), sorted by bound; None if absent."""
        for name in (names,) if isinstance(names, str) else names:
            samples = self.samples.get(f"{name}_bucket")
            if samples is None:
                continue
            by_bound: dict[float, float] = {}
            for lb, v in samples:
                if _matches(lb, labels) and "le" in lb:
                    bound = float(lb["le"])  # "+Inf" parses as inf
                    by_bound[bound] = by_bound.get(bound, 0.0) + v
            return sorted(by_bound.items())
        return None


def _matches(labels: Labels, wanted: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in wanted.items())


def parse_metrics(url: str, text: str) -> Scrape:
    """Prometheus text exposition → :class:`Scrape` (``error`` set when it does not parse)."""
    samples: dict[str, list[tuple[Labels, float]]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    except (ValueError, TypeError, IndexError) as e:
        return Scrape(url, error=f"bad metrics page ({type(e).__name__})")
    return Scrape(url, samples)


def _reason(error: httpx.HTTPError) -> str:
    """A table-cell-sized reason for a failed scrape."""
    if isinstance(error, httpx.TimeoutException):
        return "timed out"
    if isinstance(error, httpx.ConnectError):
        return "connection refused" if "refused" in str(error).lower() else "cannot connect"
    if isinstance(error, httpx.HTTPStatusError):
        return f"HTTP {error.response.status_code}"
    return type(error).__name__


def fetch_metrics(client: httpx.Client, url: str, timeout_s: float) -> Scrape:
    """GET ``url``/metrics and parse it; never raises for a server that fails."""
    try:
        response = client.get(f"{url.rstrip('/')}/metrics", timeout=timeout_s)
        response.raise_for_status()
    except httpx.HTTPError as e:
        return Scrape(url, error=_reason(e))
    return parse_metrics(url, response.text)


@dataclass(frozen=True)
class Member:
    """A pool member as the proxy names it."""

    pool: str
    url: str


def members_of(proxy: Scrape) -> tuple[Member, ...]:
    """Every member the proxy knows, in the order of its metrics page (its pools' order: render, prefill,
    decode), from ``pdserve_proxy_member_healthy{pool,url}``."""
    seen: dict[Member, None] = {}
    for labels, _ in proxy.series("pdserve_proxy_member_healthy"):
        if "pool" in labels and "url" in labels:
            seen.setdefault(Member(labels["pool"], labels["url"]), None)
    return tuple(seen)


@dataclass(frozen=True)
class FleetScrape:
    """The proxy's page and every member's, taken together at ``at`` (a monotonic clock, for rates)."""

    at: float
    proxy: Scrape
    members: tuple[Member, ...]
    member_scrapes: Mapping[str, Scrape]  # by URL: a server in two pools is scraped once


class FleetScraper:
    """Scrapes a proxy and its members, reusing one HTTP client (keep-alive) and one thread pool across
    refreshes. ``api_key`` is sent as a bearer token to the proxy and the members (the proxy's
    ``/metrics`` sits behind its ``--api-key``)."""

    def __init__(self, proxy_url: str, timeout_s: float = 1.0, api_key: str | None = None,
                 client: httpx.Client | None = None, workers: int = 8) -> None:
        self.proxy_url = proxy_url.rstrip("/")
        self.timeout_s = timeout_s
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = client or httpx.Client(headers=headers, timeout=timeout_s)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pdserve-top")

    def scrape(self) -> FleetScrape:
        at = time.monotonic()
        proxy = fetch_metrics(self._client, self.proxy_url, self.timeout_s)
        members = members_of(proxy)
        urls = list(dict.fromkeys(m.url for m in members))
        scrapes = self._pool.map(lambda url: fetch_metrics(self._client, url, self.timeout_s), urls)
        return FleetScrape(at, proxy, members, dict(zip(urls, scrapes)))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()

    def __enter__(self) -> FleetScraper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
