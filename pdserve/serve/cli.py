"""The server roles of the command line: ``serve`` (generate server) and ``launch render``."""

from __future__ import annotations

import argparse
import socket
import sys
import uuid
from importlib import resources

from pdserve.engine.dtype_choice import DTYPE_CHOICES, choose_dtype
from pdserve.engine.spec import KV_FAILURE_POLICIES, KV_ROLES, EngineSpec, KVTransferSpec
from pdserve.protocol.keepalive import SERVER_KEEP_ALIVE_S
from pdserve.serve.config import (
    DEFAULT_DERENDER_CACHE_ENTRIES,
    DEFAULT_DERENDER_CACHE_TTL_S,
    DEFAULT_MAX_WAITING_REQUESTS,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    DEFAULT_STREAM_IDLE_TIMEOUT_S,
    ServerConfig,
)
from pdserve.web.logs import LOG_FORMATS
from pdserve.web.trace_context import add_traces_arg, traces_url

DEMO_SCRIPT = "demo_script.jsonl"


def demo_script_path() -> str:
    return str(resources.files("pdserve.data") / DEMO_SCRIPT)


def _add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--reasoning-parser", default=None, help="deepseek_r1 | qwen3")
    p.add_argument("--tool-call-parser", default=None, help="hermes | qwen3_coder")
    p.add_argument("--enable-auto-tool-choice", action="store_true")
    p.add_argument("--log-level", default="warning")
    p.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                   help="json: one JSON object per log line, and a line per answered request with its request id, "
                   "trace id and this server's address (docs/observability.md)")
    p.add_argument(
        "--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        help="on SIGTERM: /health and new requests answer 503 at once; requests in flight get this many seconds "
        "to finish, then end with an error naming the shutdown",
    )
    p.add_argument(
        "--timeout-keep-alive", type=float, default=SERVER_KEEP_ALIVE_S,
        help="seconds an idle keep-alive connection stays open; keep it above your clients' idle expiry "
        "(httpx and the openai SDK: 5 s), or a request sent as the server closes the connection is lost",
    )
    p.add_argument(
        "--derender-cache-entries", type=int, default=DEFAULT_DERENDER_CACHE_ENTRIES,
        help="streaming /derender: parser and detokenizer states kept to continue a stream without replaying "
        "it (LRU; 0 turns the cache off)",
    )
    p.add_argument("--derender-cache-ttl", type=float, default=DEFAULT_DERENDER_CACHE_TTL_S,
                   help="seconds a cached streaming /derender state lives after its last chunk")
    add_traces_arg(p, "a span per request, with its queue, prefill, KV pull, decode and derender")


def _add_kv_args(p: argparse.ArgumentParser) -> None:
    kv = p.add_argument_group("KV hand-off (P/D disaggregation; docs/pd.md)")
    kv.add_argument(
        "--kv-transfer", choices=["nixl"], default=None,
        help="hand prompts' KV to and from other engines over NIXL (vLLM NixlConnector's kv_transfer_params): "
        "pdserve's own hand-off on the torch engine, vLLM's NixlConnector on --engine vllm; without it, "
        "requests carrying those params are a 400",
    )
    kv.add_argument(
        "--kv-role", choices=KV_ROLES, default="both",
        help="the legs this server takes: prefill (do_remote_decode), decode (do_remote_prefill) or both; "
        "a leg of the other pool is a 400 (vLLM: kv_producer, kv_consumer, kv_both)",
    )
    kv.add_argument(
        "--kv-side-channel-port", type=int, default=None,
        help="--engine vllm: the port of vLLM's NIXL side channel (VLLM_NIXL_SIDE_CHANNEL_PORT, default vLLM's "
        "5600); one per server on a host, and what this server's prefill params name as remote_port",
    )
    kv.add_argument("--kv-lease-s", type=float, default=30.0, help="how long a finished prefill's KV waits for its pull")
    kv.add_argument("--kv-pull-timeout-s", type=float, default=30.0,
                    help="bound on one KV pull's READ (a prefill host that went silent): past it the pull fails "
                    "and --kv-load-failure-policy applies")
    kv.add_argument(
        "--kv-load-failure-policy", choices=KV_FAILURE_POLICIES, default="fail",
        help="a decode leg whose KV cannot be pulled: fail it (502 / error event), or recompute the prompt here",
    )
    kv.add_argument(
        "--kv-handoff-slots", type=int, default=None,
        help="KV slots beside the running batch's (--max-num-seqs) that hand-offs hold: a finished prefill's KV "
        "until its pull, a decode leg's pull before it runs (default: --max-num-seqs); the whole cache is "
        "NIXL-registered, so neither side copies",
    )
    kv.add_argument(
        "--kv-host", default=None,
        help="host name decode servers reach this server by, sent as remote_host (default: --host, or this "
        "machine's name when --host is a wildcard)",
    )


