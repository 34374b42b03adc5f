"""``pdserve bench scenarios``: every performance figure of docs/benchmarks.md, each measured side by side.

A :class:`Scenario` is data (what it asks, what it needs) plus an orchestration function that starts
its servers, runs ``bench serve`` arms interleaved in one run, and returns a :class:`Section` (the
Markdown, the plots it wrote, one headline sentence read off its numbers); a new scenario is one more
entry in :data:`SCENARIOS`. A scenario that fails is reported in the document and the others still
run. ``make bench`` runs the quick profile.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pdserve.bench import workload
from pdserve.bench.loadgen import Arm, Prompt
from pdserve.bench.report import fmt, machine, ratio
from pdserve.bench.results import results_table
from pdserve.bench.serve_bench import arms_from_args, build_parser, measure, render_prompts, server_urls
from pdserve.bench.servers import BenchError, start_all
from pdserve.topology.process import ServerProcess

DEFAULT_DOCS = Path("docs/benchmarks.md")
PARSERS = ("--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--enable-auto-tool-choice")
# The tier baseline replays every earlier id on each chunk (O(n²) per request): above this it takes minutes.
TIER_MAX_LEN = 1024


@dataclass(frozen=True)
class Profile:
    """Sizes of one scenarios run; ``QUICK`` is what ``make bench`` runs (a few minutes on 2 cores)."""

    name: str
    torch_concurrency: tuple[int, ...]
    torch_output_len: int
    scripted_concurrency: tuple[int, ...]
    scripted_len: int
    growth_lengths: tuple[int, ...]
    growth_concurrency: int
    smol_concurrency: tuple[int, ...]
    smol_output_len: int
    num_prompts: int  # per arm and load: at least this many, and ``waves`` × the load's concurrency
    waves: int
    rounds: int
    step_ms: float
    engine_repeats: int
    engine_max_tokens: int


FULL = Profile("full", torch_concurrency=(1, 8, 32, 64), torch_output_len=64, scripted_concurrency=(8, 32),
               scripted_len=512, growth_lengths=(256, 1024, 4096, 8192), growth_concurrency=4,
               smol_concurrency=(1, 4), smol_output_len=64, num_prompts=16, waves=2, rounds=2, step_ms=5.0,
               engine_repeats=3, engine_max_tokens=128)
QUICK = Profile("quick", torch_concurrency=(1, 8, 32, 64), torch_output_len=32, scripted_concurrency=(8, 32),
                scripted_len=256, growth_lengths=(256, 1024, 4096), growth_concurrency=2,
                smol_concurrency=(1, 4), smol_output_len=24, num_prompts=4, waves=1, rounds=1, step_ms=5.0,
                engine_repeats=1, engine_max_tokens=32)
# Seconds per scenario: for trying the orchestration, not for numbers.
SMOKE = Profile("smoke", torch_concurrency=(1, 2), torch_output_len=8, scripted_concurrency=(2,), scripted_len=64,
                growth_lengths=(64, 256), growth_concurrency=1, smol_concurrency=(1,), smol_output_len=8,
                num_prompts=2, waves=1, rounds=1, step_ms=2.0, engine_repeats=1, engine_max_tokens=8)
PROFILES = {p.name: p for p in (FULL, QUICK, SMOKE)}


@dataclass
class Section:
    """What one scenario contributes to docs/benchmarks.md."""

    body: str
    headline: str
    results: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class Scenario:
    key: str
    title: str
    question: str
    run: Callable[[Profile, Path], Section]
    needs: str = ""  # parts of pdserve beyond one server it depends on (shown with its section)


# ---------------------------------------------------------------- helpers


@contextlib.contextmanager
def running(*servers: ServerProcess) -> Iterator[None]:
    try:
        start_all(servers, timeout_s=300)
        yield
    finally:
        for server in servers:
            server.stop()


def bench(flags: Sequence[str], servers: Sequence[ServerProcess], arms: Sequence[Arm] | None = None,
          prompts: Sequence[Prompt] | None = None) -> tuple[dict[str, Any], str]:
    """One ``bench serve`` run (the result and its command line) against ``servers``, CPU read by pid."""
    args = build_parser().parse_args([*flags, "--idle-window-s", "1"])
    chosen = list(arms) if arms is not None else arms_from_args(args)
    by_url = {s.url: s for s in servers}
    missing = [u for u in server_urls(chosen) if u not in by_url]
    if missing:
        raise BenchError(f"the scenario started no server for {missing}")
    args.server_pid = [by_url[u].pid for u in server_urls(chosen)]  # CPU read by pid, not by port
    command = "pdserve bench serve " + shlex.join(flags)
    if arms is not None:
        command += "  # arms: " + "; ".join(a.label for a in arms)
    result = measure(args, command, chosen, prompts)
    check_result(result)
    return result, command


def check_result(result: Mapping[str, Any]) -> None:
    """A scenario's numbers count only if every request completed and every arm of a load produced the
    same number of tokens from the same prompts (a path that drops or invents tokens must not win)."""
    by_load: dict[str, set[int]] = {}
    for c in result["cells"]:
        if c["failed"]:
            raise BenchError(f"{c['label']} at {c['load']}: {c['failed']} requests failed: {c['errors']}")
        by_load.setdefault(c["load"], set()).add(c["total_output_tokens"])
    for load, totals in by_load.items():
        if len(totals) > 1:
            raise BenchError(f"at {load} the arms produced different token totals from the same prompts: {totals}")


def bench_per_load(base: Sequence[str], concurrency: Sequence[int], p: Profile, servers: Sequence[ServerProcess],
                   arms: Sequence[Arm] | None = None, prompts_for: Callable[[int], list[Prompt]] | None = None,
                   ) -> tuple[dict[str, Any], list[str]]:
    """One ``bench serve`` run per concurrency (each with enough prompts to fill it ``waves`` times),
    merged into one result; the arms are interleaved within each run."""
    merged: dict[str, Any] | None = None
    commands = []
    for c in concurrency:
        n = max(p.num_prompts, p.waves * c)
        flags = [*base, "--max-concurrency", str(c), "--num-prompts", str(n), "--rounds", str(p.rounds),
                 "--num-warmups", "2"]
        result, command = bench(flags, servers, arms, prompts_for(n * p.rounds) if prompts_for else None)
        merged = result if merged is None else {**merged, "cells": merged["cells"] + result["cells"]}
        commands.append(command)
    assert merged is not None
    return merged, commands


def server_command(server: ServerProcess) -> str:
    """The server's command line as an operator would type it (the port is the run's own; the
    scenario's generated script file is named SCRIPTS.jsonl)."""
    args = ["SCRIPTS.jsonl" if a.endswith("scripts.jsonl") else a for a in server.args]
    return "pdserve " + shlex.join(args)


