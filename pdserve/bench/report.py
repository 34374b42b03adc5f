"""Numbers → text: percentiles, table cells, markdown tables, the host line, and the docs section swap.

Kept free of HTTP and processes so what ends up in ``docs/benchmarks.md`` can be unit-tested on
hand-made inputs.
"""

from __future__ import annotations

import math
import os
import platform
from collections.abc import Sequence
from pathlib import Path


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


def publish_section(heading: str, body: str, docs: Path | None) -> None:
    """Print a benchmark's section, and swap it into ``docs`` unless that is None (``--no-docs``)."""
    print(heading + "\n\n" + body)
    if docs is not None:
        write_section(docs, heading, body)
        print(f"wrote {docs}")
