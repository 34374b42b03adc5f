"""Shared behaviour of the tool-call parsers: call numbering and content whitespace.

A tool parser is the second pipeline stage: it takes the content text that
the reasoning stage let through and splits it into ``Content``, ``ToolStart``
and ``ToolArgs`` events.

Whitespace rule (one rule for batch and streaming, so both agree for any
chunking): whitespace-only runs of content are held back; they are released
in front of the next non-whitespace content, dropped when a tool call starts,
and at the end of output released only if no tool call was made. So content
before a call loses its trailing whitespace and whitespace-only content next
to calls disappears, while content without calls is passed through verbatim.

A markup region that never becomes a tool call (malformed, or cut short
before its name) is released verbatim as content when it ends, so no model
output is lost.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from pdserve.parsers.events import Content, Event, ToolStart
from pdserve.parsers.scanner import TagScanner
from pdserve.parsers.vocab import Vocab, require_single_tokens
from pdserve.protocol.openai import ChatCompletionToolsParam

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


class ToolParser(ABC):
    """One instance per choice; ``feed`` content text in order, then ``finish``."""

    name: ClassVar[str]
    # Whether the parser still runs for tool_choice="none" (to strip its markup
    # from content) instead of leaving the raw text alone.
    RUNS_WHEN_TOOL_CHOICE_NONE: ClassVar[bool]

    @classmethod
    def validate(cls, vocab: Vocab) -> None:
        require_single_tokens(vocab, cls.name, (TOOL_CALL_START, TOOL_CALL_END))

    def __init__(self, tools: list[ChatCompletionToolsParam] | None) -> None:
        self._tools = tools or []
        self._scanner = TagScanner()
        self._held_whitespace = ""
        self.calls = 0

    @property
    def scanned(self) -> int:
        return self._scanner.scanned

    @abstractmethod
    def feed(self, text: str, out: list[Event]) -> None: ...

    @abstractmethod
    def finish(self, out: list[Event], cut: bool) -> None:
        """End of output: close open calls, release held text (subclasses end with ``_finish_content``).

        ``cut`` says the output was cut short (finish reason ``length``) rather than ended by the model.
        """

    def finalize_arguments(self, arguments: str) -> str:
        """The batch form of a call's concatenated argument pieces."""
        return arguments

    def _content(self, text: str, out: list[Event]) -> None:
        kept = text.rstrip()
        if not kept:
            self._held_whitespace += text
            return
        out.append(Content(self._held_whitespace + kept))
        self._held_whitespace = text[len(kept) :]

    def _start_call(self, name: str, out: list[Event]) -> int:
        self._held_whitespace = ""
        index = self.calls
        self.calls += 1
        out.append(ToolStart(index, name))
        return index

    def _finish_content(self, out: list[Event]) -> None:
        if self._held_whitespace and not self.calls:
            out.append(Content(self._held_whitespace))
        self._held_whitespace = ""