def cell(result: Mapping[str, Any], label: str, concurrency: int | None = None) -> Mapping[str, Any]:
    """The cell of arm ``label`` at ``concurrency`` (default: the highest the run has)."""
    cells = [c for c in result["cells"] if c["label"] == label]
    if not cells:
        raise BenchError(f"no cell for arm {label!r}")
    if concurrency is None:
        return max(cells, key=lambda c: c["max_concurrency"] or 0)
    return next(c for c in cells if c["max_concurrency"] == concurrency)


def _x(value: float) -> str:
    return fmt(value, digits=2, suffix="×")


def _us(value: float) -> str:
    return fmt(value, digits=0, suffix=" µs")


def _ms(value: float) -> str:
    return fmt(value, digits=1, suffix=" ms")


def _image(path: Path, docs_dir: Path, alt: str) -> str:
    return f"![{alt}]({path.relative_to(docs_dir).as_posix()})"


def setup_lines(servers: Sequence[ServerProcess], commands: Sequence[str]) -> str:
    lines = ["```", *(server_command(s) for s in servers), *commands, "```"]
    return "\n".join(lines)


def scripted_server(name: str, script_file: Path, step_ms: float, *extra: str) -> ServerProcess:
    return ServerProcess(name, ["serve", "--engine", "scripted", "--tokenizer", "qwen3", "--script", str(script_file),
                                "--step-ms", f"{step_ms:g}", *PARSERS, "--max-num-seqs", "128",
                                "--enable-per-request-metrics", *extra])


