"""Draw the trace of one P/D request from a real fleet: ``pdserve up`` (render, prefill, decode, proxy on
loopback, KV pulled over NIXL) with ``--otlp-traces-endpoint`` pointing at the test receiver (tests/otlp.py),
one chat request through the proxy, and the spans every process exported for it, as a tree with each span's
process and duration. docs/observability.md ("Traces") shows its output.

    .venv/bin/python scripts/trace_tree.py [MODEL] [--stream] [--max-tokens N] [--prompt TEXT]

MODEL: what ``pdserve up`` takes (default: its default, smollm2-135m). The first request after start warms
the fleet up (it is drawn too, with ``--warm``); the tree printed is the second one's.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.otlp import Receiver, Span, tree  # noqa: E402
from tests.upproc import start_up  # noqa: E402
from tests.waiting import wait_until  # noqa: E402


def _complete(spans: list[Span]) -> bool:
    """The member spans a chat request ends with are in (the decode member's last)."""
    names = {(s.service, s.name) for s in spans}
    return {("pdserve-proxy", "POST /v1/chat/completions"), ("pdserve-render", "render"), ("pdserve-prefill", "prefill"),
            ("pdserve-decode", "decode")} <= names


def _root(receiver: Receiver, request_id: str) -> Span:
    """The proxy's span of the client request ``request_id``, once it came in."""

    def mine(span: Span) -> bool:
        return span.service == "pdserve-proxy" and span.kind == "server" and span.attributes.get(
            "gen_ai.request.id") == request_id

    return wait_until(lambda: receiver.find(mine), f"the proxy's span of {request_id}")[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--stream", action="store_true", help="a streamed chat (default: a batch answer)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--prompt", default="What is the capital of France?")
    parser.add_argument("--warm", action="store_true", help="draw the first (warm-up) request's trace too")
    args = parser.parse_args()
    os.environ.setdefault("OTEL_BSP_SCHEDULE_DELAY", "200")  # the members' batches, every 200 ms
    with Receiver() as receiver:
        up, base = start_up(*([args.model] if args.model else []), "--port", "0",
                            "--otlp-traces-endpoint", receiver.url)
        try:
            print("\n".join(f"# pdserve up: {line.strip()}" for line in up.output.splitlines() if "traces" in line))
            body = {"messages": [{"role": "user", "content": args.prompt}], "max_tokens": args.max_tokens,
                    "temperature": 0, "stream": args.stream}
            for n, request_id in enumerate(("trace-warm-up", "trace-tree")):
                with httpx.stream("POST", base + "/chat/completions", json=body, timeout=300,
                                  headers={"x-request-id": request_id}) as r:
                    r.read()
                    assert r.status_code == 200, r.text
                root = _root(receiver, request_id)
                spans = receiver.wait_for_trace(root.trace_id, _complete)
                if n == 1 or args.warm:
                    print(f"# {request_id}: trace {root.trace_id}, {len(spans)} spans from "
                          f"{len({s.service for s in spans})} processes")
                    print(tree(spans))
        finally:
            up.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
