"""The request bodies in ``/openapi.json`` (routes read them by hand, so FastAPI alone would not publish them)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import TypeAdapter

from pdserve.protocol.derender import chat_derender_adapter, completion_derender_adapter
from pdserve.protocol.generate import AbortRequest, GenerateRequest
from pdserve.protocol.openai import ChatCompletionRequest, CompletionRequest


def _request_bodies() -> dict[str, Any]:
    """The body each JSON route parses (by hand, through :func:`parse_body`), as a TypeAdapter per path."""
    chat, completion = TypeAdapter(ChatCompletionRequest), TypeAdapter(CompletionRequest)
    return {
        "/inference/v1/generate": TypeAdapter(GenerateRequest),
        "/inference/v1/abort_requests": TypeAdapter(AbortRequest),
        "/abort_requests": TypeAdapter(AbortRequest),
        "/v1/chat/completions": chat,
        "/v1/chat/completions/render": chat,
        "/v1/completions": completion,
        "/v1/completions/render": completion,
        "/v1/chat/completions/derender": chat_derender_adapter,
        "/v1/completions/derender": completion_derender_adapter,
    }


def install_openapi_bodies(app: FastAPI) -> None:
    """Declare the request bodies in ``/openapi.json``: routes read them with :func:`parse_body` (for the
    error messages and limits it adds), so FastAPI alone would publish body-less operations, and clients
    and schema-driven fuzzers (tests/e2e/test_schemathesis.py) would not know what to send."""
    plain_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = plain_openapi()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, adapter in _request_bodies().items():
            operation = schema.get("paths", {}).get(path, {}).get("post")
            if operation is None:
                continue
            body = adapter.json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