# ---------------------------------------------------------------- the scenarios


def modes_on_torch(p: Profile, docs: Path) -> Section:
    """(1) tokens vs text vs derender, streamed, on the torch engine in its core process."""
    server = ServerProcess("torch", ["serve", "qwen3-tiny", "--max-num-seqs", "64", "--reasoning-parser", "qwen3",
                                     "--enable-per-request-metrics"])
    with running(server):
        flags = ["--base-url", server.url, "--output-mode", "tokens,text,derender", "--random-input-len", "64",
                 "--random-output-len", str(p.torch_output_len), "--ignore-eos", "--goodput", "ttft:1000", "tpot:100"]
        result, commands = bench_per_load(flags, p.torch_concurrency, p, [server])
    from pdserve.bench.plots import itl_distribution, latency_vs_concurrency

    lat = latency_vs_concurrency(result, docs / "bench-modes-latency.png", "qwen3-tiny, torch engine core process")
    itl = itl_distribution(result, docs / "bench-modes-itl.png", "ITL at the highest concurrency")
    tokens, text, derender = (cell(result, m) for m in ("tokens", "text", "derender"))
    c = tokens["max_concurrency"]
    headline = (f"At C={c}, text and derender took {_x(ratio(text['median_tpot_ms'], tokens['median_tpot_ms']))} and "
                f"{_x(ratio(derender['median_tpot_ms'], tokens['median_tpot_ms']))} the TPOT p50 of tokens, at "
                f"{_us(text['api_cpu_us_per_output_token'])} and {_us(derender['api_cpu_us_per_output_token'])} "
                f"of API CPU per token against {_us(tokens['api_cpu_us_per_output_token'])} (engine core: "
                f"{_us(tokens['engine_cpu_us_per_output_token'])}).")
    body = "\n\n".join([headline, results_table(result), _image(lat, docs, "latency vs concurrency"),
                        _image(itl, docs, "ITL distribution"), setup_lines([server], commands)])
    return Section(body, headline, [result])


def _scripted_prompts(url: str, scripts: Sequence[workload.Script], length: int, count: int) -> list[Prompt]:
    chats = [workload.chat_request(s, i) for i, s in enumerate(scripts) if s.length == length]
    rendered = render_prompts(url, chats, [None] * len(chats), ignore_eos=False)
    return [rendered[i % len(rendered)] for i in range(count)]


@contextlib.contextmanager
def scripts_file(lengths: Sequence[int], per_length: int) -> Iterator[tuple[Path, list[workload.Script]]]:
    from pdserve.text.tokenizer import Tokenizer

    scripts = workload.build_scripts(Tokenizer.load("qwen3"), lengths, per_length, seed=0)
    with tempfile.TemporaryDirectory(prefix="pdserve-scenario-") as tmp:
        path = Path(tmp) / "scripts.jsonl"
        workload.write_script_file(str(path), scripts)
        yield path, scripts


