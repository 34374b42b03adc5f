"""Generate and derender output as OpenAI responses and chunks, the way the coupled endpoints send them.

The decode leg's ``derender`` choices (and a ``/derender`` answer's) already hold OpenAI messages and
deltas, and its ``text`` choices the completion text; what changes is the envelope: the response id
(``chatcmpl-…``/``cmpl-…``, as the coupled endpoint names it, not the generate id), the model, ids
and logprobs shown only when asked for, the role sent once in its own opening chunk, and steps that
carry nothing for the client left out (the same rule as ``/v1/chat/completions``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pdserve.output.openai_builders import chat_role_chunk
from pdserve.output.policy import usage_chunk
from pdserve.protocol.openai import (
    ChatCompletionLogProbsContent,
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
from pdserve.text.logprobs import completion_logprobs, completion_top_limit


def chat_response(
    choices: Iterable[dict[str, Any]], usage: dict[str, Any] | None, response_id: str, model: str,
    return_token_ids: bool, prompt_token_ids: list[int] | None, kv_transfer_params: dict[str, Any] | None,
) -> dict[str, Any]:
    """The batch chat response from choices holding ``message`` (generate ``derender`` or ``/derender``)."""
    out = [
        ChatCompletionResponseChoice(
            index=c["index"],
            message=c["message"],
            logprobs=c.get("logprobs"),
            finish_reason=c.get("finish_reason"),
            stop_reason=c.get("stop_reason"),
            token_ids=c.get("token_ids") if return_token_ids else None,
        )
        for c in choices
    ]
    return ChatCompletionResponse(
        id=response_id, model=model, choices=out, usage=UsageInfo.model_validate(usage or {}),
        prompt_token_ids=prompt_token_ids if return_token_ids else None, kv_transfer_params=kv_transfer_params,
    ).model_dump(mode="json")


def chat_opening_chunks(response_id: str, model: str, n: int) -> list[dict[str, Any]]:
    """One role chunk per choice, before any content (as the coupled endpoint opens its stream)."""
    return [chat_role_chunk(response_id, model, i) for i in range(n)]


def chat_chunk(
    choices: Iterable[dict[str, Any]], usage: dict[str, Any] | None, response_id: str, model: str,
    return_token_ids: bool,
) -> dict[str, Any] | None:
    """An OpenAI chat chunk from stream choices holding ``delta``; None when no choice carries anything
    for the client (no delta, no finish, no logprobs, no ids it asked for)."""
    out = []
    for c in choices:
        delta = DeltaMessage.model_validate(c.get("delta") or {})
        delta.role = None  # sent once, in the opening chunk
        logprobs = c.get("logprobs")
        ids = c.get("token_ids")
        if (delta.is_empty() and c.get("finish_reason") is None and not (logprobs or {}).get("content")
                and not (return_token_ids and ids)):
            continue
        out.append(ChatCompletionResponseStreamChoice(
            index=c["index"], delta=delta, logprobs=logprobs, finish_reason=c.get("finish_reason"),
            stop_reason=c.get("stop_reason"), token_ids=ids if return_token_ids else None,
        ))
    if not out:
        return None
    return ChatCompletionStreamResponse(
        id=response_id, model=model, choices=out, usage=UsageInfo.model_validate(usage) if usage else None
    ).model_dump(mode="json")


def final_usage_chunk(obj: str, response_id: str, model: str, usage: dict[str, Any]) -> dict[str, Any]:
    """The usage-only chunk that ends a stream with ``stream_options.include_usage``."""
    return usage_chunk({"id": response_id, "object": obj, "model": model}, UsageInfo.model_validate(usage))


def _completion_logprobs(logprobs: dict[str, Any] | None, want: int | None, text_offset: int) -> Any:
    """Generate ``text`` logprobs (chat shape, every engine candidate) in completions' shape and cut."""
    if logprobs is None or logprobs.get("content") is None:
        return None
    limit = completion_top_limit(want)
    content = [ChatCompletionLogProbsContent.model_validate(e) for e in logprobs["content"]]
    if limit is not None:
        for entry in content:
            entry.top_logprobs = entry.top_logprobs[:limit]
    return completion_logprobs(content, text_offset)


def completion_response(
    response: dict[str, Any], response_id: str, model: str, return_token_ids: bool, logprobs: int | None,
    prompt_token_ids: list[int],
) -> dict[str, Any]:
    """The batch completions response from a generate ``text`` response."""
    choices = [
        CompletionResponseChoice(
            index=c["index"],
            text=c["text"],
            logprobs=_completion_logprobs(c.get("logprobs"), logprobs, 0),
            finish_reason=c.get("finish_reason") or "stop",
            stop_reason=c.get("stop_reason"),
            token_ids=c.get("token_ids") if return_token_ids else None,
            prompt_token_ids=prompt_token_ids if return_token_ids else None,
        )
        for c in response["choices"]
    ]
    return CompletionResponse(
        id=response_id, model=model, choices=choices, usage=UsageInfo.model_validate(response.get("usage") or {}),
    ).model_dump(mode="json")


class CompletionChunks:
    """Completions chunks from generate ``text`` chunks; keeps each choice's text offset for logprobs."""

    def __init__(self, response_id: str, model: str, return_token_ids: bool, logprobs: int | None):
        self._id, self._model = response_id, model
        self._return_ids = return_token_ids
        self._logprobs = logprobs
        self._offsets: dict[int, int] = {}

    def chunk(self, choice: dict[str, Any]) -> dict[str, Any] | None:
        text = choice.get("text") or ""
        ids = choice.get("token_ids")
        if not text and choice.get("finish_reason") is None and not ids:
            return None
        index = choice["index"]
        offset = self._offsets.get(index, 0)
        self._offsets[index] = offset + len(text)
        out = CompletionResponseChoice(
            index=index, text=text, logprobs=_completion_logprobs(choice.get("logprobs"), self._logprobs, offset),
            finish_reason=choice.get("finish_reason"), stop_reason=choice.get("stop_reason"),
            token_ids=ids if self._return_ids else None,
        )
        return CompletionStreamResponse(id=self._id, model=self._model, choices=[out]).model_dump(mode="json")


def renamed(answer: dict[str, Any], response_id: str, model: str) -> dict[str, Any]:
    """A ``/derender`` answer (named after the generate request and the render server's tokenizer)
    under the client's response id and the decode pool's model."""
    return {**answer, "id": response_id, "model": model}
