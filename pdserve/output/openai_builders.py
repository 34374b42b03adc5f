"""The OpenAI builders stateless ``/derender`` (serve/routes/derender.py) calls, as the surfaces build them
(:mod:`pdserve.output.surfaces.openai`): the shapes are written once, there."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdserve.output.request_state import ChoiceState, ChoiceUpdate
from pdserve.output.surfaces.openai import ChatSurface, CompletionsSurface
from pdserve.protocol.openai import ChatCompletionResponse, CompletionResponse, UsageInfo
from pdserve.text.logprobs import TokenLogprobs


def chat_response(
    choices: Sequence[ChoiceState], response_id: str, model: str, usage: UsageInfo, return_token_ids: bool, *,
    prompt_token_ids: Sequence[int] | None = None, kv_transfer_params: dict[str, Any] | None = None,
    echoed_token_ids: Sequence[Sequence[int] | None] | None = None, metrics: dict[str, Any] | None = None,
) -> ChatCompletionResponse:
    """The batch chat response (:meth:`ChatSurface.answer`)."""
    surface = ChatSurface(response_id, model, return_token_ids=return_token_ids)
    return surface.answer(choices, usage, prompt_token_ids=prompt_token_ids, kv_transfer_params=kv_transfer_params,
                          metrics=metrics, echoed_token_ids=echoed_token_ids)


def chat_chunk(
    choice_state: ChoiceState, update: ChoiceUpdate, response_id: str, model: str, return_token_ids: bool,
    usage: UsageInfo | None, logprobs: list[TokenLogprobs] | None = None,
    metrics: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One chat chunk (:meth:`ChatSurface.build`). ``logprobs``: entries the caller decoded itself
    (stateless derender decodes a chunk's own ids); by default the update's."""
    if logprobs is not None:
        update.decoded_logprobs = logprobs
    update.hides_metadata = choice_state.hides_metadata
    return ChatSurface(response_id, model, return_token_ids=return_token_ids).build(update, usage, metrics)


def completion_response(
    groups: Sequence[Sequence[ChoiceState]], response_id: str, model: str, usage: UsageInfo, return_token_ids: bool,
    metrics: dict[str, Any] | None = None,
) -> CompletionResponse:
    """Choices of every prompt (one group per prompt), renumbered 0..N-1 (:meth:`CompletionsSurface.answer`)."""
    return CompletionsSurface(response_id, model, return_token_ids=return_token_ids).answer(groups, usage, metrics)


def completion_chunk(
    update: ChoiceUpdate, index: int, text_offset: int, response_id: str, model: str, return_token_ids: bool,
    usage: UsageInfo | None, metrics: dict[str, Any] | None = None,
) -> dict[str, Any]:
    surface = CompletionsSurface(response_id, model, return_token_ids=return_token_ids)
    return surface.choice_chunk(update, index, text_offset, usage, metrics)