def mixed_traffic(p: Profile, docs: Path) -> Section:
    """(3) tokens traffic alone vs mixed with 50% text/derender traffic, on one scripted server."""
    with scripts_file((p.scripted_len,), 4) as (path, scripts):
        server = scripted_server("mixed", path, p.step_ms)
        with running(server):
            arms = [Arm("tokens alone", server.url), Arm("mixed: 50% tokens, 25% text, 25% derender", server.url,
                                                         modes=("tokens", "text", "tokens", "derender"))]
            result, commands = bench_per_load(
                ["--base-url", server.url], p.scripted_concurrency, p, [server], arms,
                lambda n: _scripted_prompts(server.url, scripts, p.scripted_len, n))
    rows = []
    for c in p.scripted_concurrency:
        alone, mixed = cell(result, arms[0].label, c), cell(result, arms[1].label, c)
        mixed_tokens = mixed["by_mode"]["tokens"]
        rows.append((c, alone, mixed, mixed_tokens))
    c, alone, mixed, mixed_tokens = rows[-1]
    headline = (f"At C={c}, tokens requests sharing the server with text/derender traffic had TPOT p50 "
                f"{_ms(mixed_tokens['median_tpot_ms'])} and ITL p99 {_ms(mixed_tokens['p99_itl_ms'])}, against "
                f"{_ms(alone['median_tpot_ms'])} and {_ms(alone['p99_itl_ms'])} alone; the mix cost "
                f"{_us(mixed['api_cpu_us_per_output_token'])} of API CPU per token against "
                f"{_us(alone['api_cpu_us_per_output_token'])}.")
    from pdserve.bench.report import markdown_table

    subset = markdown_table(
        ["C", "tokens requests", "TTFT p50", "TPOT p50", "ITL p99"],
        [[str(c), "alone", _ms(a["median_ttft_ms"]), _ms(a["median_tpot_ms"]), _ms(a["p99_itl_ms"])]
         for c, a, _, _ in rows] +
        [[str(c), "in the mix", _ms(t["median_ttft_ms"]), _ms(t["median_tpot_ms"]), _ms(t["p99_itl_ms"])]
         for c, _, _, t in rows])
    from pdserve.bench.plots import itl_distribution

    itl = itl_distribution(result, docs / "bench-mixed-itl.png", "ITL, every request of each arm")
    body = "\n\n".join([headline, "The tokens requests of each arm:", subset, "Every request of each arm:",
                        results_table(result), _image(itl, docs, "ITL distribution"), setup_lines([server], commands)])
    return Section(body, headline, [result])


def logprobs_cost(p: Profile, docs: Path) -> Section:
    """(4) logprobs=20 vs none at the text level."""
    with scripts_file((p.scripted_len,), 4) as (path, scripts):
        server = scripted_server("logprobs", path, p.step_ms)
        with running(server):
            arms = [Arm("text", server.url, modes=("text",)),
                    Arm("text + logprobs=20", server.url, modes=("text",), sampling={"logprobs": 20})]
            result, commands = bench_per_load(
                ["--base-url", server.url], (1, p.scripted_concurrency[0]), p, [server], arms,
                lambda n: _scripted_prompts(server.url, scripts, p.scripted_len, n))
    plain, wide = cell(result, "text"), cell(result, "text + logprobs=20")
    headline = (f"At C={plain['max_concurrency']}, logprobs=20 cost "
                f"{_us(wide['api_cpu_us_per_output_token'])} of API CPU per token against "
                f"{_us(plain['api_cpu_us_per_output_token'])} without "
                f"({_x(ratio(wide['api_cpu_us_per_output_token'], plain['api_cpu_us_per_output_token']))}), "
                f"TPOT p50 {_ms(wide['median_tpot_ms'])} against {_ms(plain['median_tpot_ms'])}.")
    body = "\n\n".join([headline, results_table(result), setup_lines([server], commands)])
    return Section(body, headline, [result])


