"""Events the parser stages emit while they consume model output.

Both the batch path and the streaming path run the same stages and fold the
same events (batch: into one message, streaming: into one delta per engine
step). That is what makes "concatenated deltas == batch message" hold for any
chunking: there is only one parse, folded two ways.
"""

from __future__ import annotations

from typing import NamedTuple


class Reasoning(NamedTuple):
    """Chain-of-thought text."""

    text: str


class Content(NamedTuple):
    """Visible answer text."""

    text: str


class ToolStart(NamedTuple):
    """A tool call whose function name is now known; ``index`` counts calls from 0."""

    index: int  # type: ignore[assignment]  # the field shadows tuple.index on purpose: events are data
    name: str


class ToolArgs(NamedTuple):
    """The next piece of a call's arguments JSON (pieces concatenate to the whole)."""

    index: int  # type: ignore[assignment]  # as ToolStart.index
    text: str


Event = Reasoning | Content | ToolStart | ToolArgs
