"""Stateless ``/derender`` endpoints: the compatibility path and the benchmark baseline.

Each handler parses, validates against this server (model length, vocabulary, parser context),
calls :mod:`pdserve.output.derender` to replay and advance the client's state, and responds with
the same surfaces (:mod:`pdserve.output.surfaces`) as the coupled endpoints. A streamed chunk that follows the previous one of its
stream continues the state cached by that chunk (``--derender-cache-entries``) where there is one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pdserve.output import derender
from pdserve.output.derender_cache import StreamKey, ids_digest, text_digest
from pdserve.output.policy import usage_chunk, usage_of
from pdserve.output.surfaces import ChatSurface, CompletionsSurface
from pdserve.protocol.derender import (
    DerenderChatStreamRequest,
    DerenderCompletionStreamRequest,
    DerenderStreamState,
    chat_derender_adapter,
    completion_derender_adapter,
    encode_stream_state,
)
from pdserve.protocol.errors import RequestError
from pdserve.protocol.generate import GenerateTokensChoice, GenerateTokensStreamChoice
from pdserve.protocol.limits import MAX_N
from pdserve.protocol.openai import ChatCompletionRequest, CompletionRequest
from pdserve.serve.http.body import parse_body
from pdserve.serve.requests import (
    batch_stop_config,
    derender_chat_config,
    derender_chat_top_limit,
    derender_completion_config,
    max_model_len,
    stop_tokens_config,
)
from pdserve.serve.state import AppState, app_state
from pdserve.text.logprobs import completion_top_limit

router = APIRouter()

MAX_LOGPROBS = 20


def _check_prompt(state: AppState, prompt_ids: Sequence[int] | None) -> None:
    """The prompt the output continues: within the model length and the vocabulary (its ids index the
    tokenizer's tables)."""
    if prompt_ids is None:
        return
    limit = max_model_len(state)
    if len(prompt_ids) > limit:
        raise RequestError(f"prompt_token_ids has {len(prompt_ids)} ids, over the model length {limit}",
                           param="prompt_token_ids")
    vocab = state.output_vocab_size
    bad = next((t for t in prompt_ids if t >= vocab), None)
    if bad is not None:
        raise RequestError(f"prompt_token_ids has token id {bad}, outside the vocabulary (size {vocab})",
                           param="prompt_token_ids")


def _check_indexes(choices: Sequence[GenerateTokensChoice], where: str) -> None:
    if sorted(c.index for c in choices) != list(range(len(choices))):
        raise RequestError(f"{where} must be indexed 0..{len(choices) - 1}, each once", param=where)


def _sent_n(req: ChatCompletionRequest | CompletionRequest | None) -> int | None:
    """The n the client sent (a default n says nothing about the stream it derenders)."""
    return req.n if req is not None and "n" in req.model_fields_set else None


def _max_choices(state: AppState, n: int | None) -> int:
    """How many choices a stream may have: the request's n, else as many as this server runs at once."""
    if n is not None:
        return n
    return state.engine.info.max_num_seqs if state.engine is not None else MAX_N


def _check_bounds(state: AppState, choices: Sequence[GenerateTokensChoice], prompt_ids: Sequence[int] | None) -> None:
    _check_prompt(state, prompt_ids)
    limit, vocab = max_model_len(state), state.output_vocab_size
    for c in choices:
        if not c.token_ids:
            raise RequestError(f"choice {c.index} has empty or null token_ids")
        if len(c.token_ids) > limit:
            raise RequestError(f"choice {c.index} has {len(c.token_ids)} token ids, over the model length {limit}")
        if any(t < 0 or t >= vocab for t in c.token_ids):
            raise RequestError(f"choice {c.index} has token ids outside the vocabulary (size {vocab})")
        content = c.logprobs.content if c.logprobs is not None else None
        if content is not None and any(len(e.top_logprobs) > MAX_LOGPROBS + 1 for e in content):
            raise RequestError(f"choice {c.index} has more than {MAX_LOGPROBS + 1} logprob candidates per position")


def _require_context(state: AppState, chat: ChatCompletionRequest | None) -> None:
    if state.parsers_configured and chat is None:
        raise RequestError(
            "chat_request is required when a tool or reasoning parser is configured because plain "
            "detokenization would leak raw parser markup into content"
        )


def _stream_choice(
    state: AppState, chunk_choices: list[GenerateTokensStreamChoice], n: int | None
) -> GenerateTokensStreamChoice | None:
    if len(chunk_choices) > 1:
        raise RequestError("a streamed generate chunk carries one choice; send each choice's chunks separately")
    if not chunk_choices:
        return None
    choice = chunk_choices[0]
    limit = _max_choices(state, n)
    if choice.index >= limit:
        raise RequestError(f"generate_chunk.choices[0].index is {choice.index}, but the stream has at most {limit} "
                           "choices (the request's n, else this server's max_num_seqs)",
                           param="generate_chunk.choices.index")
    vocab = state.output_vocab_size
    if any(t < 0 or t >= vocab for t in choice.token_ids or []):
        raise RequestError(f"choice {choice.index} has token ids outside the vocabulary (size {vocab})")
    return choice


def _stream_response(chunk: dict[str, Any], stream_state: DerenderStreamState) -> Response:
    """``{chunk, stream_state}``, both encoded by msgspec: the chunk as the streams' events are (it may hold
    decoded logprob structs), the state (flat fields, mostly the output ids, which grow with the stream)
    from its fields as they are, byte for byte what its model_dump_json gives at a third of the cost
    (tests/unit/protocol/test_derender_state.py)."""
    body = b'{"chunk":' + msgspec.json.encode(chunk) + b',"stream_state":' + encode_stream_state(stream_state) + b"}"
    return Response(body, media_type="application/json")


def _resume(
    state: AppState, endpoint: str, request_id: str, index: int, prompt_ids: Sequence[int],
    request: ChatCompletionRequest | CompletionRequest | None,
) -> derender.Resume | None:
    """Where this chunk's stream may have left its state: keyed by everything that shapes its output
    (the endpoint, the request as sent, the server's parsers)."""
    if state.derender_cache is None:
        return None
    # As sent: a field left out keeps out of the digest its default, which may be made up per parse (request_id).
    sent = text_digest(request.model_dump_json(exclude_unset=True)) if request is not None else b""
    settings = (endpoint, state.parser_config, sent)
    return derender.Resume(state.derender_cache, StreamKey(request_id, index, ids_digest(prompt_ids), settings))


@router.post("/v1/chat/completions/derender")
async def chat_derender(request: Request) -> Response:
    state = app_state(request)
    state.require_tokenizer()
    req = await parse_body(request, chat_derender_adapter)
    if isinstance(req, DerenderChatStreamRequest):
        return _chat_derender_stream(req, state)
    gen, chat = req.generate_response, req.chat_request
    _require_context(state, chat)
    prompt_ids = req.prompt_token_ids or gen.prompt_token_ids or []
    _check_bounds(state, gen.choices, prompt_ids)
    _check_indexes(gen.choices, "generate_response.choices")
    choices = []
    for c in gen.choices:
        stop = batch_stop_config(state, c.finish_reason or "stop", c.stop_reason, chat)
        config = derender_chat_config(state, chat, prompt_ids, stop, False, c.logprobs is not None)
        choices.append(derender.replay_final(config, c, gen.request_id))
    completion = sum(len(c.token_ids or []) for c in gen.choices)
    surface = ChatSurface(gen.request_id, req.model or state.model_name,
                          return_token_ids=bool(chat and chat.return_token_ids))
    response = surface.answer(
        choices, usage_of(req.prompt_tokens or 0, completion), prompt_token_ids=gen.prompt_token_ids,
        kv_transfer_params=gen.kv_transfer_params, echoed_token_ids=[c.token_ids for c in gen.choices],
        metrics=gen.metrics,  # passed through, as vLLM does
    )
    return JSONResponse(response.model_dump(mode="json"))


def _chat_derender_stream(req: DerenderChatStreamRequest, state: AppState) -> Response:
    chat = req.chat_request
    if chat is not None and chat.stop:
        raise RequestError(
            "stop strings are not supported by streaming derender (text already sent cannot be cut); "
            "use batch derender or output_mode='text'", param="chat_request.stop",
        )
    _require_context(state, chat)
    parsed = state.parsers_configured
    if parsed and req.prompt_token_ids is None:
        raise RequestError("prompt_token_ids (the full prompt) is required when a parser is configured")
    previous = req.stream_state or DerenderStreamState()
    gchunk = req.generate_chunk
    choice = _stream_choice(state, gchunk.choices, _sent_n(chat))
    prompt_ids = req.prompt_token_ids or gchunk.prompt_token_ids or []
    _check_prompt(state, prompt_ids)
    surface = ChatSurface(gchunk.request_id, req.model or state.model_name,
                          return_token_ids=bool(chat and chat.return_token_ids))
    usage = None
    if gchunk.usage is not None:
        completion = gchunk.usage.completion_tokens or 0
        usage = usage_of(req.prompt_tokens or gchunk.usage.prompt_tokens or 0, completion)
    if choice is None:
        return _stream_response(usage_chunk(surface.usage_head(), usage, drop_nulls=False), previous)
    previous = derender.carried_state(
        state.tokenizer, previous, len(prompt_ids), len(choice.token_ids or []), parsed, max_model_len(state),  # type: ignore[arg-type]
        state.output_vocab_size,
    )
    config = derender_chat_config(state, chat, prompt_ids, stop_tokens_config(state, chat), True, False)
    resume = _resume(state, "chat", gchunk.request_id, choice.index, prompt_ids, chat)
    step = derender.advance(config, previous, parsed, choice, gchunk.request_id, derender_chat_top_limit(chat), resume)
    step.update.hides_metadata = step.choice.hides_metadata
    chunk = surface.build(step.update, usage, gchunk.metrics)
    return _stream_response(chunk, step.state)


@router.post("/v1/completions/derender")
async def completion_derender(request: Request) -> Response:
    state = app_state(request)
    state.require_tokenizer()
    req = await parse_body(request, completion_derender_adapter)
    if isinstance(req, DerenderCompletionStreamRequest):
        return _completion_derender_stream(req, state)
    n = len(req.generate_responses)
    for name in ("prompt_tokens", "prompt_token_ids"):
        value = getattr(req, name)
        if value is not None and len(value) != n:
            raise RequestError(f"{name} must have one entry per generate response ({n})")
    creq = req.completion_request
    groups = []
    for k, gen in enumerate(req.generate_responses):
        prompt_ids = (req.prompt_token_ids[k] if req.prompt_token_ids else None) or gen.prompt_token_ids or []
        _check_bounds(state, gen.choices, prompt_ids)
        _check_indexes(gen.choices, f"generate_responses[{k}].choices")
        group = []
        for c in gen.choices:
            stop = batch_stop_config(state, c.finish_reason or "stop", c.stop_reason, creq)
            config = derender_completion_config(state, creq, prompt_ids, stop, c.logprobs is not None)
            group.append(derender.replay_final(config, c, gen.request_id))
        groups.append(sorted(group, key=lambda cs: cs.index))
    completion = sum(len(c.token_ids) for group in groups for c in group)
    surface = CompletionsSurface(req.generate_responses[0].request_id, req.model or state.model_name,
                                 return_token_ids=bool(creq and creq.return_token_ids))
    response = surface.answer(
        groups, usage_of(sum(req.prompt_tokens or []), completion),
        req.generate_responses[0].metrics if n == 1 else None,  # vLLM: only for one response
    )
    return JSONResponse(response.model_dump(mode="json"))


def _completion_derender_stream(req: DerenderCompletionStreamRequest, state: AppState) -> Response:
    creq = req.completion_request
    if creq is not None and creq.stop:
        raise RequestError("stop strings are not supported by streaming derender; use batch derender or "
                           "output_mode='text'", param="completion_request.stop")
    previous = req.stream_state or DerenderStreamState()
    gchunk = req.generate_chunk
    choice = _stream_choice(state, gchunk.choices, _sent_n(creq))
    prompt_ids = req.prompt_token_ids or gchunk.prompt_token_ids or []
    _check_prompt(state, prompt_ids)
    surface = CompletionsSurface(gchunk.request_id, req.model or state.model_name,
                                 return_token_ids=bool(creq and creq.return_token_ids))
    if choice is None:
        return _stream_response(usage_chunk(surface.usage_head(), gchunk.usage, drop_nulls=False), previous)
    previous = derender.carried_state(
        state.tokenizer, previous, len(prompt_ids), len(choice.token_ids or []), False, max_model_len(state),  # type: ignore[arg-type]
        state.output_vocab_size,
    )
    config = derender_completion_config(state, creq, prompt_ids, stop_tokens_config(state, creq), False)
    top_limit = completion_top_limit(creq.logprobs if creq is not None else None)
    resume = _resume(state, "completion", gchunk.request_id, choice.index, prompt_ids, creq)
    step = derender.advance(config, previous, False, choice, gchunk.request_id, top_limit, resume)
    chunk = surface.choice_chunk(step.update, choice.index, previous.logprob_text_offset, None, gchunk.metrics)
    step.state.logprob_text_offset = derender.next_text_offset(previous.logprob_text_offset, step.update)
    return _stream_response(chunk, step.state)

