"""``/inference/v1/generate`` in each output mode: one surface class per mode, registered by its name.

A new output mode is its protocol types (``pdserve.protocol.generate``) plus one class here: what its
chunk shows and carries, and its batch choice.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, ClassVar

import msgspec

from pdserve.output.policy import assistant_delta, decoded_logprobs_json, delta_json
from pdserve.output.request_state import ChoiceState, RequestState
from pdserve.output.surfaces.base import Surface
from pdserve.output.surfaces.source import Step
from pdserve.protocol.generate import (
    GenerateDerenderChoice,
    GenerateDerenderResponse,
    GenerateLogProbs,
    GenerateResponseBase,
    GenerateTextChoice,
    GenerateTextResponse,
    GenerateTokensChoice,
    GenerateTokensResponse,
    OutputMode,
)
from pdserve.protocol.openai import ChatCompletionLogProbs, TextDelta, UsageInfo
from pdserve.protocol.sse import sse_event_bytes
from pdserve.text.logprob_json import generate_content_json
from pdserve.text.logprobs import prompt_logprob_dicts, to_generate_logprobs
from pdserve.text.tokenizer import Tokenizer

# A value's place in a chunk template (GenerateSurface.event): a NUL byte, which encoded JSON never holds
# (a string escapes it).
_SLOT_BYTES = b"\0"
_SLOT = msgspec.Raw(_SLOT_BYTES)
_encode = msgspec.json.Encoder().encode


class GenerateSurface(Surface):
    """A generate response in one output mode. ``prompt_token_ids``: returned (return_token_ids) on the
    first chunk and in the batch answer."""

    endpoint = "generate"
    response_type: ClassVar[type[GenerateResponseBase]]

    def __init__(self, request_id: str, model: str, *, want_logprobs: bool = False,
                 prompt_token_ids: list[int] | None = None, include_usage: bool = False,
                 continuous_usage: bool = False, tokenizer: Tokenizer | None = None) -> None:
        self.request_id = request_id
        self.model = model
        self.want_logprobs = want_logprobs
        self.prompt_token_ids = prompt_token_ids
        self.include_usage = include_usage
        self.continuous_usage = include_usage and continuous_usage
        self.tokenizer = tokenizer
        self._seen: set[int] = set()
        self._first_chunk = True
        self._templates: dict[int, bytes] = {}  # per choice: a running step's event, a %-format (event)

    # ------------------------------------------------------------ stream

    def payload(self, step: Step, first_for_choice: bool) -> tuple[dict[str, Any], dict[str, Any] | None, bool]:
        """The mode's own choice fields, its logprobs object, and whether the ids are withheld."""
        raise NotImplementedError

    def build(self, step: Step, usage: UsageInfo | None = None, metrics: dict[str, Any] | None = None,
              prompt: int = 0) -> dict[str, Any]:
        """One SSE event (one choice), key for key what the wire models (``Generate*StreamResponse``) dump
        (property-tested against them in tests/unit/output/test_stream_chunk.py), without a model built,
        validated and dumped per token; logprob content comes as JSON already written
        (:mod:`pdserve.text.logprob_json`) or as the decoder's structs, and a plain delta as its
        :class:`~pdserve.protocol.openai.TextDelta`, which msgspec encodes as they are."""
        index = step.index
        payload, logprobs, hide_ids = self.payload(step, index not in self._seen)
        self._seen.add(index)
        opening_ids = self.prompt_token_ids if self._first_chunk else None
        self._first_chunk = False
        return self._chunk(index, step.finish_reason, step.stop_reason, None if hide_ids else step.token_ids,
                           payload, logprobs, usage, metrics, opening_ids)

    def event(self, step: Step, usage: UsageInfo | None = None, metrics: dict[str, Any] | None = None,
              prompt: int = 0) -> bytes:
        """:meth:`build`'s event as bytes. A running step (no finish) of a choice that already had a chunk,
        without usage or metrics, is most of a stream's events: its values are spliced into the choice's
        template (the same chunk built once with a slot for each value), so the chunk's constant keys are
        neither built nor encoded again per token."""
        index = step.index
        if (usage is not None or metrics is not None or step.finish_reason is not None
                or step.stop_reason is not None or index not in self._seen):
            return sse_event_bytes(self.build(step, usage, metrics, prompt))
        payload, logprobs, hide_ids = self.payload(step, False)
        template = self._templates.get(index)
        if template is None:
            template = self._templates[index] = self._template(index, payload)
        return template % (_encode(None if hide_ids else step.token_ids), *map(_encode, payload.values()),
                           _encode(logprobs))

    def _template(self, index: int, payload: dict[str, Any]) -> bytes:
        """A running step's event for choice ``index`` as a %-format, a ``%b`` for each value: the chunk's
        token ids, the mode's own fields (``payload``'s keys), its logprobs."""
        chunk = self._chunk(index, None, None, _SLOT, dict.fromkeys(payload, _SLOT), _SLOT, None, None, None)
        parts = sse_event_bytes(chunk).split(_SLOT_BYTES)
        return b"%b".join(part.replace(b"%", b"%%") for part in parts)

    def _chunk(self, index: int, finish_reason: str | None, stop_reason: int | str | None, token_ids: Any,
               payload: dict[str, Any], logprobs: Any, usage: UsageInfo | None, metrics: dict[str, Any] | None,
               opening_ids: list[int] | None) -> dict[str, Any]:
        """The chunk of one choice's step, its keys in the wire models' order: the one place its shape is
        written (:meth:`build` and :meth:`event`'s templates)."""
        choice: dict[str, Any] = {
            "index": index, "finish_reason": finish_reason, "stop_reason": stop_reason, "token_ids": token_ids,
            "routed_experts": None, "sampling_mask": None, "weight_versions": None, **payload, "logprobs": logprobs,
        }
        chunk: dict[str, Any] = {
            "request_id": self.request_id, "usage": None if usage is None else usage.model_dump(mode="json"),
        }
        if metrics is not None:
            chunk["metrics"] = metrics
        chunk["output_mode"] = self.output_mode
        chunk["choices"] = [choice]
        if opening_ids is not None:
            chunk["prompt_token_ids"] = opening_ids
        return chunk

    def usage_head(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "output_mode": self.output_mode}

    # ------------------------------------------------------------ batch

    def batch_choice(self, choice: ChoiceState) -> Any:
        raise NotImplementedError

    def batch(self, states: Sequence[RequestState], usage: UsageInfo,
              metrics: dict[str, Any] | None = None) -> GenerateResponseBase:
        """The non-streaming response (generate has one request state)."""
        (state,) = states
        base: dict[str, Any] = {"request_id": self.request_id, "model": self.model,
                                "prompt_token_ids": self.prompt_token_ids}
        if state.prompt_logprobs is not None:
            base["prompt_logprobs"] = prompt_logprob_dicts(self.tokenizer, state.prompt_logprobs)
        base["kv_transfer_params"] = state.kv_transfer_params
        if metrics is not None:
            base["metrics"] = metrics
        choices = [self.batch_choice(c) for c in state.choices]
        return self.response_type(choices=choices, **base, usage=usage, created=int(time.time()))

    def _chat_logprobs(self, choice: ChoiceState) -> ChatCompletionLogProbs | None:
        return ChatCompletionLogProbs(content=list(choice.decoded_logprobs)) if self.want_logprobs else None


