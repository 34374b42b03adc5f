"""Run the proxy: pools and client from the flags, the decode members' preflight, the ready banner, uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import httpx
import uvicorn

from pdserve.proxy.app import HealthSettings, create_app, make_client
from pdserve.proxy.flow import MigrationSettings, Orchestrator, decode_modes
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.modes import Mode
from pdserve.proxy.pool import ADMIT_TIMEOUT_S, Admission, Member, Pool, check_pools
from pdserve.proxy.preflight import member_refusal
from pdserve.web.logs import configure_json_logging, serving, uvicorn_logging
from pdserve.web.quiet_server import DrainingServer

if TYPE_CHECKING:  # loaded only with --otlp-traces-endpoint (it imports the OpenTelemetry SDK)
    from pdserve.proxy.tracing import ProxyTracing

ROUTES = "/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics"


def _pool_line(pool: Pool) -> str:
    return ", ".join(f"{m.url} ({m.reason})" for m in pool.members)


def _migration_line(settings: MigrationSettings) -> str:
    if settings.limit == 0:
        return "off"
    return f"up to {settings.limit} move(s) per stream, a decode leg silent {settings.stall_timeout_s:g} s counts as hung"


def _metrics_line(orch: Orchestrator) -> str:
    legs = "legs in each answer's metrics" if orch.per_request_metrics else "no per-request metrics"
    return f"Server-Timing on batch answers, {legs} (--enable-per-request-metrics)"


def _traces_line(orch: Orchestrator) -> str:
    return "off (--otlp-traces-endpoint URL)" if orch.tracing is None else orch.tracing.describe()


def ready_banner(orch: Orchestrator, url: str) -> str:
    """Where it listens, the mode, and each pool with its members' health at start."""
    lines = [f"pdserve proxy ready on {url}", f"  mode       {orch.mode}",
             f"  routing    {orch.decode.routing}",
             f"  migration  {_migration_line(orch.migration)}",
             f"  metrics    {_metrics_line(orch)}",
             f"  traces     {_traces_line(orch)}"]
    lines += [f"  {pool.name:<10} {_pool_line(pool)}" for pool in orch.pools]
    lines.append(f"  routes     {ROUTES}")
    return "\n".join(lines)


class _AnnouncingServer(DrainingServer):
    """uvicorn that prints the banner once it accepts connections (after the first health check), and
    drains on the first SIGTERM/SIGINT: ``/health`` and new requests answer 503 at once, requests in flight
    get ``--shutdown-timeout`` seconds, streams still open then end with an error event naming the
    shutdown (their decode legs are closed, so their members abort them); a second signal stops at once."""

    def __init__(self, config: uvicorn.Config, orch: Orchestrator, url: str, shutdown_timeout_s: float):
        super().__init__(config)
        self._orch, self._url = orch, url
        self._shutdown_timeout_s = shutdown_timeout_s

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if not self.should_exit:
            print(ready_banner(self._orch, self._url), file=sys.stderr, flush=True)

    async def drain(self) -> None:
        orch = self._orch
        orch.draining = True
        print(f"pdserve proxy: shutting down: refusing new requests; {orch.in_flight} in flight get "
              f"{self._shutdown_timeout_s:g} s to finish", file=sys.stderr, flush=True)
        deadline = time.monotonic() + self._shutdown_timeout_s
        while orch.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await orch.cut_streams(f"the proxy is shutting down and its --shutdown-timeout "
                               f"({self._shutdown_timeout_s:g} s) passed; send the request again to another proxy")
        while orch.in_flight and time.monotonic() < deadline + 5:  # the cut streams write their last events
            await asyncio.sleep(0.05)


def decode_admission(mode: Mode) -> Admission:
    """The decode pool's question to a joining member: does it serve every output mode ``mode``'s decode
    legs use? A refusal names the fix."""
    modes = decode_modes(mode)
    fix = (f"--mode {mode} sends decode legs in output_mode {' and '.join(modes)}; run the proxy with "
           "--mode derender-tier (decode legs in tokens, each chunk derendered by the render server), or put "
           "servers that serve those modes in the decode pool (pdserve serve, with --engine vllm for vLLM)")

    async def admit(client: httpx.AsyncClient, member: Member) -> str | None:
        refusal = await member_refusal(client, member.url, modes, ADMIT_TIMEOUT_S)
        return None if refusal is None else f"{refusal}. {fix}"

    return admit


def proxy_tracing(args: argparse.Namespace, url: str) -> ProxyTracing | None:
    """The proxy's tracer with ``--otlp-traces-endpoint``; None (and no SDK imported) without it."""
    if getattr(args, "otlp_traces_endpoint", None) is None:
        return None
    from pdserve.proxy.tracing import ProxyTracing
    from pdserve.web.tracing import Tracing

    return ProxyTracing(Tracing(args.otlp_traces_endpoint, "pdserve-proxy",
                                {"service.instance.id": url, "pdserve.member": url, "pdserve.role": "proxy"}))


def build_orchestrator(args: argparse.Namespace, tracing: ProxyTracing | None = None) -> Orchestrator:
    metrics = ProxyMetrics()

    def pool(name: str, urls: Sequence[str], admit: Admission | None = None) -> Pool:
        made = Pool(name, urls, on_change=metrics.member_changed, admit=admit, on_error=metrics.member_failed,
                    routing=args.routing)
        for member in made.members:
            metrics.member_changed(made, member)
        return made

    client = make_client(args.connect_timeout_s, args.upstream_timeout_s)
    return Orchestrator(client, pool("render", args.render), pool("prefill", args.prefill),
                        pool("decode", args.decode, decode_admission(args.mode)), args.mode, metrics,
                        MigrationSettings(args.migration_limit, args.stall_timeout_s), args.enable_per_request_metrics,
                        tracing)


async def _refusals_at_start(orch: Orchestrator, timeout_s: float) -> list[str]:
    """Check every member once (its own client: uvicorn's loop is not started yet); the refused ones."""
    async with httpx.AsyncClient() as client:
        await check_pools(orch.pools, client, timeout_s)
    return [line for pool in orch.pools for line in pool.refusals]


def serve_proxy(args: argparse.Namespace) -> int:
    host = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{host}:{args.port}"
    try:
        tracing = proxy_tracing(args, url)
    except ValueError as e:
        print(f"pdserve proxy: {e}", file=sys.stderr)
        return 2
    try:
        return _serve(args, url, tracing)
    finally:
        if tracing is not None:
            tracing.shutdown()  # the spans still queued go out before the process stops


def _serve(args: argparse.Namespace, url: str, tracing: ProxyTracing | None) -> int:
    orch = build_orchestrator(args, tracing)
    refusals = asyncio.run(_refusals_at_start(orch, args.connect_timeout_s))
    if refusals:
        print("pdserve proxy: not starting, a member cannot serve this proxy's requests:", file=sys.stderr)
        print("\n".join(f"  {line}" for line in refusals), file=sys.stderr, flush=True)
        return 2
    app = create_app(orch, HealthSettings(args.health_interval_s, args.connect_timeout_s), args.api_key)
    served = app if tracing is None else tracing.tracing.middleware(app)
    if args.log_format == "json":
        configure_json_logging(args.log_level, "proxy")
    config = uvicorn.Config(serving(served, args.log_format, url), host=args.host, port=args.port,
                            log_level=args.log_level, loop="uvloop", http="httptools", timeout_graceful_shutdown=5,
                            timeout_keep_alive=args.timeout_keep_alive, **uvicorn_logging(args.log_format))
    _AnnouncingServer(config, orch, url, args.shutdown_timeout).run()
    return 0
