"""Rules every response surface shares (generate, the coupled OpenAI endpoints, stateless derender),
each written once: usage counts, the usage-only stream chunk, and the delta that names the role.

Metadata hiding is :attr:`~pdserve.output.request_state.ChoiceState.hides_metadata`; the logprob
candidate cuts are :func:`~pdserve.text.logprobs.chat_top_limit` and
:func:`~pdserve.text.logprobs.completion_top_limit`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from pdserve.protocol.openai import DeltaMessage, StreamDelta, TextDelta, UsageInfo

if TYPE_CHECKING:
    from pdserve.output.request_state import ChoiceUpdate


def usage_of(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens
    )


def usage_chunk(head: dict[str, Any], usage: UsageInfo | None, *, drop_nulls: bool = True) -> dict[str, Any]:
    """The chunk that carries only usage (no choices) after a stream's last choice chunk.

    ``head`` holds the surface's identifying fields (generate: request_id and output_mode; OpenAI:
    id, object, model). ``drop_nulls``: leave unset usage details out, as the streaming endpoints
    do; stateless derender echoes every field of the usage it was given.
    """
    body = usage.model_dump(exclude_none=drop_nulls) if usage is not None else None
    return {**head, "choices": [], "usage": body}


def delta_json(delta: StreamDelta | None) -> dict[str, Any]:
    """``delta.model_dump(mode="json")`` (an empty delta's for None), as a plain dict when it has no tool
    calls: derender and chat streams dump one per token, and pydantic's wrap serializer costs more than
    the rest of the chunk (tests/unit/output/test_stream_chunk.py checks they encode alike)."""
    if delta is None:
        return {"role": None, "content": None, "reasoning": None}
    if delta.tool_calls:
        return delta.model_dump(mode="json")
    return {"role": delta.role, "content": delta.content, "reasoning": delta.reasoning}


def decoded_logprobs_json(update: ChoiceUpdate) -> dict[str, Any] | None:
    """A chunk's chat-shape ``logprobs`` object (generate text/derender, chat): the update's entries,
    as JSON already written (``msgspec.Raw``) or as structs msgspec encodes; None when it has none."""
    if update.logprobs_json is not None:
        return {"content": msgspec.Raw(update.logprobs_json)}
    if update.decoded_logprobs is not None:
        return {"content": update.decoded_logprobs}
    return None


def assistant_delta(delta: StreamDelta | None) -> StreamDelta:
    """A choice's opening delta: ``delta`` (or an empty one) with ``role: "assistant"``, which
    OpenAI-shaped streams send once per choice, on its first delta."""
    if isinstance(delta, DeltaMessage):
        opening = delta.model_copy()
        opening.role = "assistant"
        return opening
    if delta is None:
        return TextDelta(role="assistant")
    return TextDelta(role="assistant", content=delta.content, reasoning=delta.reasoning)
