"""Rows and rendering of ``pdserve top``: two fleet scrapes in, one table out.

:func:`build_snapshot` turns the latest scrape (and the one before, for rates and interval p50s) into
plain rows, which the tests assert on; :func:`render_lines` lays them out as text with no terminal
codes, so the same lines serve a terminal (the loop in cli.py adds the cursor moves) and a pipe.

Counters show their total and, when an earlier scrape exists, ``+N`` new in the interval. Latency p50s
cover the interval between the two scrapes (bucket differences), or everything since the process
started on the first refresh and with ``--once``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from pdserve.top.quantile import bucket_deltas, counter_delta, histogram_quantile
from pdserve.top.scrape import FleetScrape, Scrape

# The same figure as pdserve and as stock vLLM (a member may be either) name it; the first found wins.
REQUESTS = ("pdserve_running_requests",)
ENGINE_RUNNING = ("pdserve_engine_running_requests", "vllm:num_requests_running")
ENGINE_WAITING = ("pdserve_engine_waiting_requests", "vllm:num_requests_waiting")
TTFT = ("pdserve_time_to_first_token_seconds", "vllm:time_to_first_token_seconds")
TPOT = ("pdserve_time_per_output_token_seconds", "vllm:request_time_per_output_token_seconds",
        "vllm:time_per_output_token_seconds", "vllm:inter_token_latency_seconds")
KV_PULLS_OK = "pdserve_kv_pulls_ok"
KV_PULLS_FAILED = "pdserve_kv_pulls_failed"
KV_PULL_SECONDS = "pdserve_kv_pull_seconds"
KV_PULLED_BYTES = "pdserve_kv_pulled_bytes"
LEGS = ("render", "prefill", "decode", "derender")
MIGRATION_OUTCOMES = ("moved", "failed", "not_moved")


@dataclass(frozen=True)
class Count:
    """A counter: its total and how much of it is new since the previous scrape (None: no previous)."""

    total: float
    new: float | None = None


@dataclass(frozen=True)
class ProxyRow:
    reachable: bool
    reason: str | None = None  # why not reachable
    running: float | None = None  # client requests in flight
    requests: Count | None = None  # finished client requests
    requests_per_s: float | None = None  # over the interval
    server_errors: Count | None = None  # finished with a 5xx
    retries: Count | None = None
    migrations: dict[str, Count] | None = None  # by outcome: moved, failed, not_moved
    leg_p50: dict[str, float] | None = None  # seconds, legs with observations only


@dataclass(frozen=True)
class MemberRow:
    pool: str
    url: str
    healthy: bool  # in the proxy's rotation
    in_flight: float | None  # the proxy's requests to it not yet answered
    errors: Count  # the proxy's failed requests to it
    error_causes: dict[str, float]  # totals by cause, nonzero only
    reachable: bool  # its own /metrics answered
    reason: str | None = None  # why not reachable
    requests: float | None = None  # in flight in its frontend
    running: float | None = None  # its engine's running requests
    waiting: float | None = None  # its engine's waiting requests
    ttft_p50: float | None = None  # seconds
    tpot_p50: float | None = None  # seconds
    kv_pulls: Count | None = None  # successful KV pulls (decode members)
    kv_pulls_failed: Count | None = None
    kv_pull_p50: float | None = None  # seconds
    kv_pulled_bytes: Count | None = None


@dataclass(frozen=True)
class Snapshot:
    proxy_url: str
    interval_s: float | None  # seconds since the previous scrape; None: figures since start
    proxy: ProxyRow
    members: tuple[MemberRow, ...]


def _count(now: Scrape, before: Scrape | None, name: str, **labels: str) -> Count | None:
    total = now.counter(name, **labels)
    if total is None:
        return None
    previous = before.counter(name, **labels) if before is not None else None
    # A counter missing before (a label set seen for the first time) started from 0.
    return Count(total, None if before is None else counter_delta(previous or 0.0, total))


def _count0(now: Scrape, before: Scrape | None, name: str, **labels: str) -> Count:
    """A counter the page always defines but exports only once it counted (a labelled one): 0 until then."""
    return _count(now, before, name, **labels) or Count(0.0, None if before is None else 0.0)


def _p50(now: Scrape, before: Scrape | None, names: str | Sequence[str], **labels: str) -> float | None:
    after = now.histogram(names, **labels)
    if after is None:
        return None
    earlier = before.histogram(names, **labels) if before is not None else None
    return histogram_quantile(0.5, bucket_deltas(earlier, after))


def _server_errors(proxy: Scrape) -> float:
    """The proxy's finished client requests that ended in a 5xx."""
    return sum(v for lb, v in proxy.series("pdserve_proxy_requests_total") if lb.get("status", "").startswith("5"))


