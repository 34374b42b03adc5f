"""Health, model list and Prometheus metrics."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdserve.serve.app import app_state, error_json

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    state = app_state(request)
    if state.engine is not None and not state.engine.is_healthy():
        return error_json("engine is not running", 503, "ServiceUnavailableError")
    return Response(status_code=200)


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    state = app_state(request)
    card = {"id": state.model_name, "object": "model", "created": int(time.time()), "owned_by": "pdserve"}
    if state.engine is not None:
        card["max_model_len"] = state.engine.info.max_model_len
    return JSONResponse({"object": "list", "data": [card]})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(app_state(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)
