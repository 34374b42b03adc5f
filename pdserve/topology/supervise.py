"""Run a planned topology: start the servers, wait (with progress) until each is healthy, start the
proxy, print every URL, then watch: a member that exits is reported once (name, pid, exit code, log)
and left to the proxy's health check, which takes it out of rotation. Ctrl-C / SIGTERM, or the proxy
exiting, stops every process group. With ``--prometheus`` a Prometheus (pdserve.topology.prometheus)
starts with the servers, is printed and watched with them, and stops with them.
"""

from __future__ import annotations

import shutil
import signal
import tempfile
import time
from pathlib import Path
from types import FrameType

import httpx

from pdserve.topology.members import MemberSpec, member_process
from pdserve.topology.process import ServerProcess, stop_all
from pdserve.topology.prometheus import Monitoring, prepare
from pdserve.topology.warmup import WarmUpFailed, warm_pairs

STARTUP_TIMEOUT_S = 300.0
# vLLM's engine core compiles its CPU kernels at start: ~200 s per server on a busy 2-core host.
VLLM_STARTUP_TIMEOUT_S = 900.0
PROGRESS_EVERY_S = 10.0
WATCH_POLL_S = 0.2


class StartupFailed(Exception):
    pass


def say(line: str) -> None:
    print(f"pdserve up: {line}", flush=True)


def wait_healthy(members: list[ServerProcess], timeout_s: float) -> None:
    """Until every member answers ``/health``: one line per member as it comes up, a progress line
    every few seconds; a member that exits meanwhile fails the start with its log tail."""
    start = time.monotonic()
    waiting = list(members)
    next_progress = start + PROGRESS_EVERY_S
    while waiting:
        for member in list(waiting):
            code = member.exit_code()
            if code is not None:
                raise StartupFailed(f"{member.name} exited with code {code} while starting; its log "
                                    f"({member.log_path}) ends with:\n{member.log_tail()}")
            if member.is_healthy():
                waiting.remove(member)
                say(f"{member.name} healthy on {member.url} ({time.monotonic() - start:.1f}s)")
        now = time.monotonic()
        if waiting and now > start + timeout_s:
            raise StartupFailed(f"not healthy after {timeout_s:.0f}s: {', '.join(m.name for m in waiting)}")
        if waiting and now >= next_progress:
            say(f"waiting for {', '.join(m.name for m in waiting)} ({now - start:.0f}s)")
            next_progress = now + PROGRESS_EVERY_S
        time.sleep(0.1)


def summary(members: list[ServerProcess], mode: str, model: str, log_dir: Path,
            monitoring: Monitoring | None = None, traces: str | None = None) -> str:
    proxy = members[-1]
    lines = [f"pdserve up: ready: {model}, mode {mode}"]
    lines += [f"  {m.name:<10} {m.url:<24} pid {m.pid}" for m in members]
    if monitoring is not None:
        lines += monitoring_lines(monitoring)
    if traces is not None:
        lines.append(f"  traces     {traces} (OTLP/HTTP, from every member and the proxy)")
    lines += [f"  logs       {log_dir}", f"OpenAI base URL: {proxy.url}/v1", "Ctrl-C stops them all."]
    return "\n".join(lines)


def monitoring_lines(monitoring: Monitoring) -> list[str]:
    """Prometheus' URL and pid (or why it did not start) and where its scrape configuration is."""
    prom = monitoring.process
    if prom is None:
        return [f"  prometheus not started: {monitoring.not_started}",
                f"  scrape     {monitoring.config} (for a Prometheus of your own)"]
    return [f"  {prom.name:<10} {prom.url:<24} pid {prom.pid}", f"  scrape     {monitoring.config}"]