def growth(p: Profile, docs: Path) -> Section:
    """(5) API CPU per output token at growing output lengths, per output mode and for the tier."""
    lengths = p.growth_lengths
    with scripts_file(lengths, 2) as (path, scripts):
        server = scripted_server("growth", path, 1.0)
        tier = ServerProcess("derender", ["launch", "render", "--tokenizer", "qwen3", *PARSERS])
        results, commands = [], []
        with running(server, tier):
            for n in lengths:
                count = p.growth_concurrency * 2
                prompts = _scripted_prompts(server.url, scripts, n, count)
                arms = [Arm(m, server.url, modes=(m,)) for m in ("tokens", "text", "derender")]
                if n <= TIER_MAX_LEN:
                    arms.append(Arm("tier (tokens + chat /derender per chunk)", server.url,
                                    endpoint="tier", derender_url=tier.url))
                flags = ["--base-url", server.url, "--max-concurrency", str(p.growth_concurrency), "--num-prompts",
                         str(count), "--num-warmups", "1"]
                result, command = bench(flags, [server, tier], arms, prompts)
                result["output_len"] = n
                results.append(result)
                commands.append(f"{command}  (scripts of about {n} tokens)")
    points: dict[str, list[tuple[int, float]]] = {}
    engine: dict[str, list[tuple[int, float]]] = {}
    for result in results:
        for c in result["cells"]:
            points.setdefault(c["label"], []).append((result["output_len"], c["api_cpu_us_per_output_token"]))
            engine.setdefault(c["label"], []).append((result["output_len"], c["engine_cpu_us_per_output_token"]))
    from pdserve.bench.plots import cpu_vs_length

    plot = cpu_vs_length(points, docs / "bench-growth-cpu.png", "scripted engine, C="
                         f"{p.growth_concurrency}", "API CPU µs / output token")
    from pdserve.bench.report import markdown_table

    labels = list(points)
    table = markdown_table(["output tokens", *labels],
                           [[str(n), *(_us(dict(points[label]).get(n, math.nan)) for label in labels)] for n in lengths])
    first, last = lengths[0], lengths[-1]
    parts = [f"{label} {_us(dict(points[label])[first])} → {_us(dict(points[label])[last])}"
             for label in ("tokens", "text", "derender")]
    tier_label = next((label for label in labels if label.startswith("tier")), None)
    headline = f"API CPU per output token from {first} to {last} output tokens: " + "; ".join(parts)
    if tier_label:
        tier_pts = sorted(points[tier_label])
        headline += (f"; the tier baseline {_us(tier_pts[0][1])} → {_us(tier_pts[-1][1])} "
                     f"({tier_pts[0][0]} → {tier_pts[-1][0]} tokens, replaying every earlier id per chunk)")
    headline += "."
    tables = "\n\n".join(f"{r['output_len']} output tokens:\n\n{results_table(r)}" for r in results)
    body = "\n\n".join([headline, ("API CPU µs per output token (idle subtracted; the tier row adds the derender "
                        "server's):"), table, _image(plot, docs, "CPU per token vs output length"), tables,
                        "Engine-core CPU per token, for reference: " + "; ".join(
                            f"{label} {', '.join(_us(v) for _, v in sorted(pts))}" for label, pts in engine.items()),
                        setup_lines([server, tier], commands)])
    return Section(body, headline, results)


def smollm2(p: Profile, docs: Path) -> Section:
    """(6) SmolLM2-135M: tokens vs derender at the pace of a real model."""
    server = ServerProcess("smollm2", ["serve", "smollm2-135m", "--enable-per-request-metrics"])
    with running(server):
        flags = ["--base-url", server.url, "--output-mode", "tokens,derender", "--random-input-len", "48",
                 "--random-output-len", str(p.smol_output_len), "--ignore-eos"]
        result, commands = bench_per_load(flags, p.smol_concurrency, p, [server])
    from pdserve.bench.plots import latency_vs_concurrency

    lat = latency_vs_concurrency(result, docs / "bench-smollm2-latency.png", "SmolLM2-135M, torch engine")
    tokens, derender = cell(result, "tokens"), cell(result, "derender")
    headline = (f"At C={tokens['max_concurrency']}, derender ran at TPOT p50 {_ms(derender['median_tpot_ms'])} "
                f"against {_ms(tokens['median_tpot_ms'])} for tokens "
                f"({_x(ratio(derender['median_tpot_ms'], tokens['median_tpot_ms']))}), E2EL p50 "
                f"{_x(ratio(derender['median_e2el_ms'], tokens['median_e2el_ms']))}, API CPU "
                f"{_us(derender['api_cpu_us_per_output_token'])} against {_us(tokens['api_cpu_us_per_output_token'])} "
                f"per token, next to {_us(tokens['engine_cpu_us_per_output_token'])} in the engine core.")
    body = "\n\n".join([headline, results_table(result), _image(lat, docs, "SmolLM2 latency vs concurrency"),
                        setup_lines([server], commands)])
    return Section(body, headline, [result])


