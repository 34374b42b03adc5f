"""``pdserve proxy`` flags. The app, its banner and uvicorn load only when the proxy runs
(:mod:`pdserve.proxy.server`), so building the ``pdserve`` parser stays cheap for every other command."""

from __future__ import annotations

import argparse

from pdserve.protocol.keepalive import SERVER_KEEP_ALIVE_S
from pdserve.proxy.modes import MODES, ROUTINGS
from pdserve.web.logs import LOG_FORMATS
from pdserve.web.trace_context import add_traces_arg


def _urls(value: str) -> list[str]:
    urls = [u.strip() for u in value.split(",") if u.strip()]
    if not urls or any(not u.startswith(("http://", "https://")) for u in urls):
        raise argparse.ArgumentTypeError(f"expected comma-separated http(s):// URLs, got {value!r}")
    return urls


def _positive(value: str) -> float:
    number = float(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value!r}")
    return number


def _non_negative(value: str) -> float:
    number = float(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more, got {value!r}")
    return number


def _count(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more, got {value!r}")
    return number


def add_proxy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--render", type=_urls, required=True,
                   help="render server URL (pdserve launch render); comma-separate several for a pool")
    p.add_argument("--prefill", type=_urls, required=True, help="prefill server URLs, comma-separated")
    p.add_argument("--decode", type=_urls, required=True, help="decode server URLs, comma-separated")
    p.add_argument("--mode", choices=MODES, default="inline",
                   help="inline: the decode leg returns OpenAI content (derender/text); derender-tier: the decode "
                   "leg streams tokens and each chunk goes through the render server's /derender")
    p.add_argument("--routing", choices=ROUTINGS, default="p2c",
                   help="how a pool picks a member: p2c (the one with fewer requests in flight of two drawn at random) "
                   "or round-robin")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health")
    p.add_argument("--health-interval-s", type=_positive, default=1.0, help="seconds between health checks")
    p.add_argument("--connect-timeout-s", type=_positive, default=2.0,
                   help="bound on connecting to a member (a dead one fails this fast)")
    p.add_argument("--upstream-timeout-s", type=_positive, default=600.0,
                   help="bound on waiting for a member's next bytes")
    p.add_argument("--migration-limit", type=_count, default=1,
                   help="how many times a client's stream may move to another decode member when its decode leg "
                   "fails mid-stream (dies, stalls, drains, breaks off); 0 turns migration off")
    p.add_argument("--stall-timeout-s", type=_positive, default=30.0,
                   help="silence between a decode stream's chunks after which its member counts as hung (the "
                   "stream then migrates; the first chunk is bounded by --upstream-timeout-s)")
    p.add_argument("--shutdown-timeout", type=_non_negative, default=30.0,
                   help="on SIGTERM: seconds requests in flight get to finish; streams still open then end with an "
                   "error event naming the shutdown")
    p.add_argument("--timeout-keep-alive", type=_positive, default=SERVER_KEEP_ALIVE_S,
                   help="seconds an idle client connection stays open (above the clients' idle expiry: "
                   "httpx and the openai SDK keep 5 s)")
    p.add_argument("--enable-per-request-metrics", action="store_true",
                   help="vLLM's flag: each answer's metrics (a stream's finishing chunk's) name every leg, its member "
                   "and its times, and any retry or migration (a Server-Timing header is on every batch answer "
                   "either way)")
    p.add_argument("--log-level", default="warning")
    p.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                   help="json: one JSON object per log line, and a line per answered request with its request id, "
                   "trace id and the member of each leg (docs/observability.md)")
    add_traces_arg(p, "a span per client request and per leg; each leg carries a traceparent naming its span")


def run_proxy(args: argparse.Namespace) -> int:
    from pdserve.proxy.server import serve_proxy

    return serve_proxy(args)
