"""Numbers → tables: percentiles, per-arm latency/CPU summaries, markdown, the host line, and the docs section swap.

Kept free of HTTP and processes so the arithmetic that ends up in
``docs/benchmarks.md`` can be unit-tested on hand-made inputs.
"""

from __future__ import annotations

import math
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

QUANTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between closest ranks (numpy's default).

    NaN for no values, so an empty arm shows as missing rather than as a fake zero.
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within [0, 100], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def quantiles(values: Sequence[float]) -> dict[str, float]:
    return {f"p{q}": percentile(values, q) for q in QUANTILES}


@dataclass(frozen=True)
class Latency:
    """One request's client-side latencies in seconds; ``itl`` has one entry per token after the first."""

    ttft: float
    itl: list[float]
    tpot: float
    e2e: float


def request_latency(start: float, arrivals: Sequence[tuple[float, int]], end: float) -> Latency:
    """Latencies from token arrivals ``(time, ids made usable)``, counted by token ids, not text.

    A chunk that releases k ids at once (text held back by a parser or the stop-string
    window) contributes its gap once and k-1 zero gaps, so ITL samples sum to the time
    between the first and the last token whatever the chunking.
    """
    timed = [(t, n) for t, n in arrivals if n > 0]
    if not timed:
        raise ValueError("a request without any token arrival has no latency")
    first = timed[0][0]
    itl = [0.0] * (timed[0][1] - 1)
    previous = first
    for t, n in timed[1:]:
        itl.append(t - previous)
        itl.extend([0.0] * (n - 1))
        previous = t
    tokens = sum(n for _, n in timed)
    tpot = (previous - first) / (tokens - 1) if tokens > 1 else 0.0
    return Latency(ttft=first - start, itl=itl, tpot=tpot, e2e=end - start)


@dataclass(frozen=True)
class ArmSummary:
    """One arm in one cell as reported: latencies in seconds (p50/p90/p99), CPU in µs per output token."""

    requests: int
    output_tokens: int
    ttft: dict[str, float]
    itl: dict[str, float]
    tpot: dict[str, float]
    e2e: dict[str, float]
    cpu_generate: float
    cpu_derender: float
    cpu_client: float

    @property
    def cpu_servers(self) -> float:
        """Both servers together: what a deployment pays for this path, client aside."""
        return self.cpu_generate + self.cpu_derender


@dataclass
class ArmTotals:
    """What one arm accumulated in one cell over all its rounds."""

    latencies: list[Latency] = field(default_factory=list)
    output_tokens: int = 0
    cpu_generate_s: float = 0.0
    cpu_derender_s: float = 0.0
    cpu_client_s: float = 0.0

    def _per_token_us(self, seconds: float) -> float:
        return seconds / self.output_tokens * 1e6 if self.output_tokens else math.nan

    def summary(self) -> ArmSummary:
        return ArmSummary(
            requests=len(self.latencies),
            output_tokens=self.output_tokens,
            ttft=quantiles([x.ttft for x in self.latencies]),
            itl=quantiles([gap for x in self.latencies for gap in x.itl]),
            tpot=quantiles([x.tpot for x in self.latencies]),
            e2e=quantiles([x.e2e for x in self.latencies]),
            cpu_generate=self._per_token_us(self.cpu_generate_s),
            cpu_derender=self._per_token_us(self.cpu_derender_s),
            cpu_client=self._per_token_us(self.cpu_client_s),
        )


def ratio(numerator: float, denominator: float) -> float:
    if math.isnan(numerator) or math.isnan(denominator) or denominator <= 0:
        return math.nan
    return numerator / denominator


def fmt(value: float, scale: float = 1.0, digits: int = 1, suffix: str = "") -> str:
    """A table cell: NaN (nothing measured) is an em dash, never a zero."""
    if math.isnan(value):
        return "—"
    return f"{value * scale:.{digits}f}{suffix}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub markdown table; ``|`` inside a cell is escaped so columns stay aligned."""
    if any(len(row) != len(headers) for row in rows):
        raise ValueError("every row needs one cell per header")

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(headers), "|" + "|".join(" --- " for _ in headers) + "|", *(line(r) for r in rows)])


def replace_section(document: str, heading: str, body: str) -> str:
    """``document`` with the level-2 section titled ``heading`` replaced by ``heading`` + ``body``.

    The section runs to the next ``## `` heading outside a code fence (or the end); every
    other section is kept byte for byte. A missing section is appended at the end.
    """
    section = heading + "\n\n" + body.strip("\n") + "\n"
    lines = document.splitlines(keepends=True)
    start = next((i for i, text in enumerate(lines) if text.rstrip("\r\n") == heading), None)
    if start is None:
        prefix = document.rstrip("\n")
        return (prefix + "\n\n" if prefix else "") + section
    end, fenced = len(lines), False
    for i in range(start + 1, len(lines)):
        stripped = lines[i].lstrip()
        if stripped.startswith("```"):
            fenced = not fenced
        elif not fenced and lines[i].startswith("## "):
            end = i
            break
    after = "".join(lines[end:])
    return "".join(lines[:start]) + section + ("\n" + after if after else "")


def machine() -> str:
    """The host line under every benchmark section: numbers from different machines do not compare."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
    cpu = f"{os.cpu_count()} vCPU" + (f" ({model})" if model else "")
    return f"{cpu}, Linux {platform.release()}, Python {platform.python_version()}"


DOCS_TITLE = "# pdserve benchmarks"


def write_section(path: Path, heading: str, body: str) -> None:
    """Swap one benchmark's section into ``path`` atomically, leaving every other section untouched."""
    document = path.read_text(encoding="utf-8") if path.exists() else DOCS_TITLE + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(replace_section(document, heading, body), encoding="utf-8")
    tmp.replace(path)
