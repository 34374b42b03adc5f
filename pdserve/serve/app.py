"""The FastAPI app: wires engine, tokenizer, parsers and routes; error handlers and auth.

This is the top of ``serve/``: it imports the routes, and nothing in ``serve/`` imports it back
(routes read :mod:`pdserve.serve.state`, :mod:`~pdserve.serve.http`, :mod:`~pdserve.serve.requests`
and :mod:`~pdserve.serve.responses`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI

from pdserve.engine.api import Engine
from pdserve.serve.config import ServerConfig
from pdserve.serve.http import install_auth, install_error_handlers, install_openapi_bodies
from pdserve.serve.metrics import Metrics
from pdserve.serve.routes import admin, derender, generate, openai
from pdserve.serve.state import AppState
from pdserve.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from pdserve.parsers import ParserConfig


def create_app(
    config: ServerConfig, engine: Engine | None, tokenizer: Tokenizer | None, *, owns_engine: bool = True,
    parser_config: ParserConfig | None = None,
) -> FastAPI:
    """Build the app. With ``owns_engine`` the app starts and stops the engine in its lifespan;
    ``parser_config`` is the validated --reasoning-parser/--tool-call-parser setup (None: no parser)."""
    metrics = Metrics(engine.stats if engine is not None else None, lambda: engine.info.kv if engine is not None else None)
    state = AppState(config=config, engine=engine, tokenizer=tokenizer, metrics=metrics, parser_config=parser_config)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if engine is not None and owns_engine:
            await engine.start()
        try:
            yield
        finally:
            if engine is not None and owns_engine:
                await engine.shutdown()

    app = FastAPI(title="pdserve", lifespan=lifespan)
    app.state.pdserve = state
    install_error_handlers(app)
    install_openapi_bodies(app)
    if config.api_key:
        install_auth(app, config.api_key)
    app.include_router(admin.router)
    if engine is not None:
        app.include_router(generate.router)
    if tokenizer is not None:
        app.include_router(openai.render_router)
        app.include_router(derender.router)
        if engine is not None:
            app.include_router(openai.coupled_router)
    return app