def kv_transfer_spec(args: argparse.Namespace) -> KVTransferSpec | None:
    """The engine's KV hand-off settings, or None without --kv-transfer."""
    if args.kv_transfer is None:
        if args.kv_role != "both" or args.kv_side_channel_port is not None:
            raise ValueError("--kv-role and --kv-side-channel-port set up a KV hand-off: add --kv-transfer nixl")
        return None
    if args.kv_lease_s <= 0:
        raise ValueError("--kv-lease-s must be positive")
    if args.kv_pull_timeout_s <= 0:
        raise ValueError("--kv-pull-timeout-s must be positive")
    if args.kv_handoff_slots is not None and args.kv_handoff_slots < 1:
        raise ValueError("--kv-handoff-slots must be at least 1")
    port = args.kv_side_channel_port
    if port is not None and not 0 < port < 65536:
        raise ValueError("--kv-side-channel-port must be a TCP port (1-65535)")
    if port is not None and args.engine != "vllm":
        raise ValueError("--kv-side-channel-port is vLLM's NIXL side channel; it needs --engine vllm")
    host = args.kv_host or (socket.gethostname() if args.host in ("", "0.0.0.0", "::") else args.host)
    return KVTransferSpec(
        engine_id=f"pdserve-{uuid.uuid4().hex[:16]}",
        host=host,
        port=args.port,
        lease_s=args.kv_lease_s,
        pull_timeout_s=args.kv_pull_timeout_s,
        failure_policy=args.kv_load_failure_policy,
        handoff_slots=args.kv_handoff_slots,
        api_key=args.api_key,
        role=args.kv_role,
        side_channel_port=port,
    )


