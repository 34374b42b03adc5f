"""The FastAPI app: wires engine, tokenizer, parsers and routes; error handlers and auth.

This is the top of ``serve/``: it imports the routes, and nothing in ``serve/`` imports it back
(routes read :mod:`pdserve.serve.state`, :mod:`~pdserve.serve.http`, :mod:`~pdserve.serve.requests`
and :mod:`~pdserve.serve.responses`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI

from pdserve.engine.api import DirectDelivery, Engine
from pdserve.output.derender_cache import DerenderCache
from pdserve.serve.config import ServerConfig
from pdserve.serve.http.gate import Gate
from pdserve.serve.http.handlers import install_error_handlers
from pdserve.serve.http.openapi import install_openapi_bodies
from pdserve.serve.inflight import watch_idle_streams
from pdserve.serve.metrics import Metrics
from pdserve.serve.routes import admin, derender, generate, openai
from pdserve.serve.state import AppState
from pdserve.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from pdserve.parsers import ParserConfig
    from pdserve.web.tracing import Tracing


def create_app(
    config: ServerConfig, engine: Engine | None, tokenizer: Tokenizer | None, *, owns_engine: bool = True,
    parser_config: ParserConfig | None = None, tracing: Tracing | None = None,
) -> FastAPI:
    """Build the app. With ``owns_engine`` the app starts and stops the engine in its lifespan;
    ``parser_config`` is the validated --reasoning-parser/--tool-call-parser setup (None: no parser);
    ``tracing`` this process's tracer (--otlp-traces-endpoint; the caller puts its middleware around the app)."""
    metrics = Metrics(
        engine.stats if engine is not None else None, lambda: engine.info if engine is not None else None,
        decoded_ids=lambda: tokenizer.decoded_ids if tokenizer is not None else None,
        direct_outputs=lambda: engine.direct_outputs() if isinstance(engine, DirectDelivery) else None,
    )
    state = AppState(config=config, engine=engine, tokenizer=tokenizer, metrics=metrics, parser_config=parser_config,
                     tracing=tracing)
    entries, ttl = config.derender_cache_entries, config.derender_cache_ttl_s
    state.derender_cache = metrics.watch_derender_cache(DerenderCache(entries, ttl) if entries else None)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if engine is not None and owns_engine:
            await engine.start()
        if engine is not None and config.max_waiting_requests is not None:  # info: known once started
            state.inflight.capacity = engine.info.max_num_seqs + config.max_waiting_requests
        watcher = None
        if config.stream_idle_timeout_s is not None:
            watcher = asyncio.ensure_future(watch_idle_streams(
                state.inflight, config.stream_idle_timeout_s, metrics.idle_streams_closed.inc
            ))
        try:
            yield
        finally:
            if watcher is not None:
                watcher.cancel()
            if engine is not None and owns_engine:
                await engine.shutdown()

    app = FastAPI(title="pdserve", lifespan=lifespan)
    app.state.pdserve = state
    # The gate (draining 503, API key) sits inside the 5xx counter, which is outermost.
    app.add_middleware(Gate, api_key=config.api_key, inflight=state.inflight)
    install_error_handlers(app)
    install_openapi_bodies(app)
    app.include_router(admin.router)
    if engine is not None:
        app.include_router(generate.router)
    if tokenizer is not None:
        app.include_router(openai.render_router)
        app.include_router(derender.router)
        if engine is not None:
            app.include_router(openai.coupled_router)
    return app