@contextlib.contextmanager
def topology(p: Profile, proxy_modes: Sequence[str]) -> Iterator[dict[str, ServerProcess]]:
    """qwen3-tiny in P/D: a render server, a --tokens-only prefill server and a decode server with the
    KV hand-off on (NIXL), and one ``pdserve proxy`` per mode over them."""
    from pdserve.checkpoints.resolve import resolve_model

    kv = ("--kv-transfer", "nixl")
    members = {
        "render": ServerProcess("render", ["launch", "render", "--tokenizer", str(resolve_model("qwen3-tiny")),
                                           *PARSERS]),
        "prefill": ServerProcess("prefill", ["serve", "qwen3-tiny", "--tokens-only", *kv]),
        "decode": ServerProcess("decode", ["serve", "qwen3-tiny", *kv, *PARSERS, "--max-num-seqs", "64",
                                           "--enable-per-request-metrics"]),
    }
    with running(*members.values()):
        proxies = {f"proxy {mode}": ServerProcess(f"proxy-{mode}", [
            "proxy", "--render", members["render"].url, "--prefill", members["prefill"].url,
            "--decode", members["decode"].url, "--mode", mode]) for mode in proxy_modes}
        with running(*proxies.values()):
            yield {**members, **proxies}


def chat_flags(base_url: str, render_url: str, output_len: int) -> list[str]:
    return ["--base-url", base_url, "--endpoint", "chat", "--render-url", render_url, "--random-input-len", "64",
            "--random-output-len", str(output_len), "--ignore-eos"]


def proxy_tier(p: Profile, docs: Path) -> Section:
    """(2) the proxy's inline mode (decode returns derender output) vs its derender tier (tokens, then the
    render server's /derender per chunk), over the same P/D servers."""
    with topology(p, ("inline", "derender-tier")) as s:
        backends = tuple(s[k].url for k in ("render", "prefill", "decode"))
        arms = [Arm("proxy inline", s["proxy inline"].url, endpoint="chat", backends=backends),
                Arm("proxy derender-tier", s["proxy derender-tier"].url, endpoint="chat", backends=backends)]
        servers = [s["proxy inline"], s["proxy derender-tier"], s["render"], s["prefill"], s["decode"]]
        flags = chat_flags(s["proxy inline"].url, s["render"].url, p.torch_output_len)
        result, commands = bench_per_load(flags, p.smol_concurrency, p, servers, arms)
    inline, tier = cell(result, "proxy inline"), cell(result, "proxy derender-tier")
    cpu = "api_cpu_us_per_output_token"
    headline = (f"At C={inline['max_concurrency']}, the tier took {_x(ratio(tier['median_e2el_ms'], inline['median_e2el_ms']))}"
                f" the E2EL p50 and {_x(ratio(tier['median_ttft_ms'], inline['median_ttft_ms']))} the TTFT p50 of "
                f"inline derender, at {_us(tier[cpu])} against {_us(inline[cpu])} of API CPU per token (proxy, "
                "render, prefill and decode servers together).")
    note = ("API CPU counts every listening process of the proxy and its members; engine CPU the prefill and "
            "decode engine cores.")
    body = "\n\n".join([headline, results_table(result), note, setup_lines(servers, commands)])
    return Section(body, headline, [result])


