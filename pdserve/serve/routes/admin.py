"""Health, model list, Prometheus metrics, and the KV hand-off metadata decode engines pull with."""

from __future__ import annotations

import os
import time

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from pdserve.serve.http.errors import error_json
from pdserve.serve.state import app_state

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    """200 while the engine runs; 503 once it is gone. Headers name the processes (for operators
    and tests): this frontend's pid and, behind an engine-core process, the core's pid."""
    state = app_state(request)
    headers = {"x-pdserve-pid": str(os.getpid())}
    core_pid = getattr(state.engine, "core_pid", None)
    if core_pid is not None:
        headers["x-pdserve-core-pid"] = str(core_pid)
    if state.engine is not None and not state.engine.is_healthy():
        response = error_json("engine is not running", 503, "ServiceUnavailableError")
        response.headers.update(headers)
        return response
    return Response(status_code=200, headers=headers)


# Load balancers probe with HEAD: the same answer, without a body (kept out of the schema: one operation).
router.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    state = app_state(request)
    card = {"id": state.model_name, "object": "model", "created": int(time.time()), "owned_by": "pdserve"}
    if state.engine is not None:
        card["max_model_len"] = state.engine.info.max_model_len
    return JSONResponse({"object": "list", "data": [card]})


@router.get("/kv/metadata")
async def kv_metadata(request: Request) -> Response:
    """This engine's NIXL agent and block pool (``--kv-transfer nixl``): what a decode engine fetches
    from ``remote_host:remote_port`` of a prefill response before it READs the blocks."""
    engine = app_state(request).engine
    if engine is None or engine.info.kv is None:
        return error_json("this server hands off no KV: start it with --kv-transfer nixl", 404, "NotFoundError")
    return Response(msgspec.json.encode(engine.info.kv), media_type="application/json")


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """pdserve's metrics; with ``--engine vllm`` vLLM's own (``vllm:*``, in the process's default registry,
    where vLLM's Prometheus logger puts them) follow, so nothing vLLM reports is hidden."""
    state = app_state(request)
    body = generate_latest(state.metrics.registry)
    if state.config.engine is not None and state.config.engine.kind == "vllm":
        body += generate_latest(REGISTRY)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
