"""Shared machinery of the ``<think>`` … ``</think>`` reasoning parsers.

A reasoning parser is the first stage of the per-choice pipeline: it splits
model output into ``Reasoning`` events and ``Content`` events; the content
goes on to the tool parser (or straight into the message). It starts in the
reasoning state unless the prompt already closed reasoning, because models
may omit the opening tag (the chat template often emits it), so everything
before ``</think>`` counts as reasoning.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from pdserve.parsers.events import Content, Event, Reasoning
from pdserve.parsers.scanner import TagScanner, TagSet
from pdserve.parsers.vocab import Vocab, require_single_tokens

THINK_START = "<think>"
THINK_END = "</think>"


class ReasoningParser(ABC):
    """One instance per choice; feed it the output text in order, then ``finish``.

    Subclasses set the tags that matter in each state. In the reasoning state,
    ``<think>`` is swallowed, ``</think>`` ends reasoning, and any other tag in
    ``REASONING_TAGS`` ends reasoning implicitly and is handed on as content
    (Qwen3's ``<tool_call>``). In the content state, tags in ``CONTENT_TAGS``
    are dropped; ``None`` means content passes through unscanned.
    """

    name: ClassVar[str]
    REASONING_TAGS: ClassVar[TagSet]
    CONTENT_TAGS: ClassVar[TagSet | None]
    # Whitespace at the very start of the output is dropped when ``<think>`` follows it
    # (held until the first other text decides; released as reasoning otherwise).
    DROPS_WHITESPACE_BEFORE_THINK: ClassVar[bool] = False
    # A batch message reports reasoning ``""`` (not None) when the output started in
    # reasoning but gave no reasoning text.
    EMPTY_REASONING_IS_STRING: ClassVar[bool] = False

    @classmethod
    def validate(cls, vocab: Vocab) -> None:
        require_single_tokens(vocab, cls.name, (THINK_START, THINK_END))

    def __init__(
        self,
        vocab: Vocab,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> None:
        """``chat_template_kwargs`` are the request's template switches (qwen3 reads ``enable_thinking``);
        ``prompt_token_ids`` decide whether output starts past reasoning (``is_reasoning_end``)."""
        self._start_id = vocab.token_to_id(THINK_START)
        self._end_id = vocab.token_to_id(THINK_END)
        self.in_reasoning = self._starts_in_reasoning(prompt_token_ids)
        self._started_in_reasoning = self.in_reasoning
        self._scanner = TagScanner()
        self._at_start = self.in_reasoning and self.DROPS_WHITESPACE_BEFORE_THINK
        self._leading = ""  # whitespace held while _at_start

    def _starts_in_reasoning(self, prompt_token_ids: Sequence[int] | None) -> bool:
        return prompt_token_ids is None or not self.is_reasoning_end(prompt_token_ids)

    @abstractmethod
    def is_reasoning_end(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether generation after this prompt starts past the reasoning section."""

    @property
    def scanned(self) -> int:
        return self._scanner.scanned

    @property
    def reports_empty_reasoning(self) -> bool:
        """Whether a batch message without reasoning text says ``""`` rather than None."""
        return self.EMPTY_REASONING_IS_STRING and self._started_in_reasoning

    def take_plain_reasoning(self, text: str) -> bool:
        """Take ``text`` whole as reasoning when that is all :meth:`feed` would make of it. False: nothing
        was taken."""
        return self.in_reasoning and self._take_plain(text, self.REASONING_TAGS)

    def _take_plain(self, text: str, tags: TagSet | None) -> bool:
        """Take ``text`` whole as one event of the state whose tags are ``tags`` (past the start, nothing
        buffered, no tag can start in it). False: nothing was taken."""
        return tags is not None and not self._at_start and text != "" and self._scanner.take_plain(text, tags)

    def feed(self, text: str, out: list[Event]) -> None:
        if self._take_plain(text, self.REASONING_TAGS if self.in_reasoning else self.CONTENT_TAGS):
            out.append(Reasoning(text) if self.in_reasoning else Content(text))
            return
        self._scanner.push(text)
        while True:
            tags = self.REASONING_TAGS if self.in_reasoning else self.CONTENT_TAGS
            if tags is None:
                rest = self._scanner.drain()
                if rest:
                    out.append(Content(rest))
                return
            piece, tag = self._scanner.next(tags)
            if self._at_start:
                piece = self._leading_text(piece, tag)
            if piece:
                out.append(Reasoning(piece) if self.in_reasoning else Content(piece))
            if tag is None:
                return
            if self.in_reasoning and tag != THINK_START:
                self.in_reasoning = False
                if tag != THINK_END:
                    out.append(Content(tag))

    def finish(self, out: list[Event]) -> None:
        rest = self._leading + self._scanner.drain()
        self._leading = ""
        if rest:
            out.append(Reasoning(rest) if self.in_reasoning else Content(rest))

    def _leading_text(self, piece: str, tag: str | None) -> str:
        """While only whitespace has come: hold it; drop it at ``<think>``, release it before anything else."""
        if tag is None and not piece.strip():
            self._leading += piece
            return ""
        self._at_start = False
        leading, self._leading = self._leading, ""
        if tag == THINK_START and not piece.strip():
            return ""
        return leading + piece
