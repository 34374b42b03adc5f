"""OpenAI chat/completions responses and chunks, built from choice states.

Builders take :class:`~pdserve.output.request_state.ChoiceState` objects, so the coupled
endpoints (one request state) and stateless derender (choices replayed one by one) share them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdserve.output.policy import assistant_delta, decoded_logprobs_json, delta_json
from pdserve.output.request_state import ChoiceState, ChoiceUpdate
from pdserve.protocol.openai import (
    ChatCompletionLogProbs,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    DeltaMessage,
    UsageInfo,
    now,
)
from pdserve.text.logprobs import TokenLogprobs, completion_logprobs


def chat_response(
    choices: Sequence[ChoiceState], response_id: str, model: str, usage: UsageInfo, return_token_ids: bool, *,
    prompt_token_ids: Sequence[int] | None = None, kv_transfer_params: dict | None = None,
    echoed_token_ids: Sequence[Sequence[int] | None] | None = None, metrics: dict[str, Any] | None = None,
) -> ChatCompletionResponse:
    """The batch chat response. ``echoed_token_ids``: per choice, the ids to return instead of
    the choice's own (stateless derender returns the ids the client sent)."""
    out = []
    for k, c in enumerate(choices):
        message, finish = c.final_message()
        hide = c.hides_metadata
        # Per choice: a derendered response may carry logprobs on some choices only.
        logprobs = ChatCompletionLogProbs(content=list(c.decoded_logprobs)) if c.config.want_logprobs and not hide else None
        token_ids = c.token_ids if echoed_token_ids is None else echoed_token_ids[k]
        out.append(
            ChatCompletionResponseChoice(
                index=c.index,
                message=message,
                logprobs=logprobs,
                finish_reason=finish,
                stop_reason=c.stop_reason,
                token_ids=token_ids if return_token_ids and not hide else None,
            )
        )
    return ChatCompletionResponse(
        id=response_id,
        model=model,
        choices=out,
        usage=usage,
        prompt_token_ids=list(prompt_token_ids) if return_token_ids and prompt_token_ids is not None else None,
        kv_transfer_params=kv_transfer_params,
        metrics=metrics,
    )


def chat_role_chunk(response_id: str, model: str, index: int) -> dict:
    """The opening chunk of a choice, as OpenAI sends it: role and empty content."""
    choice = ChatCompletionResponseStreamChoice(index=index, delta=assistant_delta(DeltaMessage(content="")))
    return ChatCompletionStreamResponse(id=response_id, model=model, choices=[choice]).model_dump(mode="json")


def chat_chunk(
    choice_state: ChoiceState, update: ChoiceUpdate, response_id: str, model: str, return_token_ids: bool,
    usage: UsageInfo | None, logprobs: list[TokenLogprobs] | None = None,
    metrics: dict[str, Any] | None = None,
) -> dict:
    """One chat chunk. ``logprobs``: entries the caller decoded itself (stateless derender decodes
    a chunk's own ids); by default the update's, when the request asked for logprobs.

    Built as a plain dict, key for key what ``ChatCompletionStreamResponse`` dumps (property-tested),
    without two models built, validated and dumped per token."""
    hide = choice_state.hides_metadata
    content = None
    if not hide:
        if logprobs is not None:
            content = {"content": logprobs}
        elif choice_state.config.want_logprobs:
            content = decoded_logprobs_json(update)
    choice = {
        "index": update.index, "delta": delta_json(update.delta), "logprobs": content,
        "finish_reason": update.finish_reason, "stop_reason": update.stop_reason,
        "token_ids": update.token_ids if return_token_ids and not hide else None,
    }
    return {
        "id": response_id, "object": "chat.completion.chunk", "created": now(), "model": model, "choices": [choice],
        "usage": None if usage is None else usage.model_dump(mode="json"), "prompt_token_ids": None,
        "metrics": metrics,
    }


def completion_response(
    groups: Sequence[Sequence[ChoiceState]], response_id: str, model: str, usage: UsageInfo, return_token_ids: bool,
    metrics: dict[str, Any] | None = None,
) -> CompletionResponse:
    """Choices of every prompt (one group per prompt), renumbered 0..N-1."""
    choices = []
    for group in groups:
        for c in group:
            # Per choice: a derendered response may carry logprobs on some choices only.
            logprobs = completion_logprobs(c.decoded_logprobs) if c.config.want_logprobs else None
            choices.append(
                CompletionResponseChoice(
                    index=len(choices),
                    text=c.text,
                    logprobs=logprobs,
                    finish_reason=c.finish_reason or "stop",
                    stop_reason=c.stop_reason,
                    token_ids=c.token_ids if return_token_ids else None,
                    prompt_token_ids=list(c.config.prompt_token_ids) if return_token_ids else None,
                )
            )
    return CompletionResponse(id=response_id, model=model, choices=choices, usage=usage, metrics=metrics)


def completion_chunk(
    update: ChoiceUpdate, index: int, text_offset: int, response_id: str, model: str, return_token_ids: bool,
    usage: UsageInfo | None, metrics: dict[str, Any] | None = None,
) -> dict:
    logprobs = None
    if update.decoded_logprobs is not None:
        logprobs = completion_logprobs(update.decoded_logprobs, text_offset)
    choice = CompletionResponseChoice(
        index=index,
        text=update.text,
        logprobs=logprobs,
        finish_reason=update.finish_reason,
        stop_reason=update.stop_reason,
        token_ids=update.token_ids if return_token_ids else None,
    )
    return CompletionStreamResponse(
        id=response_id, model=model, choices=[choice], usage=usage, metrics=metrics
    ).model_dump(mode="json")
