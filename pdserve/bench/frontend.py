"""``pdserve bench frontend``: inline output vs the per-chunk ``/derender`` round trip, side by side.

The RFC claims that a decode server returning text (``output_mode="text"``) or
parsed chat deltas (``output_mode="derender"``) beats the vLLM baseline, where
the client streams ``tokens`` and POSTs every SSE chunk to a stateless derender
server that replays the output so far on each call. Only ratios measured in the
same run survive a noisy shared 2-core host, so one run starts two real servers
(a scripted generate server whose ``--step-ms`` pace stands in for the GPU, and a
``launch render`` server for render/derender), drives five client arms
interleaved round by round, and records client-side TTFT/ITL/TPOT/E2E plus each
server's CPU per output token from ``/proc``. Every request's output is checked
against the script it replays and against the other arms, so a fast but wrong
path cannot win.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from pdserve.bench.loadgen import (
    Arm,
    ArmClient,
    BenchError,
    Job,
    RequestRecord,
    Script,
    ServerProcess,
    assemble_message,
    build_scripts,
    chat_request,
    rendered_jobs,
    start_all,
)
from pdserve.bench.report import (
    ArmSummary,
    ArmTotals,
    fmt,
    markdown_table,
    ratio,
    request_latency,
    write_section,
)
from pdserve.text.tokenizer import Tokenizer

SECTION_HEADING = "## Inline vs per-chunk derender (pdserve bench frontend)"
DEFAULT_DOCS = Path("docs/benchmarks.md")
PARSER_FLAGS = ("--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--enable-auto-tool-choice")
# Each baseline and the inline arm that returns the same output with one hop instead of two per chunk.
PAIRS = ((Arm.TOKENS_COMPLETIONS_DERENDER, Arm.TEXT), (Arm.TOKENS_CHAT_DERENDER, Arm.DERENDER))


@dataclass(frozen=True)
class Profile:
    """The knobs of one run; the defaults and ``--quick`` are two profiles."""

    lengths: tuple[int, ...]
    concurrency: tuple[int, ...]
    rounds: int
    step_ms: float
    scripts_per_length: int
    time_budget_s: float


# Sized for a 2-vCPU host: the chat-derender arm at N=1024, C=4 is CPU-bound and dominates the run.
DEFAULT_PROFILE = Profile(lengths=(256, 1024), concurrency=(1, 4), rounds=2, step_ms=5.0, scripts_per_length=4,
                          time_budget_s=150.0)
QUICK_PROFILE = Profile(lengths=(64,), concurrency=(1, 2), rounds=1, step_ms=2.0, scripts_per_length=2,
                        time_budget_s=30.0)


# ---------------------------------------------------------------- correctness


class Verifier:
    """Fails the run on the first request whose output differs from its script or from another arm.

    Text must equal the script decoded the way completions clients see it; a message must
    carry the script's reasoning, content and tool call. On top of that every output must
    equal, exactly (strings, tool-call argument text, finish_reason), the first output of
    the same script and kind from any arm. Every arm runs the same requests in each round,
    so each baseline is compared with the inline arm whenever both are selected.
    """

    def __init__(self, tokenizer: Tokenizer, scripts: Sequence[Script]):
        self._tokenizer = tokenizer
        self._scripts = scripts
        self._ids = [tokenizer.encode(s.output) for s in scripts]
        self._first: dict[tuple[int, str], tuple[Arm, Any, str | None]] = {}
        self.checked = 0
        self.compared = 0

    def check(self, record: RequestRecord) -> None:
        script, ids = self._scripts[record.script_index], self._ids[record.script_index]
        where = f"{record.arm.value}, script {record.script_index} ({script.kind}, {script.tokens} tokens)"
        if record.token_ids != ids:
            raise BenchError(f"{where}: token ids differ from the script ({len(record.token_ids)} vs {len(ids)})")
        if record.output_tokens != len(ids):
            raise BenchError(f"{where}: {record.output_tokens} token ids arrived, the script has {len(ids)}")
        kind = record.arm.output_kind
        output: Any = None
        if kind == "text":
            output = record.text
            expected = self._tokenizer.decode(ids[:-1], skip_special_tokens=True)
            if output != expected:
                raise BenchError(f"{where}: text differs from the script:\n{output[:300]!r}\n{expected[:300]!r}")
        elif kind == "message":
            output = assemble_message(record.deltas)
            self._check_message(where, output, script)
        self.checked += 1
        if kind != "ids":
            self._compare(record, kind, output, where)

    @staticmethod
    def _check_message(where: str, message: dict[str, Any], script: Script) -> None:
        if (message["reasoning"] or "").strip() != script.reasoning.strip():
            raise BenchError(f"{where}: reasoning differs from the script: {(message['reasoning'] or '')[:300]!r}")
        if message["content"].strip() != script.content.strip():
            raise BenchError(f"{where}: content differs from the script: {message['content'][:300]!r}")
        calls = [(name, json.loads(arguments)) for name, arguments in message["tool_calls"]]
        if calls != ([script.tool_call] if script.tool_call else []):
            raise BenchError(f"{where}: tool calls differ from the script: {message['tool_calls']!r}")

    def _compare(self, record: RequestRecord, kind: str, output: Any, where: str) -> None:
        first = self._first.setdefault((record.script_index, kind), (record.arm, output, record.finish_reason))
        if first[1:] != (output, record.finish_reason):
            raise BenchError(f"{where}: differs from {first[0].value} on the same script:\n"
                             f"{(output, record.finish_reason)!r}\n{first[1:]!r}")
        self.compared += 1


# ---------------------------------------------------------------- the run


@dataclass(frozen=True)
class Cell:
    length: int
    concurrency: int

    @property
    def label(self) -> str:
        return f"N={self.length}, C={self.concurrency}"


@dataclass
class RunResult:
    profile: Profile
    scripts: list[Script]
    cells: dict[Cell, dict[Arm, ArmSummary]]
    rounds_done: int
    wall_s: float
    checked: int
    compared: int


class CpuMeter:
    """CPU seconds of the generate server, the derender server and this client, read together."""

    def __init__(self, generate: ServerProcess, derender: ServerProcess):
        self._generate = generate
        self._derender = derender

    def read(self) -> tuple[float, float, float]:
        return self._generate.cpu_seconds(), self._derender.cpu_seconds(), time.process_time()


async def run_arm(
    arm_client: ArmClient, meter: CpuMeter, arm: Arm, jobs: Sequence[Job], totals: ArmTotals, verifier: Verifier
) -> None:
    """``len(jobs)`` concurrent requests of one arm, charged the CPU both servers spent meanwhile.

    Arms never overlap, so a server's CPU between the two reads belongs to this arm alone.
    """
    before = meter.read()
    records = await asyncio.gather(*(arm_client.run(arm, job) for job in jobs))
    after = meter.read()
    totals.cpu_generate_s += after[0] - before[0]
    totals.cpu_derender_s += after[1] - before[1]
    totals.cpu_client_s += after[2] - before[2]
    for record in records:
        verifier.check(record)
        totals.latencies.append(request_latency(record.start, record.arrivals, record.end))
        totals.output_tokens += record.output_tokens


async def run_rounds(
    profile: Profile, arms: Sequence[Arm], jobs: Sequence[Job], scripts: Sequence[Script],
    generate: ServerProcess, derender: ServerProcess, verifier: Verifier, timeout_s: float,
) -> tuple[dict[Cell, dict[Arm, ArmTotals]], int]:
    """Rounds → cells → arms (order rotated), so drift and noise spread over every arm and cell.

    Rounds are the outer loop so that, when the time budget stops the run early, every
    cell has completed the same number of rounds. Round 1 always runs in full.
    """
    cells = [Cell(n, c) for n in profile.lengths for c in profile.concurrency]
    results = {cell: {arm: ArmTotals() for arm in arms} for cell in cells}
    by_length = {n: [j for j in jobs if scripts[j.script_index].length == n] for n in profile.lengths}
    meter = CpuMeter(generate, derender)
    limits = httpx.Limits(max_connections=2 * max(profile.concurrency) + 4, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=timeout_s) as client:
        arm_client = ArmClient(client, generate.url, derender.url)
        for arm in arms:  # first-request costs (connections, lazy imports) stay out of the numbers
            await run_arm(arm_client, meter, arm, by_length[min(profile.lengths)][:1], ArmTotals(), verifier)
        deadline = time.monotonic() + profile.time_budget_s
        rounds_done = 0
        for r in range(profile.rounds):
            if r and time.monotonic() > deadline:
                break
            for k, cell in enumerate(cells):
                pool = by_length[cell.length]
                batch = [pool[(r * cell.concurrency + w) % len(pool)] for w in range(cell.concurrency)]
                shift = (r + k) % len(arms)
                for arm in [*arms[shift:], *arms[:shift]]:
                    await run_arm(arm_client, meter, arm, batch, results[cell][arm], verifier)
            rounds_done += 1
    return results, rounds_done


def run(profile: Profile, arms: tuple[Arm, ...], seed: int, timeout_s: float) -> RunResult:
    """Start both servers, replay the workload through every arm, stop the servers."""
    started = time.monotonic()
    tokenizer = Tokenizer.load("qwen3")
    scripts = build_scripts(tokenizer, profile.lengths, profile.scripts_per_length, seed)
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-") as tmp:
        script_file = Path(tmp) / "scripts.jsonl"
        script_file.write_text("".join(json.dumps({"text": s.output}, ensure_ascii=False) + "\n" for s in scripts))
        generate = ServerProcess("generate", [
            "serve", "--engine", "scripted", "--tokenizer", "qwen3", "--script", str(script_file),
            "--tokens-per-step", "1", "--step-ms", f"{profile.step_ms:g}", *PARSER_FLAGS,
            "--max-num-seqs", str(max(64, *profile.concurrency)),
        ])
        derender = ServerProcess("derender", ["launch", "render", "--tokenizer", "qwen3", *PARSER_FLAGS])
        try:
            start_all([generate, derender])
            jobs = rendered_jobs(derender.url, [chat_request(s, i) for i, s in enumerate(scripts)])
            verifier = Verifier(tokenizer, scripts)
            totals, rounds_done = asyncio.run(
                run_rounds(profile, arms, jobs, scripts, generate, derender, verifier, timeout_s)
            )
        except httpx.HTTPError as e:
            raise BenchError(f"HTTP failure ({e!r}); generate server log:\n{generate.log_tail()}\n"
                             f"derender server log:\n{derender.log_tail()}") from e
        finally:
            generate.stop()
            derender.stop()
    cells = {cell: {arm: t.summary() for arm, t in by_arm.items()} for cell, by_arm in totals.items()}
    return RunResult(profile, scripts, cells, rounds_done, time.monotonic() - started, verifier.checked,
                     verifier.compared)


# ---------------------------------------------------------------- report


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


def machine() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
    cpu = f"{os.cpu_count()} vCPU" + (f" ({model})" if model else "")
    return f"{cpu}, Linux {platform.release()}, Python {platform.python_version()}"


def docs_section(result: RunResult, command: str, ratios: dict[Cell, dict[Arm, Ratios]]) -> str:
    """The body of this benchmark's section in docs/benchmarks.md (the heading is added on write)."""
    p = result.profile
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
        "How it was measured:",
        "",
        ("* Two real processes on 127.0.0.1: a generate server (`pdserve serve --engine scripted --tokenizer qwen3 "
         f"--tokens-per-step 1 --step-ms {p.step_ms:g} --max-num-seqs 64`, qwen3 reasoning + hermes tool parsers) and "
         "a render/derender server (`pdserve launch render`, same parser flags). **The scripted engine's pace, one "
         f"token every {p.step_ms:g} ms per request whatever the batch, stands in for the GPU**; everything after "
         "the engine is real."),
        (f"* Workload: {p.scripts_per_length} Qwen3 outputs per output length N, alternating reasoning + markdown "
         "answer and reasoning + hermes `run_python` tool call, each ending with `<|im_end|>`; prompts (system "
         "prompt + 3 tools) rendered once by `/v1/chat/completions/render`. A cell is N × C concurrent streams. In "
         "each round every arm runs the same requests, arms rotate their order, and rounds sweep all cells, so "
         "machine noise hits every arm alike."),
        ("* Client: one asyncio loop, one `httpx.AsyncClient` (HTTP/1.1 keep-alive). Baselines stream `tokens` and "
         "POST every SSE chunk to the derender server in order, echoing `stream_state` (chat: plus `chat_request` "
         "and the full `prompt_token_ids`); their tokens count as arrived when the chunk's derender answer is back."),
        ("* TTFT: first chunk carrying token ids. ITL: gaps between token arrivals counted by `token_ids`, not "
         "visible text (a chunk releasing k ids adds k-1 zero gaps). TPOT: (last − first token) / (tokens − 1). "
         "E2E: until `[DONE]` and the last derender answer."),
        ("* CPU: utime+stime of each server's process tree (`/proc/<pid>/stat`) around each arm's batch, divided by "
         "its output tokens. The generate server's figure includes the scripted engine's own stepping (the tokens "
         f"arm shows that floor). The client shares the machine's {os.cpu_count()} vCPUs with both servers, so "
         "its CPU is listed too: the baselines' per-chunk requests cost the client as well."),
        (f"* Correctness: {result.checked} requests (warm-up included) matched their script (token ids, text, "
         f"reasoning, content, tool call), and {result.compared} text/message outputs were exactly equal (strings, "
         "tool-call argument text, finish_reason) across arms on the same script (every arm runs the same requests "
         "in each round)."),
        ("* Why the two baselines differ: streaming `/v1/completions/derender` replays only the last few ids per "
         "chunk (constant work), so while the derender server keeps up with the engine's pace E2E is set by the "
         "pace and the round trip shows in TTFT, ITL tails and CPU; streaming `/v1/chat/completions/derender` "
         "replays every earlier output id into a fresh parser per chunk (O(n)), so its cost grows with length "
         "and one derender process saturates as concurrency rises."),
        ("* `req` is the number of requests behind each row: TTFT/E2E percentiles over a handful of requests are "
         "indicative; ITL percentiles are over every token gap. An idle server can show a few µs/token of CPU "
         "from clock-tick (10 ms) rounding."),
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


