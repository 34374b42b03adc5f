"""``pdserve bench serve``: the streaming load generator for the generate protocol, in ``vllm bench serve``'s idiom.

Every ``--base-url`` × ``--output-mode`` is an arm; the arms run interleaved, round by round,
against any wire-compatible server (pdserve, or vLLM with its generate and render endpoints).
Metric names and definitions: :mod:`pdserve.bench.metrics`; the schedule: :mod:`pdserve.bench.sweep`;
what each request sends: :mod:`pdserve.bench.loadgen`; CPU: :mod:`pdserve.bench.cpu`; the method:
docs/benchmark-methodology.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from pdserve.bench import workload
from pdserve.bench.loadgen import ENDPOINTS, MODES, Arm, Prompt
from pdserve.bench.metrics import parse_slo
from pdserve.bench.preflight import servable_arms
from pdserve.bench.results import result_json, results_table
from pdserve.bench.servers import BenchError
from pdserve.bench.sweep import Load, Schedule, run_schedule

ENDPOINT_ALIASES = {"/inference/v1/generate": "generate", "/v1/chat/completions": "chat",
                    "/v1/completions": "completions"}
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
RANDOM_OUTPUT_LEN = 128


def _list(kind: Callable[[str], Any], name: str) -> Any:
    def parse(value: str) -> tuple[Any, ...]:
        try:
            items = tuple(kind(v) for v in value.split(",") if v.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}: expected comma-separated values, got {value!r}") from None
        if not items:
            raise argparse.ArgumentTypeError(f"{name}: empty list")
        return items

    return parse


def _logprobs(value: str) -> tuple[int | None, ...]:
    return _list(lambda v: None if v.strip() == "none" else int(v), "--logprobs")(value)


def _modes(value: str) -> tuple[str, ...]:
    modes = _list(str, "--output-mode")(value)
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise argparse.ArgumentTypeError(f"--output-mode {bad[0]!r}: choose from {', '.join(MODES)}")
    return modes


def _endpoints(value: str) -> tuple[str, ...]:
    names = tuple(ENDPOINT_ALIASES.get(v, v) for v in _list(str, "--endpoint")(value))
    for name in names:
        if name not in ENDPOINTS:
            raise argparse.ArgumentTypeError(
                f"--endpoint {name!r}: choose from {', '.join([*ENDPOINT_ALIASES, *ENDPOINTS])}")
    return names


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """``pdserve bench serve`` flags; names follow ``vllm bench serve`` where it has one."""
    g = parser.add_argument_group("servers and arms")
    g.add_argument("--base-url", action="append", required=True, help="server or proxy URL; repeat for several")
    g.add_argument("--endpoint", type=_endpoints, default=("generate",),
                   help="comma-separated: /inference/v1/generate (generate, the default), /v1/chat/completions "
                   "(chat), /v1/completions (completions), tier (generate tokens + one /derender call per chunk "
                   "with stream_state); one arm per endpoint and URL (generate: per output mode)")
    g.add_argument("--output-mode", type=_modes, default=("tokens",),
                   help="generate output modes, comma-separated: one arm per mode and URL (default tokens)")
    g.add_argument("--mix", type=_modes, default=None,
                   help="one mixed-traffic arm per URL instead: request i asks for mode i mod len (e.g. tokens,text,tokens,derender)")
    g.add_argument("--no-stream", action="store_true", help="batch requests (TTFT is then the whole latency)")
    g.add_argument("--derender", choices=("chat", "completions"), default="chat",
                   help="tier baseline: which stateless derender endpoint")
    g.add_argument("--derender-url", default=None, help="tier baseline: the derender server (default: the base URL)")
    g.add_argument("--logprobs", type=_logprobs, default=None,
                   help="sampling logprobs per token (generate/completions), comma-separated with 'none' for "
                   "none: one arm per value when several (e.g. none,20: their cost side by side)")
    g.add_argument("--stream-interval", type=_list(int, "--stream-interval"), default=None,
                   help="the requests' stream_interval (tokens per chunk), comma-separated: one arm per value "
                   "(default: the server's)")
    g = parser.add_argument_group("load")
    g.add_argument("--max-concurrency", type=_list(int, "--max-concurrency"), default=(1,),
                   help="concurrency caps, comma-separated: a sweep (default 1)")
    g.add_argument("--request-rate", type=_list(float, "--request-rate"), default=(math.inf,),
                   help="Poisson request rates in req/s, comma-separated; inf = all at once (default)")
    g.add_argument("--num-prompts", type=int, default=16, help="requests per arm, load and round")
    g.add_argument("--duration-s", type=float, default=None, help="per arm and load: no new request after this")
    g.add_argument("--rounds", type=int, default=1, help="rounds; each runs every arm under every load")
    g.add_argument("--num-warmups", type=int, default=1, help="unmeasured requests per arm first")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--request-timeout-s", type=float, default=600.0)
    g = parser.add_argument_group("workload")
    g.add_argument("--dataset-name", choices=workload.DATASETS, default="random",
                   help="random: synthetic chat prompts; scripted: reasoning + tool-call prompts that replay "
                   "the scripted engine's scripts (see --write-scripts); file: --dataset-path JSONL")
    g.add_argument("--dataset-path", default=None, help="JSONL of {messages, max_tokens?} or {prompt}")
    g.add_argument("--random-input-len", type=int, default=64, help="about this many prompt tokens (random)")
    g.add_argument("--random-output-len", type=int, default=None,
                   help=f"max_tokens (random: default {RANDOM_OUTPUT_LEN}; scripted and file: a cap, default none)")
    g.add_argument("--random-range-ratio", type=float, default=0.0, help="output length uniform in len·(1±r)")
    g.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens (a model server)")
    g.add_argument("--scripted-lengths", type=_list(int, "--scripted-lengths"), default=(256,),
                   help="scripted: output lengths of the scripts, comma-separated")
    g.add_argument("--scripts-per-length", type=int, default=2)
    g.add_argument("--write-scripts", type=Path, default=None,
                   help="write the scripted dataset's --script file for `pdserve serve --engine scripted` and exit")
    g.add_argument("--render-url", default=None, help="server that renders the prompts (default: the first URL)")
    g = parser.add_argument_group("measurement and output")
    g.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS", help="SLOs, vLLM's form: ttft:500 tpot:50")
    g.add_argument("--slo", default=None, help="SLOs as ttft=500,tpot=50 (ms; ttft, tpot, e2el)")
    g.add_argument("--no-server-cpu", action="store_true", help="do not read server CPU (remote servers)")
    g.add_argument("--server-pid", type=int, action="append", default=None,
                   help="root pid of each server, in --base-url order (default: found by its listening port)")
    g.add_argument("--idle-window-s", type=float, default=1.0, help="idle CPU window subtracted from every figure")
    g.add_argument("--save-result", action="store_true", help="write the result JSON")
    g.add_argument("--result-filename", type=Path, default=None, help="where (default bench-serve-<date>.json)")
    g.add_argument("--plot-dir", type=Path, default=None, help="also write PNG plots here")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def arms_from_args(args: argparse.Namespace) -> list[Arm]:
    """One arm per URL, endpoint (generate: output mode), logprobs value (when several) and stream interval."""
    arms = []
    logprob_values = args.logprobs or (None,)
    for logprobs in logprob_values:
        for interval in args.stream_interval or (None,):
            sampling: dict[str, Any] = {} if logprobs is None else {"logprobs": logprobs}
            suffix = f" + logprobs={logprobs}" if len(logprob_values) > 1 and logprobs is not None else ""
            if interval is not None:
                sampling["stream_interval"] = interval
                suffix += f" / interval {interval}"
            arms += _arms(args, sampling, suffix)
    return arms


def _arms(args: argparse.Namespace, sampling: dict[str, Any], suffix: str) -> list[Arm]:
    urls = [u.rstrip("/") for u in args.base_url]
    many = len(urls) > 1

    def label(base: str, url: str) -> str:
        return f"{base}{suffix} @ {urlsplit(url).netloc}" if many else base + suffix

    arms = []
    for url, endpoint in ((u, e) for u in urls for e in args.endpoint):
        common: dict[str, Any] = {"base_url": url, "endpoint": endpoint, "stream": not args.no_stream,
                                  "derender": args.derender, "derender_url": args.derender_url, "sampling": sampling}
        if endpoint == "tier":
            arms.append(Arm(label(f"tokens + /derender ({args.derender}) per chunk", url), **common))
        elif endpoint != "generate":
            arms.append(Arm(label(endpoint + (" (batch)" if args.no_stream else ""), url), **common))
        elif args.mix:
            arms.append(Arm(label("mix " + "/".join(args.mix), url), modes=tuple(args.mix), **common))
        else:
            arms += [Arm(label(m + (" (batch)" if args.no_stream else ""), url), modes=(m,), **common)
                     for m in args.output_mode]
    return arms


def server_urls(arms: Sequence[Arm]) -> list[str]:
    """Every distinct server the arms talk to, in order: base URLs first, then derender servers."""
    return list(dict.fromkeys([a.base_url for a in arms] + [u for a in arms for u in a.urls]))


def render_prompts(render_url: str, chats: Sequence[dict[str, Any]], max_tokens: Sequence[int | None],
                   ignore_eos: bool, timeout_s: float = 120.0) -> list[Prompt]:
    """Render every chat request once, before any timing (render cost is common to every arm)."""
    prompts = []
    with httpx.Client(timeout=timeout_s) as client:
        for chat, limit in zip(chats, max_tokens, strict=True):
            try:
                response = client.post(render_url + "/v1/chat/completions/render", json=chat)
            except httpx.HTTPError as e:
                raise BenchError(f"render at {render_url} failed: {e!r}") from e
            if response.status_code != 200:
                raise BenchError(f"render at {render_url} answered {response.status_code}: {response.text[:500]}")
            prompts.append(Prompt(chat=chat, rendered=response.json(), max_tokens=limit, ignore_eos=ignore_eos))
    return prompts


def build_prompts(args: argparse.Namespace, render_url: str) -> list[Prompt]:
    """The workload named by ``--dataset-name``, rendered by ``render_url``."""
    rng = random.Random(args.seed)
    count = max(args.num_prompts * args.rounds, args.num_warmups, 1)
    if args.dataset_name == "file":
        if not args.dataset_path:
            raise BenchError("--dataset-name file needs --dataset-path")
        entries = workload.file_chats(args.dataset_path)
        chats = [entries[i % len(entries)][0] for i in range(count)]
        limits: list[int | None] = [entries[i % len(entries)][1] or args.random_output_len for i in range(count)]
    elif args.dataset_name == "scripted":
        scripts = scripted_scripts(args)
        every = workload.scripted_chats(scripts)
        chats = [every[i % len(every)] for i in range(count)]
        limits = [args.random_output_len] * count
    else:
        chats = workload.random_chats(count, args.random_input_len, rng)
        mean = args.random_output_len or RANDOM_OUTPUT_LEN
        limits = list(workload.output_lengths(count, mean, args.random_range_ratio, rng))
    return render_prompts(render_url, chats, limits, args.ignore_eos)


def scripted_scripts(args: argparse.Namespace) -> list[workload.Script]:
    from pdserve.text.tokenizer import Tokenizer

    return workload.build_scripts(Tokenizer.load("qwen3"), args.scripted_lengths, args.scripts_per_length, args.seed)


def _slo(args: argparse.Namespace) -> dict[str, float] | None:
    slo: dict[str, float] = {}
    try:
        if args.goodput:
            slo.update(parse_slo(" ".join(args.goodput)))
        if args.slo:
            slo.update(parse_slo(args.slo))
    except ValueError as e:
        raise BenchError(str(e)) from None
    return slo or None


def _check(args: argparse.Namespace) -> None:
    if args.num_prompts < 1 or args.rounds < 1 or args.num_warmups < 0:
        raise BenchError("--num-prompts and --rounds must be >= 1, --num-warmups >= 0")
    if any(c < 1 for c in args.max_concurrency) or any(r <= 0 for r in args.request_rate):
        raise BenchError("--max-concurrency values must be >= 1 and --request-rate values > 0")
    if args.stream_interval and (args.no_stream or min(args.stream_interval) < 1):
        raise BenchError("--stream-interval values must be >= 1, and only streams have chunks (drop --no-stream)")
    if args.server_pid and len(args.server_pid) != len(server_urls(arms_from_args(args))):
        raise BenchError("--server-pid: give one per server, in --base-url order (then --derender-url)")
    _slo(args)  # a malformed SLO fails before any request


def run_serve_bench(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    """Run, print the table, save JSON/plots when asked. 0 on success, 1 when the run failed."""
    try:
        if args.write_scripts is not None:
            workload.write_script_file(str(args.write_scripts), scripted_scripts(args))
            print(f"wrote {args.write_scripts}")
            return 0
        _check(args)
        result = measure(args, "pdserve bench serve " + shlex.join(argv if argv is not None else sys.argv[3:]))
    except BenchError as e:
        print(f"pdserve bench serve: FAILED: {e}", file=sys.stderr)
        return 1
    print(results_table(result))
    for cell in result["cells"]:
        if cell["failed"]:
            print(f"error: {cell['failed']} requests of {cell['label']} at {cell['load']} failed: "
                  + "; ".join(cell["errors"]), file=sys.stderr)
        if cell["client_fell_behind"]:
            print(f"warning: the client fell behind in {cell['load']} {cell['label']} (CPU "
                  f"{cell['client_cpu_utilization']:.0%} of a core, loop lag p99 {cell['client_loop_lag_p99_ms']:.1f} "
                  "ms): its latencies include the client's own delay", file=sys.stderr)
    if args.save_result or args.result_filename:
        path = args.result_filename or Path(f"bench-serve-{result['date'][:19].replace(':', '')}.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
        print(f"wrote {path}")
    if args.plot_dir is not None:
        from pdserve.bench.plots import itl_distribution, latency_vs_concurrency

        for path in (latency_vs_concurrency(result, args.plot_dir / "latency_vs_concurrency.png"),
                     itl_distribution(result, args.plot_dir / "itl_distribution.png")):
            print(f"wrote {path}")
    return 0 if all(c["completed"] for c in result["cells"]) else 1


def measure(args: argparse.Namespace, command: str, arms: Sequence[Arm] | None = None,
            prompts: Sequence[Prompt] | None = None) -> dict[str, Any]:
    """The run behind ``bench serve``. The scenarios call it with parsed flags and, where one run
    compares arms the flags cannot express (different sampling knobs), their own arms and prompts."""
    arms = list(arms) if arms is not None else arms_from_args(args)
    loads = [Load(c, r) for c in args.max_concurrency for r in args.request_rate]
    schedule = Schedule(num_prompts=args.num_prompts, rounds=args.rounds, num_warmups=args.num_warmups,
                        duration_s=args.duration_s, idle_window_s=args.idle_window_s, seed=args.seed,
                        timeout_s=args.request_timeout_s)
    if prompts is None:
        prompts = build_prompts(args, (args.render_url or arms[0].base_url).rstrip("/"))
    urls = server_urls(arms)  # before any arm is dropped: --server-pid follows every server named
    with httpx.Client(timeout=args.request_timeout_s) as client:
        arms, skipped = servable_arms(arms, prompts[0], client)
    for skip in skipped:
        print(f"skipped arm {skip.label!r}: {skip.reason}", file=sys.stderr)
    if not arms:
        raise BenchError("no arm is served: " + "; ".join(f"{s.label}: {s.reason}" for s in skipped))
    meter = None
    if not args.no_server_cpu:
        if not all(urlsplit(u).hostname in LOOPBACK for u in urls):
            raise BenchError("server CPU is read on this host only: pass --no-server-cpu for remote servers")
        from pdserve.bench.cpu import meter_for

        meter = meter_for(urls, args.server_pid)
    cells = asyncio.run(run_schedule(arms, loads, prompts, schedule, meter, progress=not args.disable_tqdm))
    slo = _slo(args)
    return result_json(arms, loads, schedule, cells, slo, meter is not None, command, skipped)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve bench serve", description="streaming load generator")
    add_serve_args(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_serve_bench(build_parser().parse_args(argv), argv)


if __name__ == "__main__":
    sys.exit(main())