def _report_exits(members: list[ServerProcess], reported: set[str], proxy: str,
                  beside: list[ServerProcess]) -> ServerProcess | None:
    """Report each newly exited member once (``reported``: the names already reported); the proxy
    (named ``proxy``), if it is one of them. ``beside``: processes that serve no pool (Prometheus): their
    exit is reported, and the fleet goes on without them."""
    for member in members + beside:
        code = member.exit_code()
        if code is None or member.name in reported:
            continue
        reported.add(member.name)
        member.signal_group(signal.SIGKILL)  # what it started (its engine core) goes with it
        then = "the fleet runs on without it" if member in beside else "the proxy takes it out of rotation"
        say(f"{member.name} (pid {member.pid}, {member.url}) exited with code {code}; {then} (log: {member.log_path})")
        if member.name == proxy:
            return member
    return None


def warm_hand_offs(specs: list[MemberSpec], timeout_s: float) -> None:
    """One throwaway hand-off per prefill and decode pair (pdserve.topology.warmup says why), with a line each."""
    urls = {role: [s.url for s in specs if s.role == role] for role in ("prefill", "decode")}
    say(f"warming {len(urls['prefill']) * len(urls['decode'])} prefill -> decode hand-off(s): vLLM's first "
        "NIXL pull between two engines can take the prefill's whole lease")
    try:
        hand_offs = warm_pairs(urls["prefill"], urls["decode"], timeout_s)
    except (WarmUpFailed, httpx.HTTPError) as e:
        raise StartupFailed(f"a warm-up hand-off failed: {e}") from None
    for (prefill, decode), done in hand_offs.items():
        again = f" (tried again after: {done.failed_pulls[0]})" if done.failed_pulls else ""
        say(f"hand-off {prefill} -> {decode}: {done.seconds:.1f}s{again}")


def run(specs: list[MemberSpec], mode: str, model: str, startup_timeout_s: float = STARTUP_TIMEOUT_S,
        warm_up: bool = False, prometheus: bool = False, api_key: str | None = None, traces: str | None = None) -> int:
    """Start, supervise and stop the topology; the exit code of ``pdserve up``. ``warm_up``: one hand-off
    per prefill and decode pair before the proxy starts (vLLM engines). ``prometheus``: write the scrape
    configuration into the run directory and run Prometheus beside the fleet if it is installed
    (``api_key``: the proxy's, for the proxy's scrapes). ``traces``: where the members' spans go, for the
    ready lines (--otlp-traces-endpoint, resolved)."""
    log_dir = Path(tempfile.mkdtemp(prefix="pdserve-up-"))
    servers = [member_process(s, log_dir) for s in specs if s.role != "proxy"]
    proxy = [member_process(s, log_dir) for s in specs if s.role == "proxy"]
    members = servers + proxy
    monitoring = prepare(specs, log_dir, api_key, shutil.which("prometheus")) if prometheus else None
    beside: list[ServerProcess] = [monitoring.process] if monitoring is not None and monitoring.process is not None else []
    stopping = False

    def _stop(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        raise KeyboardInterrupt  # leaves a blocking wait at once

    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    try:
        say(f"starting {', '.join(m.name for m in servers + beside)} (logs in {log_dir})")
        if monitoring is not None and monitoring.process is None:
            say(f"Prometheus not started: {monitoring.not_started}; its scrape configuration is {monitoring.config}")
        for member in servers + beside:
            member.spawn()
        wait_healthy(servers + beside, startup_timeout_s)
        if warm_up:
            warm_hand_offs(specs, startup_timeout_s)
        proxy[0].spawn()
        wait_healthy(proxy, startup_timeout_s)
        print(summary(members, mode, model, log_dir, monitoring, traces), flush=True)
        reported: set[str] = set()
        while _report_exits(members, reported, proxy[0].name, beside) is None:
            time.sleep(WATCH_POLL_S)
        code = 1  # the proxy is gone: nothing routes to the servers any more
    except StartupFailed as e:
        say(str(e))
        code = 1
    except KeyboardInterrupt:
        code = 0 if stopping else 130
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C does not cut the shutdown short
        say("stopping every member")
        stop_all([m for m in members + beside if m.proc is not None])
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        say("stopped")
    return code

