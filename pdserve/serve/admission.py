"""Admission: one pass from a parsed generate request to what runs it.

:func:`admit` validates the request against this server (:func:`~pdserve.serve.validation.validate_generate`,
every rule in DESIGN.md's order) and builds, from what validation parsed, the engine request and the
request-scoped output state (:mod:`pdserve.serve.requests`). The KV intent, the parser context and the
``bad_words`` id sequences are each computed once, on the way through validation, and the result is
frozen: a route reads an :class:`AdmittedRequest`, never goes back to validation or the builders.

:func:`resolve_max_tokens` is the one max-tokens rule, used here and by render.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.request_ids import engine_request_id
from pdserve.output.request_state import OutputConfig, RequestState
from pdserve.protocol.engine import EngineRequest
from pdserve.protocol.generate import GenerateRequest
from pdserve.protocol.kv import KVIntent
from pdserve.protocol.openai import ChatCompletionRequest
from pdserve.serve.requests import engine_request, output_config, stream_interval
from pdserve.serve.state import AppState
from pdserve.serve.validation import validate_generate


@dataclass(frozen=True, slots=True)
class AdmittedRequest:
    """A request this server accepted, with everything computed for it (each once).

    ``engine_request`` goes to the engine; ``request_state`` (its ``config`` the output config) turns the
    engine's outputs into the response; ``chat_context`` is the parser context (derender; else None), as
    validation parsed it."""

    request: GenerateRequest
    engine_request: EngineRequest
    request_state: RequestState
    chat_context: ChatCompletionRequest | None

    @property
    def kv(self) -> KVIntent:
        """The parsed intent of ``kv_transfer_params`` (validation parsed it; the engine request carries it)."""
        return self.engine_request.kv

    @property
    def output_config(self) -> OutputConfig:
        return self.request_state.config

    @property
    def pair(self) -> tuple[EngineRequest, RequestState]:
        """(engine request, request state): what the stream and batch runners take."""
        return self.engine_request, self.request_state


def admit(
    state: AppState, req: GenerateRequest, request_id: str, *, completions_cut: bool = False
) -> AdmittedRequest:
    """Validate ``req`` against this server (a :class:`~pdserve.protocol.errors.RequestError` names what
    to fix) and build what runs it.

    The engine request gets an id of its own (``request_id`` plus a unique suffix, see
    :mod:`pdserve.engine.request_ids`): a client that reuses an id never collides with, or aborts,
    another request; responses carry ``request_id`` as the client sent it. ``completions_cut``: the
    logprob candidates /v1/completions keeps (k+1)."""
    checked = validate_generate(state, req)
    info = state.require_engine().info
    max_tokens = resolve_max_tokens(
        req.sampling_params.max_tokens, len(req.token_ids), info.max_model_len, model_max_tokens(state)
    )
    assert max_tokens is not None  # the engine's model length bounds it
    ereq = engine_request(
        req, engine_request_id(request_id), max_tokens, stream_interval(state, req),
        kv=checked.kv, bad_words_token_ids=checked.bad_words_token_ids,
    )
    rstate = RequestState(
        request_id, req.sampling_params.n, output_config(state, req, checked.chat_context, completions_cut)
    )
    rstate.resume(req.prior_output_chunk_ids)
    return AdmittedRequest(req, ereq, rstate, checked.chat_context)


def resolve_max_tokens(
    requested: int | None, prompt_len: int, limit: int | None, model_default: int | None
) -> int | None:
    """The tokens a request may generate: the client's ``requested`` as it is; else all the room the
    model length ``limit`` leaves after the prompt, capped by the model's generation_config.json
    ``max_new_tokens`` (``model_default``, at least 1), as vLLM does. Without a limit (a render server
    that knows no model length) the model's default, or None. Callers refuse a prompt or a
    ``requested`` that does not fit, each with its own message."""
    if requested is not None:
        return requested
    if limit is None:
        return model_default
    room = limit - prompt_len
    return room if model_default is None else max(1, min(room, model_default))


def model_max_tokens(state: AppState) -> int | None:
    """The model's generation_config.json ``max_new_tokens`` (None without one, or without a tokenizer)."""
    return state.tokenizer.generation_defaults.get("max_tokens") if state.tokenizer is not None else None
