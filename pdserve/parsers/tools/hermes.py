"""``hermes``: ``<tool_call>{"name": …, "arguments": {…}}</tool_call>`` (Hermes 2 Pro / Qwen JSON calls).

Each region's JSON body is read by a small top-level object machine that
hands every value to a ``JsonValueScanner``, so each character is looked at
once. A region becomes a tool call only when that is certain, because a
streamed call cannot be taken back:

* when its body object closes as valid JSON with a string ``"name"``: the
  call is released whole at that moment (name and arguments in one delta);
* when the output is cut by ``length`` after the name: the arguments are
  closed by appending the scanner's closer, so they are valid JSON.

Any other region (broken JSON, a body that never closes before the region
or the output ends, no name) is released verbatim as content, as vLLM's
batch parser does when ``json.loads`` fails. Arguments that arrive before
the name are fine (the body is read whole first). Batch arguments are the
same text re-serialised with ``json.dumps(..., ensure_ascii=False)``, so
streamed and batch arguments are equal as parsed JSON.

Text outside regions is content (also after a call); a stray ``</tool_call>``
outside a region is plain text; anything after a closed body up to
``</tool_call>`` is ignored.
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
        self.raw: list[str] = [TOOL_CALL_START]  # the region's text, released as content unless it becomes a call
        self.name: str | None = None
        self.index: int | None = None  # set once released as a call
        self.arguments: JsonValueScanner | None = None
        self._state = _Body.START
        self._value: JsonValueScanner | None = None
        self._key: str | None = None

    @property
    def complete(self) -> bool:
        """The body closed as a valid JSON object that named the function."""
        return self._state is _Body.DONE and self.name is not None

    @property
    def broken(self) -> bool:
        return self._state is _Body.BROKEN

    def feed(self, text: str) -> None:
        if self.index is None:
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
        if text and self._scanner.take_plain(text, _OUTSIDE if self._call is None else _INSIDE):
            self._text(text, out)
            return
        self._scanner.push(text)
        while True:
            piece, tag = self._scanner.next(_OUTSIDE if self._call is None else _INSIDE)
            if piece:
                self._text(piece, out)
            if tag is None:
                return
            if self._call is not None:
                self._end_call(out, closed=tag == TOOL_CALL_END, cut=False)
            if tag == TOOL_CALL_START:
                self._call = _HermesCall()

    def finish(self, out: list[Event], cut: bool) -> None:
        rest = self._scanner.drain()
        if rest:
            self._text(rest, out)
        if self._call is not None:
            self._end_call(out, closed=False, cut=cut)
        self._finish_content(out)

    def finalize_arguments(self, arguments: str) -> str:
        return json.dumps(json.loads(arguments, strict=False), ensure_ascii=False)

    def _text(self, text: str, out: list[Event]) -> None:
        call = self._call
        if call is None:
            self._content(text, out)
            return
        call.feed(text)
        if call.index is None and call.complete:
            self._release(call, out)

    def _release(self, call: _HermesCall, out: list[Event]) -> None:
        """Emit the region as one tool call: its name, then all of its (closed) arguments."""
        assert call.name is not None
        call.index = self._start_call(call.name, out)
        call.raw.clear()
        arguments = ""
        if call.arguments is not None:
            arguments = call.arguments.take()
            if arguments:
                arguments += call.arguments.closer()
        out.append(ToolArgs(call.index, arguments or "{}"))

    def _end_call(self, out: list[Event], closed: bool, cut: bool) -> None:
        """The region ended (closing tag, a new ``<tool_call>``, or the end of output)."""
        call = self._call
        assert call is not None
        self._call = None
        if call.index is not None:
            return  # released when its body closed
        # A body cut short by max_tokens is still the call the model was making; a broken one is not.
        keep_cut = cut and call.name is not None and not call.broken
        call.finish()
        if call.complete or keep_cut:
            self._release(call, out)
        else:
            self._content("".join(call.raw) + (TOOL_CALL_END if closed else ""), out)