def prometheus_sum(url: str, name: str) -> float:
    """The sum of every sample of ``name`` (all label sets) on ``url``/metrics; 0 when absent."""
    import httpx

    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def pd_vs_one(p: Profile, docs: Path) -> Section:
    """(7) P/D through the proxy (prefill server, KV pulled over NIXL, decode server) vs the decode server
    answering the same chat requests alone."""
    with topology(p, ("inline",)) as s:
        backends = tuple(s[k].url for k in ("render", "prefill", "decode"))
        arms = [Arm("P/D via proxy", s["proxy inline"].url, endpoint="chat", backends=backends),
                Arm("one server", s["decode"].url, endpoint="chat")]
        servers = [s["proxy inline"], s["render"], s["prefill"], s["decode"]]
        flags = chat_flags(s["proxy inline"].url, s["render"].url, p.torch_output_len)
        result, commands = bench_per_load(flags, p.smol_concurrency, p, servers, arms)
        pulls = prometheus_sum(s["decode"].url, "pdserve_kv_pull_seconds_count")
        pull_s = prometheus_sum(s["decode"].url, "pdserve_kv_pull_seconds_sum")
        failed = prometheus_sum(s["decode"].url, "pdserve_kv_pulls_failed_total")
        tokens = prometheus_sum(s["decode"].url, "pdserve_kv_pulled_tokens_total")
        pulled_bytes = prometheus_sum(s["decode"].url, "pdserve_kv_pulled_bytes_total")
    pd, one = cell(result, "P/D via proxy"), cell(result, "one server")
    per_1k = (f"; per 1k prompt tokens {pulled_bytes / tokens * 1000 / 2**20:.1f} MiB in "
              f"{_ms(pull_s / tokens * 1000 * 1000)}" if tokens else "")
    transfer = (f"{pulls:.0f} KV pulls averaged {_ms(pull_s / pulls * 1000)} (READ start to end){per_1k}, "
                f"{failed:.0f} failed" if pulls else "no KV pull was recorded (the decode server prefilled every "
                "request itself)")
    headline = (f"At C={pd['max_concurrency']}, P/D through the proxy had TTFT p50 {_ms(pd['median_ttft_ms'])} against "
                f"{_ms(one['median_ttft_ms'])} on one server and E2EL p50 "
                f"{_x(ratio(pd['median_e2el_ms'], one['median_e2el_ms']))} of it; {transfer}.")
    body = "\n\n".join([headline, results_table(result), setup_lines(servers, commands)])
    return Section(body, headline, [result])


SCENARIOS = (
    Scenario("1", "Output modes on the torch engine", "What do text and derender cost next to tokens, "
             "streamed at growing concurrency, with a real engine in its own core process?", modes_on_torch),
    Scenario("2", "Inline derender via the proxy vs the derender tier", "Is inline derender through `pdserve "
             "proxy` faster and cheaper than the proxy's tokens + per-chunk /derender baseline?", proxy_tier,
             needs="`pdserve proxy` (inline and derender-tier modes) and the NIXL KV hand-off"),
    Scenario("3", "Tokens traffic alone vs mixed", "Do tokens clients slow down when half the traffic on the "
             "same server asks for text or derender?", mixed_traffic),
    Scenario("4", "logprobs=20 vs none at text", "What do wide decoded logprobs cost the API process?",
             logprobs_cost),
    Scenario("5", "Growth with output length", "How does API CPU per token move from short to long outputs, per "
             "mode, and for the tier baseline that replays every earlier id?", growth),
    Scenario("6", "SmolLM2-135M at a real model's pace", "With a real model setting the pace, does derender cost "
             "the client anything next to tokens?", smollm2),
    Scenario("7", "P/D vs one server", "TTFT and transfer time of a prefill → decode hand-off against one server.",
             pd_vs_one, needs="`pdserve proxy` with the NIXL KV hand-off"),
)


# ---------------------------------------------------------------- the document


