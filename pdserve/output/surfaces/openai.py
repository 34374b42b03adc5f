"""The OpenAI surfaces: ``/v1/chat/completions`` and ``/v1/completions``, for the coupled endpoints (from
choice states) and the proxy (from a decode leg's relayed chunks, :class:`~.source.Relayed`) alike.

Relayed ``derender`` choices (or a ``/derender`` answer's) already hold OpenAI messages and deltas, and
``text`` choices the completion text; what the surface adds is the envelope: the response id
(``chatcmpl-…``/``cmpl-…``), the model, ids and logprobs shown only when asked for, the role sent once in
its own opening chunk, and steps that carry nothing for the client left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pdserve.output.policy import assistant_delta, decoded_logprobs_json, delta_json
from pdserve.output.surfaces.base import Surface
from pdserve.output.surfaces.source import Finished, Relayed, Step, relayed_content, relayed_delta
from pdserve.protocol.openai import (
    ChatCompletionLogProbs,
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
    now,
)
from pdserve.text.logprobs import completion_logprobs, completion_top_limit

if TYPE_CHECKING:
    from pdserve.output.request_state import RequestState

CHAT_CHUNK = "chat.completion.chunk"
COMPLETION_CHUNK = "text_completion"


class ChatSurface(Surface):
    """``/v1/chat/completions``: ``n`` choices, each opened by a role chunk, then deltas."""

    endpoint = "chat"
    output_mode = "derender"

    def __init__(self, response_id: str, model: str, *, n: int = 1, return_token_ids: bool = False,
                 include_usage: bool = False, continuous_usage: bool = False) -> None:
        self.response_id = response_id
        self.model = model
        self.n = n
        self.return_token_ids = return_token_ids
        self.include_usage = include_usage
        self.continuous_usage = include_usage and continuous_usage

    def opening(self) -> list[dict[str, Any]]:
        return [self.role_chunk(i) for i in range(self.n)]

    def role_chunk(self, index: int) -> dict[str, Any]:
        """The opening chunk of a choice, as OpenAI sends it: role and empty content."""
        choice = ChatCompletionResponseStreamChoice(index=index, delta=assistant_delta(DeltaMessage(content="")))
        return ChatCompletionStreamResponse(id=self.response_id, model=self.model, choices=[choice]).model_dump(
            mode="json")

    def shows(self, step: Step) -> bool:
        # A step whose text the parser holds back still carries its logprobs/ids: send it.
        delta = step.delta
        return (not (delta is None or delta.is_empty()) or step.has_logprob_entries
                or (self.return_token_ids and bool(step.token_ids)))

    def stream_choice(self, step: Step) -> dict[str, Any]:
        hide = step.hides_metadata
        return {
            "index": step.index, "delta": delta_json(step.delta),
            "logprobs": None if hide else decoded_logprobs_json(step),  # type: ignore[arg-type]
            "finish_reason": step.finish_reason, "stop_reason": step.stop_reason,
            "token_ids": step.token_ids if self.return_token_ids and not hide else None,
        }

    def build(self, step: Step, usage: UsageInfo | None = None, metrics: dict[str, Any] | None = None,
              prompt: int = 0) -> dict[str, Any]:
        """One chat chunk, as a plain dict: key for key what ``ChatCompletionStreamResponse`` dumps
        (property-tested), without two models built, validated and dumped per token."""
        return self.envelope([self.stream_choice(step)], usage, metrics)

    def envelope(self, choices: list[dict[str, Any]], usage: UsageInfo | None,
                 metrics: dict[str, Any] | None) -> dict[str, Any]:
        return {
            "id": self.response_id, "object": CHAT_CHUNK, "created": now(), "model": self.model, "choices": choices,
            "usage": None if usage is None else usage.model_dump(mode="json"), "prompt_token_ids": None,
            "metrics": metrics,
        }

    def relayed(self, choice: dict[str, Any]) -> Relayed:
        """A relayed stream choice (``delta``) or batch choice (``message``)."""
        delta = relayed_delta(choice.get("delta")) if "message" not in choice else None
        return Relayed(choice, relayed_content(choice), delta=delta)

    def relayed_chunk(self, choices: Sequence[dict[str, Any]], usage: UsageInfo | None) -> dict[str, Any] | None:
        """The client's chunk from a relayed chunk's choices: those that carry something, None if none does."""
        steps = [self.relayed(c) for c in choices]
        shown = [self.stream_choice(s) for s in steps if self.carries(s)]
        return self.envelope(shown, usage, None) if shown else None

    def usage_head(self) -> dict[str, Any]:
        return {"id": self.response_id, "object": CHAT_CHUNK, "model": self.model}

    def batch(self, states: Sequence[RequestState], usage: UsageInfo,
              metrics: dict[str, Any] | None = None) -> ChatCompletionResponse:
        (state,) = states
        return self.answer(state.choices, usage, prompt_token_ids=state.config.prompt_token_ids,
                           kv_transfer_params=state.kv_transfer_params, metrics=metrics)

    def answer(self, choices: Sequence[Finished], usage: UsageInfo, *, prompt_token_ids: Sequence[int] | None = None,
               kv_transfer_params: dict[str, Any] | None = None, metrics: dict[str, Any] | None = None,
               echoed_token_ids: Sequence[Sequence[int] | None] | None = None) -> ChatCompletionResponse:
        """The batch answer. ``echoed_token_ids``: per choice, the ids to return instead of the choice's own
        (stateless derender returns the ids the client sent)."""
        out = []
        for k, c in enumerate(choices):
            message, finish = c.final_message()
            hide = c.hides_metadata  # the parser ran in final_message
            entries = c.logprob_entries
            # Per choice: a derendered response may carry logprobs on some choices only.
            logprobs = ChatCompletionLogProbs(content=list(entries)) if entries is not None and not hide else None
            token_ids = c.token_ids if echoed_token_ids is None else echoed_token_ids[k]
            out.append(ChatCompletionResponseChoice(
                index=c.index, message=message, logprobs=logprobs, finish_reason=finish,
                stop_reason=c.stop_reason, token_ids=token_ids if self.return_token_ids and not hide else None,
            ))
        return ChatCompletionResponse(
            id=self.response_id, model=self.model, choices=out, usage=usage,
            prompt_token_ids=list(prompt_token_ids) if self.return_token_ids and prompt_token_ids is not None else None,
            kv_transfer_params=kv_transfer_params, metrics=metrics,
        )


class CompletionsSurface(Surface):
    """``/v1/completions``: text per choice; choice indexes run across prompts (prompt k's choice i is
    k * n + i); keeps each choice's running text offset for its logprobs."""

    endpoint = "completions"
    output_mode = "text"

    def __init__(self, response_id: str, model: str, *, n: int = 1, return_token_ids: bool = False,
                 include_usage: bool = False, logprobs: int | None = None) -> None:
        self.response_id = response_id
        self.model = model
        self.n = n
        self.return_token_ids = return_token_ids
        self.include_usage = include_usage
        # Relayed chat-shape logprobs (every engine candidate) are cut here to completions' k + 1.
        self.top_limit = completion_top_limit(logprobs)
        self._offsets: dict[int, int] = {}

    def shows(self, step: Step) -> bool:
        return bool(step.text) or bool(step.token_ids)

    def build(self, step: Step, usage: UsageInfo | None = None, metrics: dict[str, Any] | None = None,
              prompt: int = 0) -> dict[str, Any]:
        index = prompt * self.n + step.index
        offset = self._offsets.get(index, 0)
        self._offsets[index] = offset + len(step.text)
        return self.choice_chunk(step, index, offset, usage, metrics)

    def choice_chunk(self, step: Step, index: int, text_offset: int, usage: UsageInfo | None = None,
                     metrics: dict[str, Any] | None = None) -> dict[str, Any]:
        """The chunk of choice ``index`` whose logprobs start at ``text_offset`` (stateless derender
        carries the offset in its stream state)."""
        entries = step.decoded_logprobs
        choice = CompletionResponseChoice(
            index=index, text=step.text,
            logprobs=None if entries is None else completion_logprobs(entries, text_offset),
            finish_reason=step.finish_reason, stop_reason=step.stop_reason,
            token_ids=step.token_ids if self.return_token_ids else None,
        )
        return CompletionStreamResponse(
            id=self.response_id, model=self.model, choices=[choice], usage=usage, metrics=metrics
        ).model_dump(mode="json")

    def relayed(self, choice: dict[str, Any], prompt_token_ids: Sequence[int] = ()) -> Relayed:
        """A relayed ``text`` choice, its chat-shape logprob entries cut to completions' k + 1."""
        content = relayed_content(choice)
        entries = None
        if content is not None:
            entries = [ChatCompletionLogProbsContent.model_validate(e) for e in content]
            if self.top_limit is not None:
                for entry in entries:
                    entry.top_logprobs = entry.top_logprobs[: self.top_limit]
        return Relayed(choice, entries, prompt_token_ids=prompt_token_ids)

    def usage_head(self) -> dict[str, Any]:
        return {"id": self.response_id, "object": COMPLETION_CHUNK, "model": self.model}

    def batch(self, states: Sequence[RequestState], usage: UsageInfo,
              metrics: dict[str, Any] | None = None) -> CompletionResponse:
        return self.answer([s.choices for s in states], usage, metrics)

    def answer(self, groups: Sequence[Sequence[Finished]], usage: UsageInfo,
               metrics: dict[str, Any] | None = None) -> CompletionResponse:
        """Choices of every prompt (one group per prompt), renumbered 0..N-1."""
        choices: list[CompletionResponseChoice] = []
        for group in groups:
            for c in group:
                entries = c.logprob_entries
                choices.append(CompletionResponseChoice(
                    index=len(choices), text=c.text,
                    logprobs=None if entries is None else completion_logprobs(entries),
                    finish_reason=c.finish_reason or "stop", stop_reason=c.stop_reason,
                    token_ids=c.token_ids if self.return_token_ids else None,
                    prompt_token_ids=list(c.prompt_token_ids) if self.return_token_ids else None,
                ))
        return CompletionResponse(id=self.response_id, model=self.model, choices=choices, usage=usage,
                                  metrics=metrics)