# ---------------------------------------------------------------- CLI


def _int_list(value: str) -> tuple[int, ...]:
    try:
        items = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from None
    if not items or any(v < 1 for v in items):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {value!r}")
    return items


def _arm_list(value: str) -> tuple[Arm, ...]:
    names = {a.name.lower(): a for a in Arm}
    try:
        arms = tuple(names[v.strip().lower()] for v in value.split(",") if v.strip())
    except KeyError as e:
        raise argparse.ArgumentTypeError(f"unknown arm {e.args[0]!r}; choose from {', '.join(names)}") from None
    if not arms:
        raise argparse.ArgumentTypeError("--arms selects no arm")
    return arms


def add_frontend_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``pdserve bench frontend``; unset ones come from the default or the ``--quick`` profile."""
    d = DEFAULT_PROFILE
    parser.add_argument("--quick", action="store_true",
                        help="sub-minute smoke run (tiny outputs, 1-2 requests per arm); writes docs only with --docs")
    parser.add_argument("--lengths", type=_int_list, help=f"output lengths in tokens, comma-separated "
                        f"(default {','.join(map(str, d.lengths))})")
    parser.add_argument("--concurrency", type=_int_list, help="concurrent streams per cell, comma-separated "
                        f"(default {','.join(map(str, d.concurrency))})")
    parser.add_argument("--rounds", type=int, help=f"rounds; each runs every arm in every cell (default {d.rounds})")
    parser.add_argument("--step-ms", type=float, help=f"scripted engine pace in ms per token (default {d.step_ms:g})")
    parser.add_argument("--scripts-per-length", type=int,
                        help=f"distinct outputs per length (default {d.scripts_per_length})")
    parser.add_argument("--time-budget-s", type=float, help="start no new round after this many seconds "
                        f"(default {d.time_budget_s:g}); round 1 always completes")
    parser.add_argument("--arms", type=_arm_list, default=tuple(Arm),
                        help="comma-separated subset of: " + ", ".join(a.name.lower() for a in Arm))
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--request-timeout-s", type=float, default=300.0, help="per HTTP request")
    parser.add_argument("--json", type=Path, default=None, help="also write the raw results as JSON here")
    parser.add_argument("--docs", type=Path, default=None,
                        help=f"markdown file whose '{SECTION_HEADING.removeprefix('## ')}' section is replaced "
                        f"(default {DEFAULT_DOCS}, or none with --quick)")
    parser.add_argument("--no-docs", action="store_true", help="do not write any docs file")


def resolve_profile(args: argparse.Namespace) -> Profile:
    """The profile (``--quick`` or default) with every explicitly given flag applied on top."""
    base = QUICK_PROFILE if args.quick else DEFAULT_PROFILE
    profile = Profile(
        lengths=args.lengths or base.lengths,
        concurrency=args.concurrency or base.concurrency,
        rounds=base.rounds if args.rounds is None else args.rounds,
        step_ms=base.step_ms if args.step_ms is None else args.step_ms,
        scripts_per_length=base.scripts_per_length if args.scripts_per_length is None else args.scripts_per_length,
        time_budget_s=base.time_budget_s if args.time_budget_s is None else args.time_budget_s,
    )
    if profile.rounds < 1 or profile.scripts_per_length < 1 or profile.step_ms < 0:
        raise BenchError("--rounds and --scripts-per-length must be >= 1 and --step-ms >= 0")
    return profile


def run_frontend_bench(args: argparse.Namespace) -> int:
    """Run the benchmark, print the section, write docs/JSON. 0 on success, 1 when the run failed."""
    try:
        profile = resolve_profile(args)
        command = command_line(profile, args.arms, args.seed)
        print(f"running: {command}", flush=True)
        result = run(profile, tuple(args.arms), args.seed, args.request_timeout_s)
    except BenchError as e:
        print(f"pdserve bench frontend: FAILED: {e}", file=sys.stderr)
        return 1
    ratios = pair_ratios(result)
    section = docs_section(result, command, ratios)
    print(SECTION_HEADING + "\n\n" + section)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result_json(result, command, ratios), indent=2))
        print(f"wrote {args.json}")
    docs = None if args.no_docs else (args.docs or (None if args.quick else DEFAULT_DOCS))
    if docs is not None:
        write_section(docs, SECTION_HEADING, section)
        print(f"wrote {docs}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench frontend",
                                     description="inline output vs per-chunk derender, side by side")
    add_frontend_args(parser)
    return run_frontend_bench(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
