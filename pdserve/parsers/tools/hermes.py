"""``hermes``: ``<tool_call>{"name": …, "arguments": {…}}</tool_call>`` (Hermes 2 Pro / Qwen JSON calls).

Each region's JSON body is read by a small top-level object machine that
hands every value to a ``JsonValueScanner``, so each character is looked at
once. The call starts (name delta) as soon as the ``"name"`` string is
complete; the ``"arguments"`` value streams as the model's raw JSON text up to
its closable prefix, and when the region ends early (cut at ``max_tokens``,
broken JSON) the closer is appended, so the concatenated arguments are always
valid JSON. Arguments that arrive before the name are held until the name is
known. Batch arguments are the same text re-serialised with
``json.dumps(..., ensure_ascii=False)``, so streamed and batch arguments are
equal as parsed JSON.

Text outside regions is content (also after a call); a stray ``</tool_call>``
outside a region is plain text.
"""

from __future__ import annotations

import json
from enum import Enum, auto

from pdserve.parsers.events import Event, ToolArgs
from pdserve.parsers.json_scanner import JsonValueScanner
from pdserve.parsers.scanner import TagSet
from pdserve.parsers.tools.base import TOOL_CALL_END, TOOL_CALL_START, ToolParser
from pdserve.protocol.openai import ChatCompletionToolsParam

_OUTSIDE = TagSet(TOOL_CALL_START)
_INSIDE = TagSet(TOOL_CALL_START, TOOL_CALL_END)
_WHITESPACE = " \t\n\r"


class _Body(Enum):
    START = auto()  # before '{'
    KEY_FIRST = auto()  # after '{': a key or '}'
    KEY_NEXT = auto()  # after ',': a key
    KEY = auto()  # reading a key string
    COLON = auto()
    VALUE = auto()  # a value starts at the next non-whitespace character
    IN_VALUE = auto()
    AFTER = auto()  # ',' or '}'
    DONE = auto()  # body object closed; anything after it is ignored
    BROKEN = auto()


class _HermesCall:
    """The JSON body of one ``<tool_call>`` region."""

    def __init__(self) -> None:
        self.raw: list[str] | None = [TOOL_CALL_START]  # kept until the name is known, for the fallback
        self.name: str | None = None
        self.index: int | None = None
        self.arguments: JsonValueScanner | None = None
        self.emitted_arguments = False
        self._state = _Body.START
        self._value: JsonValueScanner | None = None
        self._key: str | None = None

    def feed(self, text: str) -> None:
        if self.raw is not None:
            self.raw.append(text)
        pos, end = 0, len(text)
        while pos < end and self._state is not _Body.DONE and self._state is not _Body.BROKEN:
            if self._value is not None:
                pos = self._value.feed(text, pos)
                self._value_progress()
                continue
            char = text[pos]
            if char in _WHITESPACE:
                pos += 1
                continue
            state = self._state
            if state is _Body.START and char == "{":
                self._state = _Body.KEY_FIRST
            elif char == "}" and (state is _Body.KEY_FIRST or state is _Body.AFTER):
                self._state = _Body.DONE
            elif (state is _Body.KEY_FIRST or state is _Body.KEY_NEXT) and char == '"':
                self._state = _Body.KEY
                self._value = JsonValueScanner()
                continue
            elif state is _Body.COLON and char == ":":
                self._state = _Body.VALUE
            elif state is _Body.VALUE:
                self._state = _Body.IN_VALUE
                self._value = JsonValueScanner()
                if self._key == "arguments" and self.arguments is None:
                    self.arguments = self._value
                continue
            elif state is _Body.AFTER and char == ",":
                self._state = _Body.KEY_NEXT
            else:
                self._state = _Body.BROKEN
            pos += 1

    def finish(self) -> None:
        if self._value is not None:
            self._value.finish()
            self._value_progress()

    def _value_progress(self) -> None:
        value = self._value
        if value is None:
            return
        if value.broken:
            self._state = _Body.BROKEN
            self._value = None
        elif value.done:
            self._value = None
            if self._state is _Body.KEY:
                self._key = json.loads(value.text(), strict=False)
                self._state = _Body.COLON
                return
            if self._key == "name" and self.name is None:
                name = json.loads(value.text(), strict=False)
                if isinstance(name, str) and name:
                    self.name = name
            self._state = _Body.AFTER


class HermesToolParser(ToolParser):
    name = "hermes"
    RUNS_WHEN_TOOL_CHOICE_NONE = False

    def __init__(self, tools: list[ChatCompletionToolsParam] | None) -> None:
        super().__init__(tools)
        self._call: _HermesCall | None = None

    def feed(self, text: str, out: list[Event]) -> None:
        self._scanner.push(text)
        while True:
            piece, tag = self._scanner.next(_OUTSIDE if self._call is None else _INSIDE)
            if piece:
                self._text(piece, out)
            if tag is None:
                return
            if self._call is not None:
                self._end_call(out, closed=tag == TOOL_CALL_END)
            if tag == TOOL_CALL_START:
                self._call = _HermesCall()

    def finish(self, out: list[Event]) -> None:
        rest = self._scanner.drain()
        if rest:
            self._text(rest, out)
        if self._call is not None:
            self._end_call(out, closed=False)
        self._finish_content(out)

    def finalize_arguments(self, arguments: str) -> str:
        return json.dumps(json.loads(arguments, strict=False), ensure_ascii=False)

    def _text(self, text: str, out: list[Event]) -> None:
        if self._call is None:
            self._content(text, out)
        else:
            self._call.feed(text)
            self._emit(self._call, out)

    def _emit(self, call: _HermesCall, out: list[Event]) -> None:
        if call.index is None:
            if call.name is None:
                return
            call.index = self._start_call(call.name, out)
            call.raw = None
        if call.arguments is not None:
            piece = call.arguments.take()
            if piece:
                out.append(ToolArgs(call.index, piece))
                call.emitted_arguments = True

    def _end_call(self, out: list[Event], closed: bool) -> None:
        call = self._call
        assert call is not None
        self._call = None
        call.finish()
        self._emit(call, out)
        if call.index is None:
            assert call.raw is not None
            self._content("".join(call.raw) + (TOOL_CALL_END if closed else ""), out)
        elif not call.emitted_arguments:
            out.append(ToolArgs(call.index, "{}"))
        elif call.arguments is not None and not call.arguments.done:
            out.append(ToolArgs(call.index, call.arguments.closer()))
