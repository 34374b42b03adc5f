"""``pdserve`` command line: ``serve`` (generate server), ``launch render``, ``bench``."""

from __future__ import annotations

import argparse
import logging
import sys
from importlib import resources

from pdserve.engine.factory import EngineSpec
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="P/D generate server with inline text/derender output")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run a generate server")
    serve.add_argument("model", nargs="?", default=None, help="model name or path (torch engine)")
    serve.add_argument("--engine", choices=["scripted", "torch"], default=None)
    serve.add_argument("--tokenizer", default=None, help="'qwen3' or a directory with tokenizer.json")
    serve.add_argument("--script", default=None, help="JSONL token scripts for --engine scripted")
    serve.add_argument("--tokens-per-step", type=int, default=1)
    serve.add_argument("--step-ms", type=float, default=0.0)
    serve.add_argument("--tokens-only", action="store_true", help="no tokenizer: token ids in and out only")
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument("--max-num-seqs", type=int, default=16)
    serve.add_argument("--dtype", default="bfloat16")
    serve.add_argument("--api-server-count", type=int, default=1)
    _add_server_args(serve)

    launch = sub.add_parser("launch", help="run a server of another role")
    roles = launch.add_subparsers(dest="role", required=True)
    render = roles.add_parser("render", help="render + derender endpoints with a tokenizer and no engine")
    render.add_argument("--tokenizer", default="qwen3", help="'qwen3' or a directory with tokenizer.json")
    render.add_argument("--max-model-len", type=int, default=None, help="bound for derender inputs")
    _add_server_args(render)
    return parser


def serve_config(args: argparse.Namespace) -> ServerConfig:
    engine_kind = args.engine or "scripted"
    script = args.script
    tokenizer = args.tokenizer
    if engine_kind == "scripted":
        script = script or demo_script_path()
        tokenizer = tokenizer or "qwen3"
    spec = EngineSpec(
        kind=engine_kind,
        model=args.model,
        tokenizer=tokenizer,
        script=script,
        tokens_per_step=args.tokens_per_step,
        step_ms=args.step_ms,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        dtype=args.dtype,
    )
    return ServerConfig(
        engine=spec,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        tokens_only=args.tokens_only,
        tokenizer=None if args.tokens_only else tokenizer,
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from pdserve.serve.runner import run_server

    if args.command == "serve":
        return run_server(serve_config(args))
    if args.command == "launch" and args.role == "render":
        return run_server(render_config(args))
    return 2


if __name__ == "__main__":
    sys.exit(main())