def add_server_commands(sub: argparse._SubParsersAction) -> None:
    """``serve`` and ``launch render``: the server roles (the top-level parser is :mod:`pdserve.cli`)."""
    serve = sub.add_parser("serve", help="run a generate server")
    serve.add_argument(
        "model", nargs="?", default=None,
        help="smollm2-135m (default), qwen3-tiny, a Hugging Face model dir or a .gguf file (torch engine)",
    )
    serve.add_argument("--engine", choices=["scripted", "torch", "vllm"], default=None,
                       help="vllm: the model runs in vLLM's AsyncLLM (needs `make vllm-env`)")
    serve.add_argument("--tokenizer", default=None, help="'qwen3' or a directory with tokenizer.json")
    serve.add_argument("--script", default=None, help="JSONL token scripts for --engine scripted")
    serve.add_argument("--tokens-per-step", type=int, default=1,
                       help="--engine scripted: ids per step (a request's extra_args.tokens_per_step overrides it)")
    serve.add_argument("--step-ms", type=float, default=0.0)
    serve.add_argument("--tokens-only", action="store_true", help="no tokenizer: token ids in and out only")
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument("--max-num-seqs", type=int, default=16)
    serve.add_argument(
        "--max-num-batched-tokens", type=int, default=None,
        help="tokens one engine step computes: the running sequences' decode rows, then chunks of waiting prompts "
        "(a longer prompt is prefilled in chunks over several steps; torch default 2048)",
    )
    serve.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
        help="automatic prefix caching (vLLM's flag): full blocks of 16 prompt and output tokens are kept and a "
        "request whose prompt starts with cached blocks computes only the rest (default: on)",
    )
    serve.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                       help="the model's compute dtype; auto: bfloat16 where the CPU computes it (AVX512-BF16 or AMX), "
                       "else float32 (bfloat16 would be emulated, and slower)")
    serve.add_argument(
        "--batch-invariant", action="store_true",
        help="torch engine: every matmul call has one fixed shape, so a sequence's tokens never depend on "
        "its batch on any CPU (slower; see docs/engine.md)",
    )
    serve.add_argument("--api-server-count", type=int, default=1)
    serve.add_argument(
        "--enable-per-request-metrics", action="store_true",
        help="add server-side timing ('metrics': TTFT, generation time, mean ITL, tok/s) to generate responses, "
        "final stream chunks and the coupled endpoints",
    )
    serve.add_argument(
        "--enable-prompt-tokens-details", action="store_true",
        help="usage.prompt_tokens_details.cached_tokens: the prompt positions read from the prefix cache (vLLM's flag)",
    )
    serve.add_argument(
        "--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS,
        help="requests that may wait for an engine slot beyond --max-num-seqs; past it a 503 with Retry-After "
        "(-1: unbounded)",
    )
    serve.add_argument(
        "--stream-idle-timeout", type=float, default=DEFAULT_STREAM_IDLE_TIMEOUT_S,
        help="abort a stream whose client has read nothing for this many seconds, freeing its engine slot (0: never)",
    )
    serve.add_argument(
        "--stream-interval", type=int, default=1,
        help="send a stream chunk per N tokens of a sequence instead of one per engine step (the first token "
        "and the end go out at once); a request's stream_interval may raise it, never lower it",
    )
    _add_kv_args(serve)
    _add_server_args(serve)

    launch = sub.add_parser("launch", help="run a server of another role")
    roles = launch.add_subparsers(dest="role", required=True)
    render = roles.add_parser("render", help="render + derender endpoints with a tokenizer and no engine")
    render.add_argument("--tokenizer", default="qwen3", help="'qwen3' or a directory with tokenizer.json")
    render.add_argument("--max-model-len", type=int, default=None, help="bound for derender inputs")
    _add_server_args(render)


def _vllm_tokenizer(args: argparse.Namespace, tokenizer: str | None) -> str | None:
    """``--engine vllm``: vLLM installed, no torch-engine-only flags; the tokenizer is the model dir's."""
    from pdserve.checkpoints.resolve import resolve_model
    from pdserve.engine.runners.vllm_runner import require_vllm

    require_vllm()
    if args.batch_invariant:
        raise ValueError("--batch-invariant is a torch engine mode; drop it with --engine vllm")
    if args.kv_transfer and args.kv_handoff_slots is not None:
        raise ValueError("--kv-handoff-slots sizes the torch engine's KV cache; vLLM's NixlConnector uses vLLM's")
    if args.api_server_count != 1:
        raise ValueError("--engine vllm runs in the server process: --api-server-count must be 1")
    return tokenizer or str(resolve_model(args.model, engine="vllm"))


