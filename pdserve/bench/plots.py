"""PNG plots of ``bench serve`` results (matplotlib, headless): one figure per question asked.

* latency vs concurrency per arm: median TTFT, median TPOT and p99 ITL against the concurrency cap;
* CPU per output token vs output length per arm: how server cost grows with the output;
* ITL distribution per arm: the empirical CDF of every inter-token gap at one load.

Each function takes result dicts as :func:`pdserve.bench.results.result_json` writes them and
returns the path it wrote.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display: files only (before pyplot is imported)
import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _x_ticks(ax: Any, values: Sequence[float]) -> None:
    """Log-2 x axis labelled with the measured values themselves (1, 8, 32 ... not 2^k)."""
    ticks = sorted(set(values))
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{t:g}" for t in ticks])
    ax.minorticks_off()


def _by_arm(cells: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    arms: dict[str, list[Mapping[str, Any]]] = {}
    for cell in cells:
        arms.setdefault(cell["label"], []).append(cell)
    return arms


def latency_vs_concurrency(result: Mapping[str, Any], path: Path, title: str = "") -> Path:
    """Three panels (TTFT p50, TPOT p50, ITL p99 in ms) against the concurrency cap, a line per arm."""
    panels = (("median_ttft_ms", "TTFT p50 (ms)"), ("median_tpot_ms", "TPOT p50 (ms)"), ("p99_itl_ms", "ITL p99 (ms)"))
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    xs = [c["max_concurrency"] for c in result["cells"] if c["max_concurrency"] is not None]
    for ax, (key, name) in zip(axes, panels, strict=True):
        for label, cells in _by_arm(result["cells"]).items():
            points = sorted((c["max_concurrency"], c[key]) for c in cells if c["max_concurrency"] is not None)
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
        _x_ticks(ax, xs)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("max concurrency")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def cpu_vs_length(points: Mapping[str, Sequence[tuple[int, float]]], path: Path, title: str = "",
                  ylabel: str = "API CPU µs / output token") -> Path:
    """``points``: per arm, (output tokens per request, CPU µs per token); log-log, so 256..8192 spread and
    a per-chunk replay (cost growing with length) and flat inline paths both show."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, pts in points.items():
        pts = sorted(pts)
        ax.plot([p[0] for p in pts], [max(p[1], 1.0) for p in pts], marker="o", label=label)
    _x_ticks(ax, [p[0] for pts in points.values() for p in pts])
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("output tokens per request")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    return _save(fig, path)


def itl_distribution(result: Mapping[str, Any], path: Path, title: str = "") -> Path:
    """CDF of inter-token gaps (ms) per arm at the run's highest concurrency, from each cell's
    ``itl_cdf_ms`` (its 0..100th percentiles); log-x so the tail shows."""
    top = max((c["max_concurrency"] or 0) for c in result["cells"])
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label, cells in _by_arm(result["cells"]).items():
        for cell in cells:
            if (cell["max_concurrency"] or 0) != top or not cell.get("itl_cdf_ms"):
                continue
            quantiles = cell["itl_cdf_ms"]
            xs = [max(q, 1e-3) for q in quantiles]
            ax.plot(xs, [i / (len(quantiles) - 1) for i in range(len(quantiles))], label=f"{label} ({cell['load']})")
    ax.set_xscale("log")
    ax.set_xlabel("inter-token latency (ms)")
    ax.set_ylabel("fraction of gaps ≤ x")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    return _save(fig, path)
