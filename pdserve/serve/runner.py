"""Start a server: load the tokenizer, bring up the engine (in process or as a core process),
run one or more uvicorn frontends.

Layouts:

* render server (no engine), and the vLLM engine (its AsyncLLM has its own core process): one process.
* the torch and the scripted engine: the engine core runs in its own process, so the API process's
  CPU is the frontend's alone (what the benchmarks measure); the frontends (this process for
  ``--api-server-count`` 1, N spawned processes otherwise, all listening on the same port with
  SO_REUSEPORT) reach it through EngineCoreClient. The supervisor stops everything when any part
  exits or on SIGINT/SIGTERM.
"""

from __future__ import annotations

import gc
import json
import logging
import multiprocessing
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec
import uvicorn

from pdserve.engine.api import Engine, EngineError
from pdserve.engine.factory import build_engine
from pdserve.engine.spec import TokenScript
from pdserve.parsers import ParserConfig
from pdserve.protocol.engine import ABORT_FOR_SHUTDOWN
from pdserve.serve.app import create_app
from pdserve.serve.banner import ready_banner
from pdserve.serve.config import ServerConfig
from pdserve.serve.http.protocol import BoundedHttpToolsProtocol
from pdserve.serve.inflight import drain
from pdserve.serve.state import AppState
from pdserve.serve.tracing import PHASE_PATHS, configure_tracing
from pdserve.text.tokenizer import Tokenizer
from pdserve.web.logs import configure_json_logging, serving, uvicorn_logging
from pdserve.web.quiet_server import DrainingServer

logger = logging.getLogger("pdserve")


def load_tokenizer(config: ServerConfig) -> Tokenizer | None:
    if config.tokens_only or not config.tokenizer:
        return None
    tokenizer = Tokenizer.load(config.tokenizer)
    tokenizer.warm_tables()
    return tokenizer


def load_parser_config(config: ServerConfig, tokenizer: Tokenizer | None) -> ParserConfig | None:
    """Validate --reasoning-parser/--tool-call-parser against the tokenizer at startup."""
    if not (config.reasoning_parser or config.tool_call_parser):
        return None
    if tokenizer is None:
        raise ValueError("--reasoning-parser/--tool-call-parser need a tokenizer; drop --tokens-only")

    parsers = ParserConfig(
        reasoning_parser=config.reasoning_parser,
        tool_call_parser=config.tool_call_parser,
        enable_auto_tool_choice=config.enable_auto_tool_choice,
    )
    parsers.validate(tokenizer)
    return parsers


def resolve_model_tokenizer(config: ServerConfig) -> ServerConfig:
    """For a model engine, build the model dir once (GGUF conversion) and read its tokenizer from it."""
    spec = config.engine
    if spec is None or spec.kind != "torch":
        return config
    from pdserve.checkpoints.resolve import resolve_model

    model_dir = resolve_model(spec.model)
    tokenizer = None if config.tokens_only else (config.tokenizer or str(model_dir))
    return replace(config, tokenizer=tokenizer)


def load_scripts(path: str | Path, encode: Callable[[str], list[int]]) -> list[TokenScript]:
    """Read a JSONL script file: ``{"text": ...}`` (``encode`` turns it into ids) or ``{"token_ids": [...]}``,
    each optionally with ``"fail_after": N``."""
    scripts = []
    for line_no, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        entry = json.loads(line)
        if "token_ids" in entry:
            ids = [int(i) for i in entry["token_ids"]]
        elif "text" in entry:
            ids = encode(entry["text"])
        else:
            raise ValueError(f"{path}:{line_no}: a script line needs 'text' or 'token_ids'")
        if not ids:
            raise ValueError(f"{path}:{line_no}: empty script")
        fail_after = entry.get("fail_after")
        scripts.append(TokenScript(ids, None if fail_after is None else int(fail_after)))
    if not scripts:
        raise ValueError(f"{path}: no scripts")
    return scripts


