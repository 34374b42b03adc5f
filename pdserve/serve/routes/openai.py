"""Render endpoints and the coupled OpenAI endpoints (render + generate + postprocess in one call)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pdserve.output.openai_builders import (
    chat_chunk,
    chat_response,
    chat_role_chunk,
    completion_chunk,
    completion_response,
)
from pdserve.output.policy import usage_chunk, usage_of
from pdserve.output.request_state import ChoiceUpdate, RequestState
from pdserve.protocol.generate import GenerateRequest
from pdserve.protocol.openai import ChatCompletionRequest, CompletionRequest, UsageInfo
from pdserve.protocol.sse import sse_event, sse_event_bytes
from pdserve.serve.admission import admit
from pdserve.serve.event_stream import DirectBody, DirectEvents
from pdserve.serve.http import parse_body
from pdserve.serve.render import render_chat, render_completion
from pdserve.serve.responses import merged_updates, respond_batch, respond_stream
from pdserve.serve.state import AppState, app_state

render_router = APIRouter()
coupled_router = APIRouter()


def rendered_json(req: GenerateRequest) -> dict[str, Any]:
    """A GenerateRequest as vLLM 0.33's /render returns it: every top-level key (nulls included) and
    sampling_params as vLLM serializes them, so either server's render feeds either server's generate."""
    body = req.model_dump(mode="json", exclude={"chat_request"})
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
    return_ids = bool(chat.return_token_ids)
    rstate = prepared[0][1]
    if not chat.stream:
        return await respond_batch(
            request, state, prepared, ("chat", "derender"),
            lambda: chat_response(
                rstate.choices, response_id, state.model_name,
                usage_of(len(gen.token_ids), rstate.completion_tokens), return_ids,
                prompt_token_ids=gen.token_ids, kv_transfer_params=rstate.kv_transfer_params,
                metrics=rstate.metrics() if state.config.enable_per_request_metrics else None,
            ),
        )
    include_usage = bool(chat.stream_options and chat.stream_options.include_usage)
    continuous = include_usage and bool(chat.stream_options and chat.stream_options.continuous_usage_stats)

    model = state.model_name
    prompt_len = len(gen.token_ids)

    def event(update: ChoiceUpdate) -> bytes | None:
        """An update's chunk, for the stream's loop and for the engine's dispatch alike (serve.driver)."""
        state.metrics.tokens_out.inc(len(update.token_ids))
        no_delta = update.delta is None or update.delta.is_empty()
        # A step whose text the parser holds back still carries its logprobs/ids: send it.
        if no_delta and not update.finished and not update.has_logprob_entries and not (return_ids and update.token_ids):
            return None
        usage = usage_of(prompt_len, len(rstate.choices[update.index].token_ids)) if continuous else None
        choice = rstate.choices[update.index]
        metrics = rstate.metrics() if state.config.enable_per_request_metrics and rstate.finished else None
        return sse_event_bytes(chat_chunk(choice, update, response_id, model, return_ids, usage, metrics=metrics))

    direct = DirectBody()

    async def events() -> AsyncIterator[str | bytes]:
        for i in range(len(rstate.choices)):
            yield sse_event(chat_role_chunk(response_id, model, i))
        async for _, update in merged_updates(state, prepared, DirectEvents(direct, event)):
            chunk = event(update)
            if chunk is not None:
                yield chunk
        if include_usage:
            head = {"id": response_id, "object": "chat.completion.chunk", "model": model}
            yield sse_event(usage_chunk(head, usage_of(prompt_len, rstate.completion_tokens)))

    return respond_stream(state, ("chat", "derender"), prepared, events(), direct)


@coupled_router.post("/v1/completions")
async def completions(request: Request) -> Response:
    state = app_state(request)
    req = await parse_body(request, CompletionRequest)
    gens = render_completion(state, req, request.headers.get("x-request-id"))
    for gen in gens:
        gen.output_mode = "text"
    response_id = gens[0].request_id.removesuffix("-0")
    prepared = [admit(state, gen, gen.request_id, completions_cut=True).pair for gen in gens]
    states = [r for _, r in prepared]
    return_ids = bool(req.return_token_ids)
    if not req.stream:
        return await respond_batch(
            request, state, prepared, ("completions", "text"),
            lambda: completion_response(
                [s.choices for s in states], response_id, state.model_name, _completions_usage(states), return_ids,
                metrics=_single_metrics(state, states),
            ),
        )
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    # Choice indexes run across prompts: prompt k's choice i is k * n + i.
    n = req.n

    model = state.model_name
    offsets: dict[int, int] = {}

    def event(k: int, update: ChoiceUpdate) -> bytes | None:
        """Prompt ``k``'s update as a chunk, for the stream's loop and (one prompt) the engine's dispatch."""
        state.metrics.tokens_out.inc(len(update.token_ids))
        if not update.text and not update.finished and not update.token_ids:
            return None
        index = k * n + update.index
        offset = offsets.get(index, 0)
        finished = all(s.finished for s in states)
        metrics = _single_metrics(state, states) if finished else None
        offsets[index] = offset + len(update.text)
        return sse_event_bytes(completion_chunk(update, index, offset, response_id, model, return_ids, None, metrics))

    direct = DirectBody()
    # Several prompts are merged through a queue, so only a single prompt's stream can be written directly.
    outlet = DirectEvents(direct, lambda update: event(0, update)) if len(prepared) == 1 else None

    async def events() -> AsyncIterator[str | bytes]:
        async for k, update in merged_updates(state, prepared, outlet):
            chunk = event(k, update)
            if chunk is not None:
                yield chunk
        if include_usage:
            head = {"id": response_id, "object": "text_completion", "model": model}
            yield sse_event(usage_chunk(head, _completions_usage(states)))

    return respond_stream(state, ("completions", "text"), prepared, events(), direct)


def _single_metrics(state: AppState, states: Sequence[RequestState]) -> dict[str, Any] | None:
    """Per-request timing when enabled and the completions request has one prompt (as vLLM: a
    multi-prompt request is several requests, with no one timing)."""
    if not state.config.enable_per_request_metrics or len(states) != 1:
        return None
    return states[0].metrics()


def _completions_usage(states: Sequence[RequestState]) -> UsageInfo:
    """Usage summed over every prompt of a completions request."""
    prompt_tokens = sum(len(s.config.prompt_token_ids) for s in states)
    return usage_of(prompt_tokens, sum(s.completion_tokens for s in states))