def serve_config(args: argparse.Namespace) -> ServerConfig:
    """Resolve flags: a model runs on the torch engine (default: smollm2-135m); ``--engine
    scripted`` (or a ``--script``) replays scripts with the qwen3 tokenizer unless told otherwise."""
    engine_kind = args.engine or ("scripted" if args.script else "torch")
    if args.stream_idle_timeout < 0 or (args.max_waiting_requests < -1):
        raise ValueError("--stream-idle-timeout must be 0 (never) or more; --max-waiting-requests -1 (unbounded) or more")
    if args.stream_interval < 1:
        raise ValueError("--stream-interval must be at least 1")
    script = args.script
    tokenizer = args.tokenizer
    if engine_kind == "scripted":
        if args.model:
            raise ValueError("--engine scripted takes no MODEL (it replays --script)")
        if args.batch_invariant:
            raise ValueError("--batch-invariant is a torch engine mode; --engine scripted has no model to run")
        if args.kv_transfer:
            raise ValueError("--kv-transfer hands off a model's KV; --engine scripted has none (use --engine torch)")
        if args.max_num_batched_tokens is not None:
            raise ValueError("--max-num-batched-tokens budgets a model's steps; --engine scripted has none")
        if args.enable_prefix_caching is not None:
            raise ValueError("--enable-prefix-caching caches a model's KV; --engine scripted has none")
        script = script or demo_script_path()
        tokenizer = tokenizer or "qwen3"
    if engine_kind == "vllm":
        tokenizer = _vllm_tokenizer(args, tokenizer)
    dtype = choose_dtype(args.dtype)
    spec = EngineSpec(
        kind=engine_kind,
        model=args.model,
        tokens_per_step=args.tokens_per_step,
        step_ms=args.step_ms,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        dtype=dtype.dtype,
        dtype_reason=dtype.reason,
        batch_invariant=args.batch_invariant,
        kv_transfer=kv_transfer_spec(args),
    )
    return ServerConfig(
        engine=spec,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        tokens_only=args.tokens_only,
        tokenizer=None if args.tokens_only else tokenizer,
        script=script,
        script_tokenizer=tokenizer if engine_kind == "scripted" else None,
        served_model_name=args.served_model_name,
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        api_server_count=args.api_server_count,
        log_level=args.log_level,
        log_format=args.log_format,
        enable_per_request_metrics=args.enable_per_request_metrics,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        max_waiting_requests=None if args.max_waiting_requests < 0 else args.max_waiting_requests,
        stream_idle_timeout_s=args.stream_idle_timeout or None,
        stream_interval=args.stream_interval,
        **_common_settings(args),
    )


def render_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        engine=None,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        tokenizer=args.tokenizer,
        served_model_name=args.served_model_name,
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        log_level=args.log_level,
        log_format=args.log_format,
        max_model_len=args.max_model_len,
        **_common_settings(args),
    )


def _common_settings(args: argparse.Namespace) -> dict[str, float | int | str | None]:
    """The settings of :func:`_add_server_args` beyond the basics, checked (every role has them)."""
    if args.shutdown_timeout < 0:
        raise ValueError("--shutdown-timeout must be 0 or more")
    if args.timeout_keep_alive <= 0:
        raise ValueError("--timeout-keep-alive must be positive")
    if args.derender_cache_entries < 0 or args.derender_cache_ttl <= 0:
        raise ValueError("--derender-cache-entries must be 0 or more and --derender-cache-ttl positive")
    if args.otlp_traces_endpoint is not None:
        traces_url(args.otlp_traces_endpoint)  # a ValueError naming the flag
    return {
        "otlp_traces_endpoint": args.otlp_traces_endpoint,
        "shutdown_timeout_s": args.shutdown_timeout,
        "timeout_keep_alive_s": args.timeout_keep_alive,
        "derender_cache_entries": args.derender_cache_entries,
        "derender_cache_ttl_s": args.derender_cache_ttl,
    }


def run_server_command(args: argparse.Namespace) -> int:
    """Run ``serve`` or ``launch render`` from parsed arguments; the exit code."""
    from pdserve.serve.runner import run_server

    if args.command == "serve":
        try:
            config = serve_config(args)
        except ValueError as e:
            print(f"pdserve: {e}", file=sys.stderr)
            return 2
        return run_server(config)
    try:
        config = render_config(args)
    except ValueError as e:
        print(f"pdserve: {e}", file=sys.stderr)
        return 2
    return run_server(config)
