"""The server roles of the command line: ``serve`` (generate server) and ``launch render``."""

from __future__ import annotations

import argparse
import sys
from importlib import resources

from pdserve.engine.spec import EngineSpec
from pdserve.serve.config import ServerConfig

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


def add_server_commands(sub: argparse._SubParsersAction) -> None:
    """``serve`` and ``launch render``: the server roles (the top-level parser is :mod:`pdserve.cli`)."""
    serve = sub.add_parser("serve", help="run a generate server")
    serve.add_argument(
        "model", nargs="?", default=None,
        help="smollm2-135m (default), qwen3-tiny, a Hugging Face model dir or a .gguf file (torch engine)",
    )
    serve.add_argument("--engine", choices=["scripted", "torch"], default=None)
    serve.add_argument("--tokenizer", default=None, help="'qwen3' or a directory with tokenizer.json")
    serve.add_argument("--script", default=None, help="JSONL token scripts for --engine scripted")
    serve.add_argument("--tokens-per-step", type=int, default=1)
    serve.add_argument("--step-ms", type=float, default=0.0)
    serve.add_argument("--tokens-only", action="store_true", help="no tokenizer: token ids in and out only")
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument("--max-num-seqs", type=int, default=16)
    serve.add_argument("--dtype", default="bfloat16")
    serve.add_argument(
        "--batch-invariant", action="store_true",
        help="torch engine: every matmul call has one fixed shape, so a sequence's tokens never depend on "
        "its batch on any CPU (slower; see docs/engine.md)",
    )
    serve.add_argument("--api-server-count", type=int, default=1)
    _add_server_args(serve)

    launch = sub.add_parser("launch", help="run a server of another role")
    roles = launch.add_subparsers(dest="role", required=True)
    render = roles.add_parser("render", help="render + derender endpoints with a tokenizer and no engine")
    render.add_argument("--tokenizer", default="qwen3", help="'qwen3' or a directory with tokenizer.json")
    render.add_argument("--max-model-len", type=int, default=None, help="bound for derender inputs")
    _add_server_args(render)


def serve_config(args: argparse.Namespace) -> ServerConfig:
    """Resolve flags: a model runs on the torch engine (default: smollm2-135m); ``--engine
    scripted`` (or a ``--script``) replays scripts with the qwen3 tokenizer unless told otherwise."""
    engine_kind = args.engine or ("scripted" if args.script else "torch")
    script = args.script
    tokenizer = args.tokenizer
    if engine_kind == "scripted":
        if args.model:
            raise ValueError("--engine scripted takes no MODEL (it replays --script)")
        if args.batch_invariant:
            raise ValueError("--batch-invariant is a torch engine mode; --engine scripted has no model to run")
        script = script or demo_script_path()
        tokenizer = tokenizer or "qwen3"
    spec = EngineSpec(
        kind=engine_kind,
        model=args.model,
        tokens_per_step=args.tokens_per_step,
        step_ms=args.step_ms,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        dtype=args.dtype,
        batch_invariant=args.batch_invariant,
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
        max_model_len=args.max_model_len,
    )


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
    return run_server(render_config(args))
