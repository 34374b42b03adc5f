"""Generate responses and stream chunks for each output mode, built from request state."""

from __future__ import annotations

import time
from typing import Any

import msgspec

from pdserve.output.policy import assistant_delta, decoded_logprobs_json, delta_json, usage_of
from pdserve.output.request_state import ChoiceState, ChoiceUpdate, RequestState
from pdserve.protocol.generate import (
    GenerateDerenderChoice,
    GenerateDerenderResponse,
    GenerateLogProbs,
    GenerateResponseBase,
    GenerateTextChoice,
    GenerateTextResponse,
    GenerateTokensChoice,
    GenerateTokensResponse,
)
from pdserve.protocol.openai import ChatCompletionLogProbs, UsageInfo
from pdserve.text.logprob_json import generate_content_json
from pdserve.text.logprobs import to_generate_logprobs


def _tokens_logprobs(choice: ChoiceState, want: bool) -> GenerateLogProbs | None:
    return GenerateLogProbs(content=to_generate_logprobs(choice.logprobs, choice.token_ids)) if want else None


def _chat_logprobs(choice: ChoiceState, want: bool) -> ChatCompletionLogProbs | None:
    return ChatCompletionLogProbs(content=list(choice.decoded_logprobs)) if want else None


def batch_response(state: RequestState, base: dict[str, Any]) -> GenerateResponseBase:
    """The non-streaming response; ``base`` holds the shared top-level fields."""
    cfg = state.config
    want = cfg.want_logprobs
    common = dict(base, usage=usage_of(len(cfg.prompt_token_ids), state.completion_tokens), created=int(time.time()))
    if cfg.mode == "tokens":
        choices = [
            GenerateTokensChoice(
                index=c.index,
                finish_reason=c.finish_reason or "stop",
                stop_reason=c.stop_reason,
                token_ids=c.token_ids,
                logprobs=_tokens_logprobs(c, want),
            )
            for c in state.choices
        ]
        return GenerateTokensResponse(choices=choices, **common)
    if cfg.mode == "text":
        text_choices = [
            GenerateTextChoice(
                index=c.index,
                finish_reason=c.finish_reason or "stop",
                stop_reason=c.stop_reason,
                token_ids=c.token_ids,
                text=c.text,
                logprobs=_chat_logprobs(c, want),
            )
            for c in state.choices
        ]
        return GenerateTextResponse(choices=text_choices, **common)
    derender_choices = []
    for c in state.choices:
        message, finish = c.final_message()
        hide = c.hides_metadata
        derender_choices.append(
            GenerateDerenderChoice(
                index=c.index,
                finish_reason=finish,
                stop_reason=c.stop_reason,
                token_ids=None if hide else c.token_ids,
                message=message,
                logprobs=None if hide else _chat_logprobs(c, want),
            )
        )
    return GenerateDerenderResponse(choices=derender_choices, **common)


def stream_chunk(state: RequestState, update: ChoiceUpdate, usage: UsageInfo | None, first_for_choice: bool,
                 metrics: dict[str, Any] | None = None) -> dict:
    """One SSE event (one choice) as a JSON-ready dict; ``metrics`` rides on the request's last chunk.

    Built directly, key for key what the wire models (``Generate*StreamResponse``) dump (property-tested
    against them in tests/unit/output/test_stream_chunk.py), without a model built, validated and dumped per token; logprob content comes as JSON already written
    (:mod:`pdserve.text.logprob_json`) or as the decoder's structs, which msgspec encodes as they are."""
    cfg = state.config
    if cfg.mode == "tokens":
        logprobs = None
        if cfg.want_logprobs and update.logprobs is not None:
            logprobs = {"content": msgspec.Raw(generate_content_json(update.logprobs, update.token_ids))}
        return _plain_stream_chunk(state, update, usage, metrics, {}, logprobs=logprobs)
    if cfg.mode == "text":
        return _plain_stream_chunk(state, update, usage, metrics, {"text": update.text},
                                   logprobs=decoded_logprobs_json(update) if cfg.want_logprobs else None)
    hide = state.choices[update.index].hides_metadata
    delta = delta_json(assistant_delta(update.delta) if first_for_choice else update.delta)
    logprobs = decoded_logprobs_json(update) if cfg.want_logprobs and not hide else None
    return _plain_stream_chunk(state, update, usage, metrics, {"delta": delta}, hide_ids=hide, logprobs=logprobs)


def _plain_stream_chunk(state: RequestState, update: ChoiceUpdate, usage: UsageInfo | None,
                        metrics: dict[str, Any] | None, payload: dict[str, Any], hide_ids: bool = False,
                        logprobs: dict[str, Any] | None = None) -> dict:
    choice: dict[str, Any] = {
        "index": update.index, "finish_reason": update.finish_reason, "stop_reason": update.stop_reason,
        "token_ids": None if hide_ids else update.token_ids, "routed_experts": None, "sampling_mask": None,
        "weight_versions": None, **payload, "logprobs": logprobs,
    }
    chunk: dict[str, Any] = {
        "request_id": state.request_id, "usage": None if usage is None else usage.model_dump(mode="json"),
    }
    if metrics is not None:
        chunk["metrics"] = metrics
    chunk["output_mode"] = state.config.mode
    chunk["choices"] = [choice]
    return chunk