def _proxy_row(now: Scrape, before: Scrape | None, interval_s: float | None) -> ProxyRow:
    if not now.ok:
        return ProxyRow(reachable=False, reason=now.error)
    requests = _count(now, before, "pdserve_proxy_requests")
    failed = _server_errors(now)
    server_errors = Count(failed, None if before is None else counter_delta(_server_errors(before), failed))
    rate = None
    if requests is not None and requests.new is not None and interval_s:
        rate = requests.new / interval_s
    migrations = {o: _count0(now, before, "pdserve_proxy_migrations", outcome=o) for o in MIGRATION_OUTCOMES}
    leg_p50 = {leg: p for leg in LEGS if (p := _p50(now, before, "pdserve_proxy_leg_seconds", leg=leg)) is not None}
    return ProxyRow(
        reachable=True, running=now.value("pdserve_proxy_running_requests"), requests=requests,
        requests_per_s=rate, server_errors=server_errors, retries=_count0(now, before, "pdserve_proxy_retries"),
        migrations=migrations, leg_p50=leg_p50,
    )


def _member_row(pool: str, url: str, proxy: Scrape, proxy_before: Scrape | None, own: Scrape | None,
                own_before: Scrape | None) -> MemberRow:
    errors = _count0(proxy, proxy_before, "pdserve_proxy_member_errors", pool=pool, url=url)
    causes = {lb["cause"]: v for lb, v in proxy.series("pdserve_proxy_member_errors_total")
              if lb.get("pool") == pool and lb.get("url") == url and v > 0 and "cause" in lb}
    base = MemberRow(
        pool=pool, url=url, healthy=proxy.value("pdserve_proxy_member_healthy", pool=pool, url=url) == 1,
        in_flight=proxy.value("pdserve_proxy_member_in_flight", pool=pool, url=url), errors=errors,
        error_causes=causes, reachable=False, reason=own.error if own is not None else "not scraped",
    )
    if own is None or not own.ok:
        return base
    # A member unreachable last time (or new) has no earlier page: its figures since it started.
    earlier = own_before if own_before is not None and own_before.ok else None
    return replace(
        base, reachable=True, reason=None, requests=own.value(REQUESTS), running=own.value(ENGINE_RUNNING),
        waiting=own.value(ENGINE_WAITING), ttft_p50=_p50(own, earlier, TTFT), tpot_p50=_p50(own, earlier, TPOT),
        kv_pulls=_count(own, earlier, KV_PULLS_OK), kv_pulls_failed=_count(own, earlier, KV_PULLS_FAILED),
        kv_pull_p50=_p50(own, earlier, KV_PULL_SECONDS), kv_pulled_bytes=_count(own, earlier, KV_PULLED_BYTES),
    )


def build_snapshot(proxy_url: str, now: FleetScrape, before: FleetScrape | None = None) -> Snapshot:
    """The rows of one refresh: ``now``'s figures, with interval deltas and p50s against ``before``
    (None: the first refresh or ``--once``, figures since start)."""
    proxy_before = before.proxy if before is not None and before.proxy.ok else None
    interval_s = now.at - before.at if proxy_before is not None and before is not None else None
    members = tuple(
        _member_row(m.pool, m.url, now.proxy, proxy_before, now.member_scrapes.get(m.url),
                    before.member_scrapes.get(m.url) if before is not None else None)
        for m in now.members
    )
    return Snapshot(proxy_url, interval_s, _proxy_row(now.proxy, proxy_before, interval_s), members)


