"""``pdserve up`` flags; unknown flags are extra ``pdserve serve`` flags for the prefill and decode servers."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pdserve.proxy.modes import MODES
from pdserve.web.logs import LOG_FORMATS
from pdserve.web.trace_context import add_traces_arg, traces_url

DEFAULT_BASE_PORT = 8000


def add_up_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="any model pdserve serve takes: smollm2-135m (default), qwen3-tiny, a model dir, a .gguf")
    p.add_argument("--prefill", type=int, default=1, help="prefill servers (default 1)")
    p.add_argument("--decode", type=int, default=1, help="decode servers (default 1)")
    p.add_argument("--mode", choices=MODES, default="inline", help="the proxy's mode")
    p.add_argument("--engine", choices=("torch", "vllm"), default="torch",
                   help="the prefill and decode servers' engine; vllm: vLLM's AsyncLLM with vLLM's NixlConnector "
                   "(run pdserve up from .venv-vllm: make vllm-env, make up-vllm)")
    p.add_argument("--port", type=int, default=DEFAULT_BASE_PORT,
                   help="the proxy's port; the servers take the ports after it (0: any free ports)")
    p.add_argument("--reasoning-parser", default=None, help="deepseek_r1 | qwen3 (render and decode servers)")
    p.add_argument("--tool-call-parser", default=None, help="hermes | qwen3_coder (render and decode servers)")
    p.add_argument("--enable-auto-tool-choice", action="store_true")
    p.add_argument("--api-key", default=None, help="the proxy's API key (the servers listen on loopback only)")
    p.add_argument("--log-level", default="warning")
    p.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                   help="every member's and the proxy's log format; json: a line per answered request with its "
                   "request id, trace id and member (docs/observability.md)")
    p.add_argument("--prometheus", action="store_true",
                   help="write a Prometheus scrape configuration for every member into the run directory and, "
                   "if the prometheus binary is installed, run it beside the fleet (docs/observability.md)")
    add_traces_arg(p, "from every process it starts: the render, prefill and decode servers and the proxy")


def parser_flags(args: argparse.Namespace) -> tuple[str, ...]:
    flags: list[str] = []
    if args.reasoning_parser:
        flags += ["--reasoning-parser", args.reasoning_parser]
    if args.tool_call_parser:
        flags += ["--tool-call-parser", args.tool_call_parser]
    if args.enable_auto_tool_choice:
        flags.append("--enable-auto-tool-choice")
    return tuple(flags)


def traces_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """``--otlp-traces-endpoint URL``, which every process ``up`` starts gets, when it is set."""
    endpoint = getattr(args, "otlp_traces_endpoint", None)
    return ("--otlp-traces-endpoint", endpoint) if endpoint else ()


def proxy_flags(args: argparse.Namespace, serve_flags: Sequence[str]) -> tuple[str, ...]:
    """The proxy's flags: ``up``'s log settings, traces endpoint and API key, and ``--enable-per-request-metrics``
    when the servers get it (they report their legs' figures, and the proxy puts them in its answers)."""
    flags = ["--log-level", args.log_level]
    if args.log_format != "text":
        flags += ["--log-format", args.log_format]
    flags += traces_flags(args)
    if "--enable-per-request-metrics" in serve_flags:
        flags.append("--enable-per-request-metrics")
    if args.api_key:
        flags += ["--api-key", args.api_key]
    return tuple(flags)


def run_up(args: argparse.Namespace, serve_flags: list[str]) -> int:
    from pdserve.checkpoints.resolve import DEFAULT_MODEL, resolve_model
    from pdserve.topology.plan import TopologyRequest, plan
    from pdserve.topology.process import free_port
    from pdserve.topology.supervise import STARTUP_TIMEOUT_S, VLLM_STARTUP_TIMEOUT_S, run

    model = args.model or DEFAULT_MODEL
    try:
        traces = traces_url(args.otlp_traces_endpoint) if args.otlp_traces_endpoint else None
        if args.engine == "vllm":
            from pdserve.engine.runners.vllm_runner import require_vllm

            require_vllm()  # every member runs this Python: stop before starting any of them
        # Built once here, so the servers start from the cache.
        tokenizer_dir = resolve_model(model, engine=args.engine)
    except (ValueError, FileNotFoundError) as e:
        print(f"pdserve up: {e}", file=sys.stderr)
        return 2
    ports: dict[int, int] = {}

    def port_for(k: int) -> int:
        if k not in ports:
            ports[k] = free_port() if args.port == 0 else args.port + k
        return ports[k]

    log_format = ("--log-format", args.log_format) if args.log_format != "text" else ()
    request = TopologyRequest(
        model=model, tokenizer_dir=str(tokenizer_dir), prefill=args.prefill, decode=args.decode, mode=args.mode,
        parser_flags=parser_flags(args), serve_flags=(*serve_flags, *log_format, *traces_flags(args)), engine=args.engine,
        proxy_flags=proxy_flags(args, serve_flags),
    )
    try:
        specs = plan(request, port_for)
    except ValueError as e:
        print(f"pdserve up: {e}", file=sys.stderr)
        return 2
    on_vllm = args.engine == "vllm"
    return run(specs, args.mode, model, VLLM_STARTUP_TIMEOUT_S if on_vllm else STARTUP_TIMEOUT_S, warm_up=on_vllm,
               prometheus=args.prometheus, api_key=args.api_key, traces=traces)