def encode_scripts(config: ServerConfig, tokenizer: Tokenizer | None) -> ServerConfig:
    """The scripted engine knows token ids only: encode ``--script`` here and put ids, vocabulary
    size and EOS in its spec (``tokenizer`` is reused when it is the scripts' tokenizer)."""
    spec = config.engine
    if spec is None or spec.kind != "scripted":
        return config
    if not config.script:
        raise ValueError("the scripted engine needs --script FILE (JSONL of {'text': ...} or {'token_ids': [...]})")
    name = config.script_tokenizer
    if not name:
        raise ValueError("the scripted engine needs --tokenizer (e.g. qwen3)")
    encoder = tokenizer if tokenizer is not None and config.tokenizer == name else Tokenizer.load(name)
    if encoder.eos_token_id is None:
        raise ValueError(f"tokenizer {name!r} has no eos_token; the scripted engine ends scripts with it")
    scripts = load_scripts(config.script, encoder.encode)
    spec = msgspec.structs.replace(
        spec, scripts=scripts, vocab_size=encoder.vocab_size, eos_token_ids=[encoder.eos_token_id]
    )
    return replace(config, engine=spec)


def _bind(host: str, port: int, reuse_port: bool) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


class _PdserveServer(DrainingServer):
    """uvicorn that prints the ready banner once it accepts connections (after the app's startup), and
    shuts down gracefully: the first SIGTERM/SIGINT drains (serve.inflight.drain: 503 for anything new,
    ``--shutdown-timeout`` for what runs, then an abort naming the shutdown), a second one stops at once."""

    def __init__(self, config: uvicorn.Config, announce: Callable[[], str] | None, state: AppState) -> None:
        super().__init__(config)
        self._announce = announce
        self._state = state

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        freeze_startup_heap()
        if self._announce is not None and not self.should_exit:
            print(self._announce(), file=sys.stderr, flush=True)

    async def drain(self) -> None:
        state = self._state
        timeout = state.config.shutdown_timeout_s
        logger.warning("pdserve: shutting down: refusing new requests; %d in flight get %.1f s to finish",
                       len(state.inflight.requests), timeout)
        engine = state.engine

        async def abort(ids: list[str]) -> None:
            if engine is not None:
                await engine.abort(ids, ABORT_FOR_SHUTDOWN)

        await drain(state.inflight, timeout, abort)


def freeze_startup_heap() -> None:
    """Move everything built at startup (tokenizer tables, the app, the engine client: some 200k
    objects, all as long-lived as the server) out of the cyclic collector's reach.

    Otherwise every full collection walks them again: 30-70 ms each, at a rate set by what requests
    allocate, which showed up as a tenth of the API process's CPU under streaming load. Collections
    then walk only what requests made; the frozen objects stay alive and are freed at exit as usual.
    """
    gc.collect()
    gc.freeze()


def _serve_app(config: ServerConfig, engine: Engine | None, tokenizer: Tokenizer | None, parsers: ParserConfig | None,
               sock: socket.socket, announce: bool = True) -> None:
    host, port = sock.getsockname()[:2]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    tracing = configure_tracing(config, url)  # None without --otlp-traces-endpoint
    app = create_app(config, engine, tokenizer, parser_config=parsers, tracing=tracing)
    served = app if tracing is None else tracing.middleware(app, PHASE_PATHS)
    server = _PdserveServer(
        # httptools bounded to MAX_HEADER_BYTES of request head (431 past it; httptools has no limit of its own).
        uvicorn.Config(serving(served, config.log_format, url), log_level=config.log_level, loop="uvloop",
                       http=BoundedHttpToolsProtocol, timeout_graceful_shutdown=5,
                       timeout_keep_alive=config.timeout_keep_alive_s, **uvicorn_logging(config.log_format)),
        (lambda: ready_banner(app.state.pdserve, url)) if announce else None,
        app.state.pdserve,
    )
    try:
        server.run(sockets=[sock])
    finally:
        if tracing is not None:
            tracing.shutdown()  # the spans still queued go out before the process stops