def fmt_number(value: float | None) -> str:
    if value is None:
        return "-"
    return str(int(value)) if float(value).is_integer() else f"{value:.1f}"


def fmt_count(count: Count | None, scale: float = 1.0) -> str:
    """``total`` or ``total +new`` (only when something is new)."""
    if count is None:
        return "-"
    text = fmt_number(round(count.total / scale, 1))
    if count.new:
        text += f" +{fmt_number(round(count.new / scale, 1))}"
    return text


def fmt_seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1e-3:
        return f"{value * 1e6:.0f}us"
    if value < 1e-2:
        return f"{value * 1e3:.1f}ms"
    if value < 1:
        return f"{value * 1e3:.0f}ms"
    return f"{value:.2f}s"


HEADER = ("POOL", "MEMBER", "HEALTH", "IN-FLIGHT", "ERRORS", "REQS", "RUN", "WAIT", "TTFT p50", "TPOT p50",
          "KV PULLS", "KV FAILED", "KV p50", "KV MiB")
_PROXY_SIDE = 5  # the columns the proxy's page fills; an unreachable member's row ends after them


def member_cells(row: MemberRow) -> list[str]:
    cells = [row.pool, row.url, "up" if row.healthy else "down", fmt_number(row.in_flight), fmt_count(row.errors)]
    if not row.reachable:
        return [*cells, f"unreachable ({row.reason})"]
    return [
        *cells, fmt_number(row.requests), fmt_number(row.running), fmt_number(row.waiting),
        fmt_seconds(row.ttft_p50), fmt_seconds(row.tpot_p50), fmt_count(row.kv_pulls),
        fmt_count(row.kv_pulls_failed), fmt_seconds(row.kv_pull_p50), fmt_count(row.kv_pulled_bytes, 2**20),
    ]


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    """Left-aligned columns two spaces apart. A short row's last cell (an unreachable member's reason)
    spans the columns it replaces, so it neither widens nor is padded to them."""
    widths = [0] * max(len(r) for r in rows)
    for r in rows:
        measured = r if len(r) == len(widths) else r[:-1]
        for i, cell in enumerate(measured):
            widths[i] = max(widths[i], len(cell))
    return ["  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip() for r in rows]


def _proxy_line(row: ProxyRow) -> str:
    if not row.reachable:
        return f"proxy  unreachable ({row.reason})"
    parts = [f"running {fmt_number(row.running)}", f"requests {fmt_count(row.requests)}"]
    if row.requests_per_s is not None:
        parts[-1] += f" ({row.requests_per_s:.1f}/s)"
    parts += [f"5xx {fmt_count(row.server_errors)}", f"retries {fmt_count(row.retries)}"]
    migrations = row.migrations or {}
    parts.append("migrations " + ", ".join(f"{fmt_count(migrations.get(o))} {o.replace('_', ' ')}"
                                           for o in MIGRATION_OUTCOMES))
    if row.leg_p50:
        parts.append("leg p50 " + ", ".join(f"{leg} {fmt_seconds(p)}" for leg, p in row.leg_p50.items()))
    return "proxy  " + "  ".join(parts)


def render_lines(snapshot: Snapshot, wall_time: float | None = None) -> list[str]:
    """One refresh as plain lines: a title, the proxy's line, the member table, the error causes."""
    when = time.strftime("%H:%M:%S", time.localtime(wall_time if wall_time is not None else time.time()))
    span = ("totals, p50s since start" if snapshot.interval_s is None
            else f"+N: new in the last {snapshot.interval_s:.1f}s, p50s over it")
    lines = [f"pdserve top  {snapshot.proxy_url}  {when}  ({span})", _proxy_line(snapshot.proxy)]
    if snapshot.members:
        lines += ["", *_table([HEADER, *(member_cells(r) for r in snapshot.members)])]
    elif snapshot.proxy.reachable:
        lines += ["", "no members (the proxy's /metrics names none)"]
    causes = [f"  {r.pool} {r.url}: " + ", ".join(f"{c} {fmt_number(v)}" for c, v in sorted(r.error_causes.items()))
              for r in snapshot.members if r.error_causes]
    if causes:
        lines += ["", "errors by cause (totals):", *causes]
    return lines
