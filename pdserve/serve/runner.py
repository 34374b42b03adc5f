"""Start a server process: load the tokenizer, build the engine, run uvicorn."""

from __future__ import annotations

import logging
import sys

import uvicorn

from pdserve.engine.factory import build_engine
from pdserve.serve.app import create_app
from pdserve.serve.config import ServerConfig
from pdserve.text.tokenizer import Tokenizer

logger = logging.getLogger("pdserve")


def load_parser_config(config: ServerConfig, tokenizer: Tokenizer | None):  # type: ignore[no-untyped-def]
    """Validate --reasoning-parser/--tool-call-parser against the tokenizer at startup."""
    if not (config.reasoning_parser or config.tool_call_parser):
        return None
    if tokenizer is None:
        raise ValueError("--reasoning-parser/--tool-call-parser need a tokenizer; drop --tokens-only")
    from pdserve.parsers import ParserConfig

    parsers = ParserConfig(
        reasoning_parser=config.reasoning_parser,
        tool_call_parser=config.tool_call_parser,
        enable_auto_tool_choice=config.enable_auto_tool_choice,
    )
    parsers.validate(tokenizer)
    return parsers


def run_server(config: ServerConfig) -> int:
    try:
        tokenizer = None if config.tokens_only or not config.tokenizer else Tokenizer.load(config.tokenizer)
        parsers = load_parser_config(config, tokenizer)
        engine = build_engine(config.engine) if config.engine is not None else None
    except ValueError as e:
        print(f"pdserve: {e}", file=sys.stderr)
        return 2
    app = create_app(config, engine, tokenizer)
    app.state.pdserve.parser_config = parsers
    uvicorn.run(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        loop="uvloop",
        http="httptools",
        timeout_graceful_shutdown=5,
    )
    return 0
