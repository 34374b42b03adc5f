"""What ``pdserve bench frontend`` writes: ratios, tables, the prose read off them, and the JSON.

Everything here is computed from a :class:`~pdserve.bench.orchestrate.RunResult`
and nothing else, so each sentence in the docs section states a number of that
run. The method itself (what each metric means, why the baselines differ, the
caveats) does not change between runs and lives in docs/benchmark-methodology.md;
the section links to it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from pdserve.bench.loadgen import Arm
from pdserve.bench.orchestrate import DERENDER_SERVER_ARGS, Cell, Profile, RunResult, generate_server_args
from pdserve.bench.report import fmt, machine, markdown_table, ratio

METHODOLOGY_LINK = "[benchmark-methodology.md](benchmark-methodology.md)"
# Each baseline and the inline arm that returns the same output with one hop instead of two per chunk.
PAIRS = ((Arm.TOKENS_COMPLETIONS_DERENDER, Arm.TEXT), (Arm.TOKENS_CHAT_DERENDER, Arm.DERENDER))


def _ms(value: float) -> str:
    return fmt(value, 1000.0, 1)


def _x(value: float) -> str:
    return fmt(value, digits=2, suffix="×")


@dataclass(frozen=True)
class Ratios:
    """Baseline ÷ inline in one cell, for one output level (>1: inline is better)."""

    e2e_p50: float
    ttft_p50: float
    itl_p99: float
    server_cpu_per_token: float


def pair_ratios(result: RunResult) -> dict[Cell, dict[Arm, Ratios]]:
    """For each cell, keyed by the inline arm: how much the matching per-chunk baseline costs more."""
    out: dict[Cell, dict[Arm, Ratios]] = {}
    for cell, arms in result.cells.items():
        for baseline, inline in PAIRS:
            if baseline in arms and inline in arms:
                b, i = arms[baseline], arms[inline]
                out.setdefault(cell, {})[inline] = Ratios(
                    e2e_p50=ratio(b.e2e["p50"], i.e2e["p50"]),
                    ttft_p50=ratio(b.ttft["p50"], i.ttft["p50"]),
                    itl_p99=ratio(b.itl["p99"], i.itl["p99"]),
                    server_cpu_per_token=ratio(b.cpu_servers, i.cpu_servers),
                )
    return out


def results_table(result: RunResult, ratios: dict[Cell, dict[Arm, Ratios]]) -> str:
    headers = ["cell", "arm", "req", "tok/req", "TTFT p50 / p90 / p99 ms", "ITL p50 / p99 ms", "TPOT p50 ms", "E2E p50 ms",
               "generate CPU µs/tok", "derender CPU µs/tok", "client CPU µs/tok", "E2E p50 baseline ÷ inline",
               "server CPU/tok baseline ÷ inline"]
    inline_of = dict(PAIRS)
    rows = []
    for cell, arms in result.cells.items():
        for arm, s in arms.items():
            paired = ratios.get(cell, {}).get(inline_of[arm]) if arm in inline_of else None
            rows.append([
                cell.label, arm.value, str(s.requests), fmt(s.output_tokens / max(s.requests, 1), digits=0),
                f"{_ms(s.ttft['p50'])} / {_ms(s.ttft['p90'])} / {_ms(s.ttft['p99'])}",
                f"{_ms(s.itl['p50'])} / {_ms(s.itl['p99'])}", _ms(s.tpot["p50"]), _ms(s.e2e["p50"]),
                fmt(s.cpu_generate, digits=0), fmt(s.cpu_derender, digits=0), fmt(s.cpu_client, digits=0),
                _x(paired.e2e_p50) if paired else "—", _x(paired.server_cpu_per_token) if paired else "—",
            ])
    return markdown_table(headers, rows)


def headline_table(ratios: dict[Cell, dict[Arm, Ratios]]) -> str:
    headers = ["cell", "inline arm vs its per-chunk baseline", "E2E p50", "TTFT p50", "ITL p99", "server CPU / token"]
    rows = [[cell.label, arm.value, _x(r.e2e_p50), _x(r.ttft_p50), _x(r.itl_p99), _x(r.server_cpu_per_token)]
            for cell, by_arm in ratios.items() for arm, r in by_arm.items()]
    return markdown_table(headers, rows)


def _span(values: Sequence[float]) -> str:
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return "—"
    low, high = min(finite), max(finite)
    return f"{low:.2f}×" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}–{high:.2f}×"


def summary_paragraph(result: RunResult, ratios: dict[Cell, dict[Arm, Ratios]]) -> str:
    """What the numbers say, written from the numbers, naming every cell where inline does not win."""
    sentences = []
    for baseline, inline in PAIRS:
        found = [(cell, by_arm[inline]) for cell, by_arm in ratios.items() if inline in by_arm]
        if not found:
            continue
        sentences.append(
            f"Across cells, {baseline.value} took {_span([r.e2e_p50 for _, r in found])} the E2E p50 of "
            f"{inline.value}, {_span([r.ttft_p50 for _, r in found])} its TTFT p50 and "
            f"{_span([r.server_cpu_per_token for _, r in found])} its server CPU per output token."
        )
        for what, attr in (("faster at E2E p50", "e2e_p50"), ("cheaper in server CPU per token",
                                                               "server_cpu_per_token")):
            losses = [cell.label for cell, r in found if getattr(r, attr) < 1.0]
            if losses:
                sentences.append(f"{inline.value} was not {what} in {'; '.join(losses)}.")
    growth = _growth_sentence(result)
    return " ".join(sentences + ([growth] if growth else []))


def _per_length(result: RunResult, arm: Arm, cpu_of: str) -> dict[int, float]:
    """Mean over concurrency levels of one CPU column (an ``ArmSummary`` attribute), by output length."""
    values: dict[int, list[float]] = {}
    for cell, arms in result.cells.items():
        if arm in arms:
            values.setdefault(cell.length, []).append(getattr(arms[arm], cpu_of))
    return {n: sum(v) / len(v) for n, v in sorted(values.items())}


def _growth_sentence(result: RunResult) -> str:
    """How per-token cost moves with output length: the replaying baseline does O(n) work per chunk."""
    baseline = _per_length(result, Arm.TOKENS_CHAT_DERENDER, "cpu_derender")
    inline = _per_length(result, Arm.DERENDER, "cpu_generate")
    reference = _per_length(result, Arm.TOKENS, "cpu_generate")
    if len(baseline) < 2 or len(inline) < 2:
        return ""

    def steps(values: dict[int, float]) -> str:
        return " → ".join(f"{v:.0f} µs (N={n})" for n, v in values.items())

    sentence = (f"Per output token the chat derender server spent {steps(baseline)}, because each chunk replays "
                f"every earlier output id, while the generate server serving inline derender spent {steps(inline)}")
    if len(reference) >= 2:
        sentence += f" (tokens only: {steps(reference)})"
    return sentence + "."


def command_line(profile: Profile, arms: Sequence[Arm], seed: int) -> str:
    """The exact flags that reproduce this run, whatever defaults were filled in."""
    parts = ["pdserve", "bench", "frontend",
             "--lengths", ",".join(map(str, profile.lengths)),
             "--concurrency", ",".join(map(str, profile.concurrency)),
             "--rounds", str(profile.rounds), "--step-ms", f"{profile.step_ms:g}",
             "--scripts-per-length", str(profile.scripts_per_length),
             "--time-budget-s", f"{profile.time_budget_s:g}", "--seed", str(seed)]
    if tuple(arms) != tuple(Arm):
        parts += ["--arms", ",".join(a.name.lower() for a in arms)]
    return " ".join(parts)



def server_commands(profile: Profile) -> tuple[str, str]:
    """The two server command lines of a run, built from the arguments the run starts them with."""
    generate = " ".join(["pdserve", *generate_server_args(profile, "SCRIPTS.jsonl")])
    return generate, " ".join(["pdserve", *DERENDER_SERVER_ARGS])


def docs_section(result: RunResult, command: str, ratios: dict[Cell, dict[Arm, Ratios]]) -> str:
    """The body of this benchmark's section in docs/benchmarks.md (the heading is added on write)."""
    p = result.profile
    generate, derender = server_commands(p)
    headline = [
        summary_paragraph(result, ratios),
        "",
        "Baseline ÷ inline, measured in the same run (above 1× the inline arm is better):",
        "",
        headline_table(ratios),
        "",
    ] if ratios else []
    return "\n".join([
        *headline,
        "All arms (latencies measured by the client; CPU per output token of each process tree):",
        "",
        results_table(result, ratios),
        "",
        f"This run (how each number is measured, and its caveats: {METHODOLOGY_LINK}):",
        "",
        (f"* Generate server `{generate}` (`SCRIPTS.jsonl`: this run's outputs) and derender server `{derender}`, "
         f"both on 127.0.0.1. **The scripted engine's pace, one token every {p.step_ms:g} ms per request whatever "
         "the batch, stands in for the GPU**; everything after the engine is real."),
        (f"* Workload: {p.scripts_per_length} Qwen3 outputs per output length N "
         f"({', '.join(map(str, p.lengths))} tokens), C = {', '.join(map(str, p.concurrency))} concurrent streams "
         "per cell."),
        (f"* Correctness: {result.checked} requests (warm-up included) matched their script, and {result.compared} "
         "text/message outputs were exactly equal across arms on the same script."),
        (f"* Rounds completed: {result.rounds_done} of {p.rounds}; wall time {result.wall_s:.0f} s including server "
         "startup."),
        "",
        "```",
        command,
        "```",
        "",
        f"Run on {datetime.now(UTC):%Y-%m-%d} (UTC), {machine()}.",
    ])


def result_json(result: RunResult, command: str, ratios: dict[Cell, dict[Arm, Ratios]]) -> dict[str, Any]:
    """Raw numbers for ``--json``: latencies in seconds, CPU in µs per output token."""
    return {
        "command": command,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "profile": asdict(result.profile),
        "rounds_done": result.rounds_done,
        "wall_s": result.wall_s,
        "correctness": {"requests_checked": result.checked, "outputs_compared_across_arms": result.compared},
        "scripts": [{"length": s.length, "kind": s.kind, "tokens": s.tokens} for s in result.scripts],
        "cells": [
            {
                "length": cell.length,
                "concurrency": cell.concurrency,
                "arms": {arm.name.lower(): {"label": arm.value, **asdict(s)} for arm, s in arms.items()},
                "baseline_over_inline": {arm.name.lower(): asdict(r) for arm, r in ratios.get(cell, {}).items()},
            }
            for cell, arms in result.cells.items()
        ],
    }

