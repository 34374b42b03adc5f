"""``qwen3_coder`` (alias ``qwen3_xml``): Qwen3-Coder XML tool calls.

Markup::

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

A state machine over an incremental tag scanner (which tags count depends on
the state: ``>`` only ends a name). Arguments are built as JSON while they
stream, so they are prefix-stable and their concatenation *is* the batch
arguments string (``json.dumps`` formatting, ``ensure_ascii=False``):

* ``{``/``, `` + the key is released once the key is known;
* a string-typed value (per the tool's schema, or any value without one)
  streams character-wise, JSON-escaped, holding back one trailing newline
  (each value loses exactly one leading and one trailing newline);
* any other value is held until it ends, then typed against the schema
  (``tools.schema.coerce``) and released whole;
* ``}`` (or ``{}``) closes the call at ``</function>``, ``</tool_call>``, a
  new call, or end of output.

A value ends at ``</parameter>`` or the next ``<parameter=`` (or the end of
its function). ``<function=`` without ``<tool_call>`` also starts a call.
Tool names are not checked against ``tools``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from enum import Enum, auto
from typing import Any

from pdserve.parsers.events import Event, ToolArgs
from pdserve.parsers.scanner import TagSet
from pdserve.parsers.tools.base import TOOL_CALL_END, TOOL_CALL_START, ToolParser
from pdserve.parsers.tools.schema import STRING_ONLY, coerce, schema_types, tool_properties
from pdserve.protocol.openai import ChatCompletionToolsParam

FUNCTION_START = "<function="
FUNCTION_END = "</function>"
PARAMETER_START = "<parameter="
PARAMETER_END = "</parameter>"
NAME_END = ">"


class _CoderPhase(Enum):
    CONTENT = auto()
    PREAMBLE = auto()  # after <tool_call>, before <function=
    NAME = auto()
    ARGS = auto()  # inside a function, between parameters
    PARAM_NAME = auto()
    PARAM_VALUE = auto()
    BETWEEN = auto()  # after </function>, before </tool_call>


_TAGS = {
    _CoderPhase.CONTENT: TagSet(TOOL_CALL_START, FUNCTION_START),
    _CoderPhase.PREAMBLE: TagSet(TOOL_CALL_START, TOOL_CALL_END, FUNCTION_START),
    _CoderPhase.NAME: TagSet(NAME_END, FUNCTION_END, TOOL_CALL_END, TOOL_CALL_START),
    _CoderPhase.ARGS: TagSet(PARAMETER_START, FUNCTION_END, TOOL_CALL_END, TOOL_CALL_START, FUNCTION_START),
    _CoderPhase.PARAM_NAME: TagSet(NAME_END, PARAMETER_END, FUNCTION_END, TOOL_CALL_END),
    _CoderPhase.PARAM_VALUE: TagSet(PARAMETER_END, PARAMETER_START, FUNCTION_END, TOOL_CALL_END),
    _CoderPhase.BETWEEN: TagSet(TOOL_CALL_END, TOOL_CALL_START, FUNCTION_START),
}


def _json_string_body(text: str) -> str:
    """``text`` escaped as JSON string content (per character, so chunking does not matter)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    RUNS_WHEN_TOOL_CHOICE_NONE = True

    def __init__(self, tools: list[ChatCompletionToolsParam] | None) -> None:
        super().__init__(tools)
        self._properties = tool_properties(self._tools)
        self._state = _CoderPhase.CONTENT
        # Markup of a call attempt whose name is not known yet: released as content if it never is.
        self._raw: list[str] | None = None
        self._name: list[str] = []
        self._index: int | None = None  # the open call
        self._call_properties: Mapping[str, Any] = {}
        self._params = 0
        self._key: list[str] = []
        self._param: str | None = None  # the open parameter
        self._types: frozenset[str] = STRING_ONLY
        self._stream_string = True
        self._prefix = ""
        self._value: list[str] = []
        self._value_started = False
        self._held_newline = False

    def feed(self, text: str, out: list[Event]) -> None:
        if text and self._scanner.take_plain(text, _TAGS[self._state]):
            self._text(text, out)
            return
        self._scanner.push(text)
        while True:
            piece, tag = self._scanner.next(_TAGS[self._state])
            if piece:
                self._text(piece, out)
            if tag is None:
                return
            self._tag(tag, out)

    def finish(self, out: list[Event], cut: bool) -> None:
        """``cut`` changes nothing here: a call whose name is known stays a call, closed either way."""
        rest = self._scanner.drain()
        if rest:
            self._text(rest, out)
        # A name cut off before its '>' is not trusted: the attempt is released as text.
        self._end_attempt(out)
        self._state = _CoderPhase.CONTENT
        self._finish_content(out)

    # ------------------------------------------------------------ transitions

    def _text(self, text: str, out: list[Event]) -> None:
        if self._raw is not None:
            self._raw.append(text)
        state = self._state
        if state is _CoderPhase.CONTENT:
            self._content(text, out)
        elif state is _CoderPhase.NAME:
            self._name.append(text)
        elif state is _CoderPhase.PARAM_NAME:
            self._key.append(text)
        elif state is _CoderPhase.PARAM_VALUE:
            self._value_text(text, out)

    def _tag(self, tag: str, out: list[Event]) -> None:
        state = self._state
        if state is _CoderPhase.NAME and tag != NAME_END:
            self._resolve_name(out)  # malformed: the name ends at the next tag
        if tag == TOOL_CALL_START:
            self._end_attempt(out)
            self._raw = [tag]
            self._state = _CoderPhase.PREAMBLE
        elif tag == FUNCTION_START:
            if state is _CoderPhase.PREAMBLE and self._raw is not None:
                self._raw.append(tag)
            else:
                self._end_attempt(out)
                self._raw = [tag]
            self._name = []
            self._state = _CoderPhase.NAME
        elif tag == NAME_END:
            self._append_raw(tag)
            if state is _CoderPhase.NAME:
                self._resolve_name(out)
                self._state = _CoderPhase.ARGS
            else:
                self._begin_param(out)
                self._state = _CoderPhase.PARAM_VALUE
        elif tag == PARAMETER_START:
            self._append_raw(tag)
            self._end_param(out)
            self._key = []
            self._state = _CoderPhase.PARAM_NAME
        elif tag == PARAMETER_END:
            self._append_raw(tag)
            self._end_param(out)
            self._state = _CoderPhase.ARGS
        elif tag == FUNCTION_END:
            self._append_raw(tag)
            self._close_call(out)
            self._state = _CoderPhase.BETWEEN
        else:  # TOOL_CALL_END
            self._append_raw(tag)
            self._end_attempt(out)
            self._state = _CoderPhase.CONTENT

    def _append_raw(self, text: str) -> None:
        if self._raw is not None:
            self._raw.append(text)

    def _resolve_name(self, out: list[Event]) -> None:
        name = "".join(self._name).strip()
        self._name = []
        if name and self._index is None:
            self._index = self._start_call(name, out)
            self._raw = None
            self._params = 0
            self._call_properties = self._properties.get(name, {})

    def _end_attempt(self, out: list[Event]) -> None:
        self._close_call(out)
        if self._raw is not None:
            self._content("".join(self._raw), out)
            self._raw = None

    def _close_call(self, out: list[Event]) -> None:
        self._end_param(out)
        if self._index is not None:
            out.append(ToolArgs(self._index, "}" if self._params else "{}"))
            self._index = None

    # ------------------------------------------------------------ parameters

    def _begin_param(self, out: list[Event]) -> None:
        key = "".join(self._key).strip()
        self._key = []
        if self._index is None or not key:
            return
        self._param = key
        self._types = schema_types(self._call_properties[key]) if key in self._call_properties else frozenset()
        self._stream_string = self._types <= STRING_ONLY
        self._prefix = ("{" if self._params == 0 else ", ") + json.dumps(key, ensure_ascii=False) + ": "
        self._params += 1
        self._value = []
        self._value_started = False
        self._held_newline = False
        if self._stream_string:
            out.append(ToolArgs(self._index, self._prefix + '"'))

    def _value_text(self, text: str, out: list[Event]) -> None:
        if self._param is None or self._index is None:
            return
        if not self._value_started:
            self._value_started = True
            text = text.removeprefix("\n")
        if not self._stream_string:
            self._value.append(text)
            return
        if self._held_newline:
            text = "\n" + text
            self._held_newline = False
        if text.endswith("\n"):
            text = text[:-1]
            self._held_newline = True
        if text:
            out.append(ToolArgs(self._index, _json_string_body(text)))

    def _end_param(self, out: list[Event]) -> None:
        if self._param is None or self._index is None:
            return
        self._param = None
        if self._stream_string:
            out.append(ToolArgs(self._index, '"'))
            return
        value = "".join(self._value).removesuffix("\n")
        typed = coerce(value, self._types)
        out.append(ToolArgs(self._index, self._prefix + json.dumps(typed, ensure_ascii=False)))
