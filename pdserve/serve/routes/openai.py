"""Render endpoints and the coupled OpenAI endpoints (render + generate + postprocess in one call)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pdserve.output.surfaces import ChatSurface, CompletionsSurface
from pdserve.protocol.generate import GenerateRequest
from pdserve.protocol.openai import ChatCompletionRequest, CompletionRequest
from pdserve.serve.admission import admit
from pdserve.serve.http.body import parse_body
from pdserve.serve.render import render_chat, render_completion
from pdserve.serve.responses import respond
from pdserve.serve.state import app_state

render_router = APIRouter()
coupled_router = APIRouter()


def rendered_json(req: GenerateRequest) -> dict[str, Any]:
    """A GenerateRequest as vLLM 0.33's /render returns it: every top-level key (nulls included) and
    sampling_params as vLLM serializes them, so either server's render feeds either server's generate.
    pdserve's own request-side fields (``chat_request``, ``prior_output_chunks``) are not rendered."""
    body = req.model_dump(mode="json", exclude={"chat_request", "prior_output_chunks"})
    body["sampling_params"] = req.sampling_params.vllm_json()
    return body


@render_router.post("/v1/chat/completions/render")
async def chat_render(request: Request) -> JSONResponse:
    state = app_state(request)
    chat = await parse_body(request, ChatCompletionRequest)
    return JSONResponse(rendered_json(render_chat(state, chat, request.headers.get("x-request-id"))))


@render_router.post("/v1/completions/render")
async def completion_render(request: Request) -> JSONResponse:
    state = app_state(request)
    req = await parse_body(request, CompletionRequest)
    rendered = render_completion(state, req, request.headers.get("x-request-id"))
    return JSONResponse([rendered_json(r) for r in rendered])


@coupled_router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    state = app_state(request)
    chat = await parse_body(request, ChatCompletionRequest)
    gen = render_chat(state, chat, request.headers.get("x-request-id"))
    gen.output_mode = "derender"
    response_id = gen.request_id
    prepared = [admit(state, gen, response_id).pair]
    opts = chat.stream_options
    surface = ChatSurface(
        response_id, state.model_name, n=len(prepared[0][1].choices), return_token_ids=bool(chat.return_token_ids),
        include_usage=bool(opts and opts.include_usage), continuous_usage=bool(opts and opts.continuous_usage_stats),
    )
    return await respond(request, state, prepared, surface, bool(chat.stream))


@coupled_router.post("/v1/completions")
async def completions(request: Request) -> Response:
    state = app_state(request)
    req = await parse_body(request, CompletionRequest)
    gens = render_completion(state, req, request.headers.get("x-request-id"))
    for gen in gens:
        gen.output_mode = "text"
    response_id = gens[0].request_id.removesuffix("-0")
    prepared = [admit(state, gen, gen.request_id, completions_cut=True).pair for gen in gens]
    surface = CompletionsSurface(
        response_id, state.model_name, n=req.n, return_token_ids=bool(req.return_token_ids),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
    )
    return await respond(request, state, prepared, surface, bool(req.stream))