def _frontend_main(config: ServerConfig, index: int) -> None:
    """Entry point of one spawned frontend process (connects to the running engine core)."""
    from pdserve.engine.core_client import EngineCoreClient
    from pdserve.engine.core_server import EngineCoreAddresses

    if config.log_format == "json":
        configure_json_logging(config.log_level, f"frontend-{index}")
    else:
        logging.basicConfig(level=config.log_level.upper(),
                            format=f"%(asctime)s frontend-{index} %(levelname)s: %(message)s")
    tokenizer = load_tokenizer(config)
    parsers = load_parser_config(config, tokenizer)
    assert config.engine_core_addresses is not None
    engine = EngineCoreClient(EngineCoreAddresses(**config.engine_core_addresses))
    sock = _bind(config.host, config.port, reuse_port=True)
    _serve_app(config, engine, tokenizer, parsers, sock, announce=index == 0)


def run_server(config: ServerConfig) -> int:
    if config.log_format == "json":
        configure_json_logging(config.log_level, "frontend-0" if config.engine is not None else "render")
    try:
        config = resolve_model_tokenizer(config)
        tokenizer = load_tokenizer(config)
        parsers = load_parser_config(config, tokenizer)
        config = encode_scripts(config, tokenizer)
        if config.api_server_count < 1:
            raise ValueError("--api-server-count must be at least 1")
        spec = config.engine
        if spec is None or spec.kind == "vllm":
            engine = build_engine(spec) if spec is not None else None
            _serve_app(config, engine, tokenizer, parsers, _bind(config.host, config.port, reuse_port=False))
            return 0
    except ValueError as e:
        print(f"pdserve: {e}", file=sys.stderr)
        return 2
    return _run_with_core(config, tokenizer, parsers)


def _run_with_core(config: ServerConfig, tokenizer: Tokenizer | None, parsers: ParserConfig | None) -> int:
    from pdserve.engine.core import start_engine_core
    from pdserve.engine.core_client import EngineCoreClient

    assert config.engine is not None
    # The port is taken before the core starts: loading a model takes seconds, and the core's NIXL
    # agent (UCX) opens sockets on ephemeral ports, which could be the very port this server was given.
    # With several frontends, this socket holds the port (SO_REUSEPORT) while they bind their own.
    sock = _bind(config.host, config.port, reuse_port=config.api_server_count > 1)
    try:
        handle = start_engine_core(config.engine)
    except (EngineError, ValueError) as e:
        sock.close()
        print(f"pdserve: the engine core failed to start: {e}", file=sys.stderr)
        return 2
    config = replace(config, engine_core_addresses={"endpoint": handle.addresses.endpoint})
    try:
        if config.api_server_count == 1:
            engine = EngineCoreClient(handle.addresses)
            _serve_app(config, engine, tokenizer, parsers, sock)
            return 0
        return _supervise_frontends(config, handle)
    finally:
        sock.close()
        handle.shutdown()


def _supervise_frontends(config: ServerConfig, handle: Any) -> int:
    ctx = multiprocessing.get_context("spawn")
    frontends = [
        ctx.Process(target=_frontend_main, args=(config, i), name=f"pdserve-frontend-{i}", daemon=False)
        for i in range(config.api_server_count)
    ]
    stopping = False

    def _stop(signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True

    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    for proc in frontends:
        proc.start()
    logger.warning("pdserve: %d frontends on %s:%d, engine core pid %d", len(frontends), config.host, config.port,
                   handle.process.pid)
    code = 0
    try:
        while not stopping:
            if any(not p.is_alive() for p in frontends):
                code = 1
                logger.error("pdserve: a frontend process exited; stopping")
                break
            time.sleep(0.2)
    finally:
        for proc in frontends:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM)
        for proc in frontends:
            proc.join(config.shutdown_timeout_s + 10)  # each drains first (--shutdown-timeout)
            if proc.is_alive():
                proc.kill()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code
