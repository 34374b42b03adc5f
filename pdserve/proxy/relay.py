"""A decode leg's generate and derender output as the client's OpenAI responses and chunks, built by the
same response surfaces the server's coupled endpoints use (:mod:`pdserve.output.surfaces`).

The decode leg's ``derender`` choices (and a ``/derender`` answer's) already hold OpenAI messages and
deltas, and its ``text`` choices the completion text; the surface adds the envelope: the response id
(``chatcmpl-…``/``cmpl-…``, as the coupled endpoint names it, not the generate id), the model, ids and
logprobs shown only when asked for, the role sent once in its own opening chunk, and steps that carry
nothing for the client left out (the surface's one emptiness rule, as on ``/v1/chat/completions``).
"""

from __future__ import annotations

from typing import Any

from pdserve.output.surfaces import ChatSurface, CompletionsSurface
from pdserve.protocol.openai import UsageInfo

Surface = ChatSurface | CompletionsSurface


def chat_surface(response_id: str, model: str, n: int, return_token_ids: bool) -> ChatSurface:
    return ChatSurface(response_id, model, n=n, return_token_ids=return_token_ids)


def completions_surface(response_id: str, model: str, return_token_ids: bool, logprobs: int | None
                        ) -> CompletionsSurface:
    return CompletionsSurface(response_id, model, return_token_ids=return_token_ids, logprobs=logprobs)


def usage_of(usage: dict[str, Any] | None) -> UsageInfo | None:
    return UsageInfo.model_validate(usage) if usage else None


def chunk(surface: Surface, relayed: dict[str, Any]) -> dict[str, Any] | None:
    """The client's chunk from a relayed stream chunk (one with choices), None when it carries nothing."""
    if isinstance(surface, ChatSurface):
        return surface.relayed_chunk(relayed["choices"], usage_of(relayed.get("usage")))
    return surface.chunk(surface.relayed(relayed["choices"][0]))


def usage_chunk(surface: Surface, usage: dict[str, Any]) -> dict[str, Any]:
    """The usage-only chunk that ends a stream with ``stream_options.include_usage``."""
    return surface.usage_chunk(UsageInfo.model_validate(usage))


def chat_response(surface: ChatSurface, response: dict[str, Any], prompt_token_ids: list[int]) -> dict[str, Any]:
    """The batch chat response from a generate ``derender`` response."""
    answer = surface.answer(
        [surface.relayed(c) for c in response["choices"]], UsageInfo.model_validate(response.get("usage") or {}),
        prompt_token_ids=prompt_token_ids, kv_transfer_params=response.get("kv_transfer_params"),
    )
    return answer.model_dump(mode="json")


def completion_response(surface: CompletionsSurface, response: dict[str, Any], prompt_token_ids: list[int]
                        ) -> dict[str, Any]:
    """The batch completions response from a generate ``text`` response."""
    choices = [surface.relayed(c, prompt_token_ids) for c in response["choices"]]
    answer = surface.answer([choices], UsageInfo.model_validate(response.get("usage") or {}))
    return answer.model_dump(mode="json")


def derendered_completion(surface: CompletionsSurface, generate_chunk: dict[str, Any],
                          answer_chunk: dict[str, Any]) -> dict[str, Any] | None:
    """A ``/derender`` completions chunk under the client's id, or None when the step carries nothing:
    the surface's rule, asked of the text and finish ``/derender`` sent and the decode chunk's ids."""
    sent = answer_chunk["choices"][0] if answer_chunk["choices"] else {}
    step = {"index": sent.get("index", 0), "text": sent.get("text"), "finish_reason": sent.get("finish_reason"),
            "token_ids": generate_chunk["choices"][0].get("token_ids")}
    if not surface.carries(surface.relayed(step)):
        return None
    return renamed(answer_chunk, surface.response_id, surface.model)


def renamed(answer: dict[str, Any], response_id: str, model: str) -> dict[str, Any]:
    """A ``/derender`` answer (named after the generate request and the render server's tokenizer)
    under the client's response id and the decode pool's model, without the ``metrics`` ``/derender``
    passes through from the decode member (the proxy's own go there: :mod:`pdserve.proxy.record`)."""
    return {**answer, "id": response_id, "model": model, "metrics": None}
