"""What every response surface has: an opening, a chunk per step (the one emptiness rule), a closing and a
batch answer. The stream runner (:func:`pdserve.serve.responses.respond`) runs any surface."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from pdserve.output.policy import usage_chunk
from pdserve.output.surfaces.source import Step
from pdserve.protocol.generate import OutputMode
from pdserve.protocol.openai import UsageInfo
from pdserve.protocol.sse import sse_event_bytes

if TYPE_CHECKING:
    from pydantic import BaseModel

    from pdserve.output.request_state import RequestState


class Surface:
    """One endpoint's response shape. Subclasses set :attr:`endpoint` and :attr:`output_mode` (the labels
    a request is counted under), :meth:`shows`, :meth:`build` and :meth:`usage_head`."""

    endpoint: ClassVar[str]
    # The generate output mode the surface shows (chat: derender, completions: text): what a decode leg
    # that feeds this surface runs.
    output_mode: ClassVar[OutputMode]
    # Every chunk carries usage so far (stream_options.continuous_usage_stats), where the surface has it.
    continuous_usage: bool = False
    include_usage: bool = False

    @property
    def labels(self) -> tuple[str, str]:
        return self.endpoint, self.output_mode

    def opening(self) -> list[dict[str, Any]]:
        """Chunks before any step's (chat: one role chunk per choice)."""
        return []

    def shows(self, step: Step) -> bool:
        """The step carries something this surface puts in a chunk (besides a finish)."""
        raise NotImplementedError

    def carries(self, step: Step) -> bool:
        """THE emptiness rule: a step makes a chunk when it finishes its choice or carries something the
        surface shows. Local updates and relayed chunks alike are asked here."""
        return step.finish_reason is not None or self.shows(step)

    def build(self, step: Step, usage: UsageInfo | None = None, metrics: dict[str, Any] | None = None,
              prompt: int = 0) -> dict[str, Any]:
        """The step's chunk, as a JSON-ready dict. ``prompt``: the step's prompt (completions' several)."""
        raise NotImplementedError

    def event(self, step: Step, usage: UsageInfo | None = None, metrics: dict[str, Any] | None = None,
              prompt: int = 0) -> bytes:
        """The step's chunk as the SSE event's bytes (a surface may make them without the dict)."""
        return sse_event_bytes(self.build(step, usage, metrics, prompt))

    def chunk(self, step: Step, usage: UsageInfo | None = None, metrics: dict[str, Any] | None = None,
              prompt: int = 0) -> dict[str, Any] | None:
        """The step's chunk, or None when it carries nothing for the client."""
        return self.build(step, usage, metrics, prompt) if self.carries(step) else None

    def usage_head(self) -> dict[str, Any]:
        """The identifying fields of the usage-only chunk."""
        raise NotImplementedError

    def usage_chunk(self, usage: UsageInfo | None) -> dict[str, Any]:
        return usage_chunk(self.usage_head(), usage)

    def closing(self, usage: UsageInfo) -> list[dict[str, Any]]:
        """Chunks after every step's: the usage chunk when the request asked for it."""
        return [self.usage_chunk(usage)] if self.include_usage else []

    def batch(self, states: Sequence[RequestState], usage: UsageInfo,
              metrics: dict[str, Any] | None = None) -> BaseModel:
        """The batch answer from this frontend's request states (one per prompt)."""
        raise NotImplementedError
