"""What a surface reads: a choice's stream step, or a finished choice, from either source.

* Local engine: a stream step is the :class:`~pdserve.output.request_state.ChoiceUpdate` the choice state
  released, a finished choice the :class:`~pdserve.output.request_state.ChoiceState` itself.
* A decode leg (the proxy): the choice of a relayed generate chunk or response (``output_mode`` ``text``
  or ``derender``), or of a ``/derender`` answer, read into a :class:`Relayed`.

Both read alike (:class:`Step`, :class:`Finished`), so one surface builds the client's chunk from either
and the two agree by construction (tests/unit/output/test_surfaces.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from pdserve.protocol.openai import ChatMessage, DeltaMessage, StreamDelta, TextDelta


class Step(Protocol):
    """One choice's step of a stream (read-only, so a source may narrow a type: ``token_ids`` always there,
    ``logprobs_json`` never)."""

    @property
    def index(self) -> int: ...

    @property
    def token_ids(self) -> list[int] | None: ...

    @property
    def text(self) -> str: ...

    @property
    def delta(self) -> StreamDelta | None: ...

    @property
    def finish_reason(self) -> str | None: ...

    @property
    def stop_reason(self) -> int | str | None: ...

    @property
    def hides_metadata(self) -> bool:
        """The choice hides reasoning, so its ids and logprobs are withheld (the parser decides)."""

    @property
    def logprobs(self) -> Any:
        """Generate ``tokens``: engine positions."""

    @property
    def decoded_logprobs(self) -> Sequence[Any] | None:
        """The decoded levels: chat-shape entries (structs or dicts)."""

    @property
    def logprobs_json(self) -> bytes | None:
        """The same entries as JSON written ahead."""

    @property
    def finished(self) -> bool: ...

    @property
    def has_logprob_entries(self) -> bool: ...


class Finished(Protocol):
    """A finished choice, for a batch answer."""

    @property
    def index(self) -> int: ...

    @property
    def text(self) -> str: ...

    @property
    def token_ids(self) -> list[int] | None: ...

    @property
    def finish_reason(self) -> str | None: ...

    @property
    def stop_reason(self) -> int | str | None: ...

    @property
    def hides_metadata(self) -> bool:
        """Asked after :meth:`final_message` (a batch choice's parser runs there)."""

    @property
    def prompt_token_ids(self) -> Sequence[int]: ...

    @property
    def logprob_entries(self) -> Sequence[Any] | None:
        """Chat-shape logprob entries, None when the request asked for none."""

    def final_message(self) -> tuple[ChatMessage | dict[str, Any], str | None]: ...


class Relayed:
    """A decode leg's choice (a stream chunk's or a batch response's), read as a :class:`Step` and a
    :class:`Finished`. What the leg withheld (hidden ids and logprobs) is already absent."""

    __slots__ = ("index", "token_ids", "text", "delta", "finish_reason", "stop_reason", "decoded_logprobs",
                 "message", "prompt_token_ids")

    hides_metadata = False
    logprobs = None
    logprobs_json = None

    def __init__(self, choice: dict[str, Any], entries: Sequence[Any] | None = None, *,
                 delta: StreamDelta | None = None, prompt_token_ids: Sequence[int] = ()) -> None:
        self.index: int = choice["index"]
        self.token_ids: list[int] | None = choice.get("token_ids")
        self.text: str = choice.get("text") or ""
        self.delta = delta
        self.finish_reason: str | None = choice.get("finish_reason")
        self.stop_reason: int | str | None = choice.get("stop_reason")
        self.decoded_logprobs = entries
        self.message: dict[str, Any] | None = choice.get("message")
        self.prompt_token_ids = prompt_token_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def has_logprob_entries(self) -> bool:
        return bool(self.decoded_logprobs)

    @property
    def logprob_entries(self) -> Sequence[Any] | None:
        return self.decoded_logprobs

    def final_message(self) -> tuple[ChatMessage | dict[str, Any], str | None]:
        return self.message, self.finish_reason  # type: ignore[return-value]  # None: the model refuses it


def relayed_content(choice: dict[str, Any]) -> list[Any] | None:
    """A relayed choice's chat-shape logprob entries, as sent (None when it has none)."""
    logprobs = choice.get("logprobs")
    return None if logprobs is None else logprobs.get("content")


def relayed_delta(delta: dict[str, Any] | None) -> StreamDelta:
    """A relayed stream delta, without its role (an OpenAI stream names the role once, in its opening)."""
    delta = delta or {}
    if delta.get("tool_calls"):
        message = DeltaMessage.model_validate(delta)
        message.role = None
        return message
    return TextDelta(content=delta.get("content"), reasoning=delta.get("reasoning"))
