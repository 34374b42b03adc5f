"""The FastAPI app: wires engine, tokenizer and routes; errors and auth in one place."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.engine.api import Engine, EngineDeadError, EngineError
from pdserve.protocol.errors import RequestError
from pdserve.serve.config import ServerConfig
from pdserve.serve.metrics import Metrics
from pdserve.text.tokenizer import Tokenizer

logger = logging.getLogger("pdserve")
ModelT = TypeVar("ModelT", bound=BaseModel)


@dataclass
class AppState:
    config: ServerConfig
    engine: Engine | None
    tokenizer: Tokenizer | None
    metrics: Metrics
    parser_config: Any = None  # pdserve.parsers.ParserConfig when parsers are configured

    @property
    def model_name(self) -> str:
        if self.config.served_model_name:
            return self.config.served_model_name
        if self.engine is not None:
            return self.engine.info.model_name
        return self.config.tokenizer or "pdserve"

    def require_engine(self) -> Engine:
        if self.engine is None:
            raise RequestError("this server has no engine (pdserve launch render): it serves render/derender only")
        if not self.engine.is_healthy():
            raise EngineDeadError("the engine is not running; see the server log")
        return self.engine


def app_state(request: Request) -> AppState:
    return request.app.state.pdserve


def format_validation_error(err: ValidationError | RequestValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e.get("loc", ()) if x not in ("body",))
        msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts) or "invalid request"


async def parse_body(request: Request, model: type[ModelT] | TypeAdapter[Any]) -> Any:
    """Read a JSON body into ``model`` (a model class or a TypeAdapter of a union); every failure
    is a 400 that says what was wrong."""
    state = app_state(request)
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise RequestError(f"Content-Type must be application/json (got {content_type or 'none'!r})")
    declared = request.headers.get("content-length")
    limit = state.config.max_body_bytes
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(f"request body of {declared} bytes is over the limit of {limit} bytes")
    raw = await request.body()
    if len(raw) > limit:
        raise RequestError(f"request body of {len(raw)} bytes is over the limit of {limit} bytes")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"JSON decode error: {e}") from None
    if not isinstance(data, dict):
        raise RequestError("request body must be a JSON object")
    try:
        if isinstance(model, TypeAdapter):
            return model.validate_python(data)
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestError(format_validation_error(e)) from None


def error_json(message: str, status: int, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}, status_code=status
    )


def error_event(message: str, status: int, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError) -> JSONResponse:
        return error_json(exc.message, exc.status, exc.kind, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_json(format_validation_error(exc), 400, "BadRequestError")

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_json(f"engine unavailable: {exc}", 503, "ServiceUnavailableError")

    @app.exception_handler(EngineError)
    async def _engine_error(_: Request, exc: EngineError) -> JSONResponse:
        return error_json(f"engine error: {exc}", 500, "InternalServerError")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_json(str(exc.detail), exc.status_code, "NotFoundError" if exc.status_code == 404 else "Error")


def install_auth(app: FastAPI, api_key: str) -> None:
    """Every route but /health needs ``Authorization: Bearer <key>``."""

    @app.middleware("http")
    async def _check_key(request: Request, call_next):  # type: ignore[no-untyped-def]
        if request.url.path != "/health" and request.headers.get("authorization") != f"Bearer {api_key}":
            return error_json("missing or wrong API key (Authorization: Bearer <key>)", 401, "AuthenticationError")
        return await call_next(request)


def create_app(
    config: ServerConfig, engine: Engine | None, tokenizer: Tokenizer | None, *, owns_engine: bool = True
) -> FastAPI:
    """Build the app. With ``owns_engine`` the app starts and stops the engine in its lifespan."""
    from pdserve.serve.routes import admin, derender, generate, openai

    metrics = Metrics(engine.stats if engine is not None else None)
    state = AppState(config=config, engine=engine, tokenizer=tokenizer, metrics=metrics)

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