def document(profile: Profile, sections: Mapping[str, Section], skipped: Mapping[str, str], engine: str,
             command: str, wall_s: float, note: str) -> str:
    head = [
        "# pdserve benchmarks",
        "",
        ("Measured with `pdserve bench serve` (the method, metric definitions and caveats: "
        "[benchmark-methodology.md](benchmark-methodology.md)); every table is one run with its arms "
        "interleaved round by round, so compare rows of one table, not across machines."),
        "",
        f"* Run: `{command}` (profile `{profile.name}`, {wall_s / 60:.1f} min), {datetime.now(UTC):%Y-%m-%d %H:%M} UTC.",
        f"* Host: {machine()}.",
    ]
    if note:
        head.append(f"* Note: {note}")
    head += ["", "## Headlines", ""]
    for s in SCENARIOS:
        if s.key in sections:
            head.append(f"* **({s.key}) {s.title}**: {sections[s.key].headline}")
        else:
            head.append(f"* ({s.key}) {s.title}: not measured: {skipped.get(s.key, 'not selected')}.")
    body = []
    for s in SCENARIOS:
        body += ["", f"## ({s.key}) {s.title}", "", f"*{s.question}*" + (f" (Needs {s.needs}.)" if s.needs else ""), ""]
        if s.key in sections:
            body.append(sections[s.key].body)
        else:
            body.append(f"Not measured in this run: {skipped.get(s.key, 'not selected (--only)')}.")
    body += ["", "## Engine (pdserve bench engine)", "", engine]
    return "\n".join(head + body) + "\n"


def add_scenarios_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="the `make bench` profile (a few minutes on 2 cores)")
    parser.add_argument("--profile", choices=sorted(PROFILES), default=None,
                        help="full (default), quick (= --quick) or smoke (seconds per scenario, no real numbers)")
    parser.add_argument("--only", default=None, help="comma-separated scenario keys (default: all that can run)")
    parser.add_argument("--docs", type=Path, default=DEFAULT_DOCS, help="the Markdown file to rewrite")
    parser.add_argument("--no-engine", action="store_true", help="skip `pdserve bench engine`")
    parser.add_argument("--note", default="", help="a line for the document (e.g. the host was shared)")
    parser.add_argument("--json", type=Path, default=None, help="also write every scenario's raw results here")


def run_scenarios(args: argparse.Namespace) -> int:
    profile = PROFILES[args.profile] if args.profile else QUICK if args.quick else FULL
    only = set(args.only.split(",")) if args.only else None
    docs: Path = args.docs
    docs.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    sections: dict[str, Section] = {}
    skipped: dict[str, str] = {}
    failed: list[str] = []
    for scenario in SCENARIOS:
        if only is not None and scenario.key not in only:
            continue
        print(f"scenario {scenario.key}: {scenario.title} ...", flush=True)
        t0 = time.monotonic()
        try:
            sections[scenario.key] = scenario.run(profile, docs.parent)
        except BenchError as e:  # the other scenarios still run; the document says what failed
            print(f"scenario {scenario.key} FAILED: {e}", file=sys.stderr)
            skipped[scenario.key] = "the run failed: " + str(e).splitlines()[0][:300]
            failed.append(scenario.key)
            continue
        print(f"scenario {scenario.key}: done in {time.monotonic() - t0:.0f} s: {sections[scenario.key].headline}",
              flush=True)
    engine = "Not measured in this run (--no-engine)."
    if not args.no_engine:
        from pdserve.bench.engine import docs_section, run_engine_bench

        print("pdserve bench engine ...", flush=True)
        engine = docs_section(run_engine_bench(repeats=profile.engine_repeats, max_tokens=profile.engine_max_tokens,
                                               prompt_tokens=512 if profile is FULL else 128))
    command = f"pdserve bench scenarios --profile {profile.name}" + (f" --only {args.only}" if only else "")
    docs.write_text(document(profile, sections, skipped, engine, command, time.monotonic() - started, args.note),
                    encoding="utf-8")
    print(f"wrote {docs}")
    if args.json is not None:
        raw = {key: {"headline": section.headline, "results": section.results} for key, section in sections.items()}
        args.json.write_text(json.dumps({"command": command, "profile": profile.name, "scenarios": raw,
                                         "not_measured": skipped}, indent=2))
        print(f"wrote {args.json}")
    if failed:
        print(f"scenarios {', '.join(failed)} FAILED (see above)", file=sys.stderr)
    return 1 if failed else 0
