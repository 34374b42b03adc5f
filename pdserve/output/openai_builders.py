"""OpenAI chat/completions responses built from the same request state as generate."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.output.generate_builders import usage_of
from pdserve.output.request_state import ChoiceUpdate, RequestState
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
)
from pdserve.text.logprobs import completion_logprobs


def chat_response(
    rstate: RequestState, response_id: str, model: str, return_token_ids: bool
) -> ChatCompletionResponse:
    choices = []
    for c in rstate.choices:
        message, finish, hide = c.final_message()
        logprobs = None
        if rstate.config.want_logprobs and not hide:
            logprobs = ChatCompletionLogProbs(content=list(c.decoded_logprobs))
        choices.append(
            ChatCompletionResponseChoice(
                index=c.index,
                message=message,
                logprobs=logprobs,
                finish_reason=finish,
                stop_reason=c.stop_reason,
                token_ids=c.token_ids if return_token_ids and not hide else None,
            )
        )
    return ChatCompletionResponse(
        id=response_id,
        model=model,
        choices=choices,
        usage=usage_of(len(rstate.config.prompt_token_ids), rstate.completion_tokens),
        prompt_token_ids=list(rstate.config.prompt_token_ids) if return_token_ids else None,
        kv_transfer_params=rstate.kv_transfer_params,
    )


def chat_role_chunk(response_id: str, model: str, index: int) -> dict:
    """The opening chunk of a choice, as OpenAI sends it: role and empty content."""
    choice = ChatCompletionResponseStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))
    return ChatCompletionStreamResponse(id=response_id, model=model, choices=[choice]).model_dump(mode="json")


def chat_chunk(
    rstate: RequestState, update: ChoiceUpdate, response_id: str, model: str, return_token_ids: bool,
    usage: UsageInfo | None, force_logprobs: bool = False,
) -> dict:
    """One chat chunk; ``force_logprobs``: the caller decoded ``update.decoded_logprobs`` itself."""
    parser = rstate.choices[update.index].parser
    hide = parser is not None and parser.hide_metadata
    logprobs = None
    wanted = rstate.config.want_logprobs or force_logprobs
    if wanted and update.decoded_logprobs is not None and not hide:
        logprobs = ChatCompletionLogProbs(content=update.decoded_logprobs)
    choice = ChatCompletionResponseStreamChoice(
        index=update.index,
        delta=update.delta or DeltaMessage(),
        logprobs=logprobs,
        finish_reason=update.finish_reason,
        stop_reason=update.stop_reason,
        token_ids=update.token_ids if return_token_ids and not hide else None,
    )
    return ChatCompletionStreamResponse(id=response_id, model=model, choices=[choice], usage=usage).model_dump(
        mode="json"
    )


def completion_response(
    states: Sequence[RequestState], response_id: str, model: str, return_token_ids: bool
) -> CompletionResponse:
    """Choices of every prompt, renumbered 0..N-1, usage summed."""
    choices = []
    prompt_tokens = completion_tokens = 0
    for rstate in states:
        prompt_tokens += len(rstate.config.prompt_token_ids)
        completion_tokens += rstate.completion_tokens
        for c in rstate.choices:
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
                    prompt_token_ids=list(rstate.config.prompt_token_ids) if return_token_ids else None,
                )
            )
    return CompletionResponse(
        id=response_id, model=model, choices=choices, usage=usage_of(prompt_tokens, completion_tokens)
    )


def completion_chunk(
    rstate: RequestState, update: ChoiceUpdate, index: int, text_offset: int, response_id: str, model: str,
    return_token_ids: bool, usage: UsageInfo | None,
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
    return CompletionStreamResponse(id=response_id, model=model, choices=[choice], usage=usage).model_dump(mode="json")
