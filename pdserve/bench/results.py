"""One ``bench serve`` run as data: the result JSON (vLLM's field names per arm and load) and its table.

The JSON keeps every cell's summary under ``cells`` (one entry per load × arm, in run order) so
a scenario, the Markdown writer and the plots all read the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

from pdserve.bench.loadgen import Arm
from pdserve.bench.preflight import SkippedArm
from pdserve.bench.report import fmt, machine, markdown_table
from pdserve.bench.sweep import Cell, Load, Schedule, cell_summary


def result_json(arms: Sequence[Arm], loads: Sequence[Load], schedule: Schedule, cells: Mapping[tuple[Load, str], Cell],
                slo: dict[str, float] | None, metered: bool, command: str,
                skipped: Sequence[SkippedArm] = ()) -> dict[str, Any]:
    """Everything a run measured, ready for ``json.dump`` (NaN stays NaN: nothing measured); ``skipped``:
    the arms a server did not serve (bench.preflight), with why."""
    by_label = {a.label: a for a in arms}
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "command": command,
        "schedule": asdict(schedule),
        "slo_ms": slo or {},
        "arms": [asdict(a) for a in arms],
        "skipped_arms": [asdict(s) for s in skipped],
        "cells": [
            {"label": label, "max_concurrency": load.concurrency,
             "request_rate": None if math.isinf(load.request_rate) else load.request_rate,
             "load": load.label, **cell_summary(cell, by_label[label], slo, metered)}
            for (load, label), cell in cells.items()
        ],
    }


def _ms(value: float) -> str:
    return fmt(value, digits=1)


def _pair(cell: Mapping[str, Any], metric: str) -> str:
    return f"{_ms(cell[f'median_{metric}_ms'])} / {_ms(cell[f'p99_{metric}_ms'])}"


def results_table(result: Mapping[str, Any], cells: Sequence[Mapping[str, Any]] | None = None) -> str:
    """The Markdown table of a run's cells (or of ``cells``, a subset): latencies p50 / p99 in ms."""
    rows = []
    chosen = result["cells"] if cells is None else cells
    has_cpu = any("api_cpu_us_per_output_token" in c for c in chosen)
    has_server = any("median_server_time_to_first_token_ms" in c for c in chosen)
    has_goodput = any("request_goodput" in c for c in chosen)
    headers = ["load", "arm", "done", "tok/req", "TTFT p50 / p99", "TPOT p50 / p99", "ITL p50 / p99", "E2EL p50",
               "out tok/s"]
    headers += ["goodput req/s"] if has_goodput else []
    headers += ["API CPU µs/tok", "engine CPU µs/tok"] if has_cpu else []
    headers += ["client CPU µs/tok"]
    headers += ["server TTFT p50", "TTFT outside server p50"] if has_server else []
    for c in chosen:
        done = c["completed"]
        row = [c["load"], c["label"], f"{done}" + (f" ({c['failed']} failed)" if c["failed"] else ""),
               fmt(c["total_output_tokens"] / done if done else math.nan, digits=0),
               _pair(c, "ttft"), _pair(c, "tpot"), _pair(c, "itl"), _ms(c["median_e2el_ms"]),
               fmt(c["output_throughput"], digits=1)]
        row += [fmt(c["request_goodput"], digits=2)] if has_goodput else []
        if has_cpu:
            row += [fmt(c.get("api_cpu_us_per_output_token", math.nan), digits=0),
                    fmt(c.get("engine_cpu_us_per_output_token", math.nan), digits=0)]
        client = fmt(c["client_cpu_us_per_output_token"], digits=0)
        row += [client + (" ⚠ client fell behind" if c["client_fell_behind"] else "")]
        if has_server:
            row += [_ms(c.get("median_server_time_to_first_token_ms", math.nan)),
                    _ms(c.get("median_ttft_outside_server_ms", math.nan))]
        rows.append(row)
    return markdown_table(headers, rows)