class TokensSurface(GenerateSurface):
    """``tokens``: ids and int logprobs, as vLLM sends them."""

    output_mode = "tokens"
    response_type = GenerateTokensResponse

    def shows(self, step: Step) -> bool:
        return bool(step.token_ids)

    def payload(self, step: Step, first_for_choice: bool) -> tuple[dict[str, Any], dict[str, Any] | None, bool]:
        logprobs = None
        if self.want_logprobs and step.logprobs is not None:
            logprobs = {"content": msgspec.Raw(generate_content_json(step.logprobs, step.token_ids or ()))}
        return {}, logprobs, False

    def batch_choice(self, choice: ChoiceState) -> GenerateTokensChoice:
        logprobs = None
        if self.want_logprobs:
            logprobs = GenerateLogProbs(content=to_generate_logprobs(choice.logprobs, choice.token_ids))
        return GenerateTokensChoice(index=choice.index, finish_reason=choice.finish_reason or "stop",
                                    stop_reason=choice.stop_reason, token_ids=choice.token_ids, logprobs=logprobs)


class TextSurface(GenerateSurface):
    """``text``: the detokenized text beside the ids, decoded logprobs."""

    output_mode = "text"
    response_type = GenerateTextResponse

    def shows(self, step: Step) -> bool:
        return bool(step.token_ids) or bool(step.text)

    def payload(self, step: Step, first_for_choice: bool) -> tuple[dict[str, Any], dict[str, Any] | None, bool]:
        logprobs = decoded_logprobs_json(step) if self.want_logprobs else None  # type: ignore[arg-type]
        return {"text": step.text}, logprobs, False

    def batch_choice(self, choice: ChoiceState) -> GenerateTextChoice:
        return GenerateTextChoice(index=choice.index, finish_reason=choice.finish_reason or "stop",
                                  stop_reason=choice.stop_reason, token_ids=choice.token_ids, text=choice.text,
                                  logprobs=self._chat_logprobs(choice))


class DerenderSurface(GenerateSurface):
    """``derender``: the OpenAI chat message (batch) or delta (stream), role on each choice's first delta."""

    output_mode = "derender"
    response_type = GenerateDerenderResponse

    def shows(self, step: Step) -> bool:
        # Released text the parser holds back still makes a chunk (with an empty delta), as it always has.
        delta = step.delta
        return bool(step.token_ids) or bool(step.text) or not (delta is None or delta.is_empty())

    def payload(self, step: Step, first_for_choice: bool) -> tuple[dict[str, Any], dict[str, Any] | None, bool]:
        hide = step.hides_metadata
        delta = assistant_delta(step.delta) if first_for_choice else step.delta
        logprobs = decoded_logprobs_json(step) if self.want_logprobs and not hide else None  # type: ignore[arg-type]
        # A TextDelta goes as it is: msgspec writes the bytes of its dump in a quarter of the time a dict takes.
        return {"delta": delta if type(delta) is TextDelta else delta_json(delta)}, logprobs, hide

    def batch_choice(self, choice: ChoiceState) -> GenerateDerenderChoice:
        message, finish = choice.final_message()
        hide = choice.hides_metadata
        return GenerateDerenderChoice(index=choice.index, finish_reason=finish, stop_reason=choice.stop_reason,
                                      token_ids=None if hide else choice.token_ids, message=message,
                                      logprobs=None if hide else self._chat_logprobs(choice))


GENERATE_SURFACES: dict[OutputMode, type[GenerateSurface]] = {
    surface.output_mode: surface for surface in (TokensSurface, TextSurface, DerenderSurface)
}


def generate_surface(mode: OutputMode) -> type[GenerateSurface]:
    """The surface class of an output mode."""
    return GENERATE_SURFACES[mode]

