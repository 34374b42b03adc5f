"""Single-pass, incremental scanner for one JSON value, with a closable prefix.

Hermes tool calls stream the model's own argument JSON. To keep that O(delta)
and still end every call with valid JSON (even when the output is cut at
``max_tokens``), the scanner tracks the longest consumed prefix that can be
closed by *appending* only: right after ``{``/``[``, after any complete
value, or inside a string value (never inside a key, a number, a literal or
an escape). Emitted text therefore never has to be taken back, and
``closer()`` is the suffix that completes it. Between two such points the
container stack cannot change (opening or closing a container is itself such
a point), so the current stack is the stack of the last point.
"""

from __future__ import annotations

import re
from enum import Enum, auto

_WHITESPACE = " \t\n\r"
_STRING_RUN = re.compile(r'[^"\\]+')
_CONTROL = re.compile(r"[\x00-\x1f]")
_SCALAR_RUN = re.compile(r"[0-9A-Za-z.+\-]+")
_SCALAR = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false|null")
_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")
_SIMPLE_ESCAPES = frozenset('"\\/bfnrt')


def _escape_control(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


class _ScanPhase(Enum):
    VALUE = auto()  # a value must start here
    ARRAY_FIRST = auto()  # after '[': a value or ']'
    OBJECT_FIRST = auto()  # after '{': a key or '}'
    OBJECT_KEY = auto()  # after ',' in an object: a key
    COLON = auto()
    AFTER = auto()  # after a value inside a container: ',' or the closer
    STRING = auto()
    ESCAPE = auto()
    UNICODE = auto()
    SCALAR = auto()  # number or literal; ends at the first other character
    DONE = auto()
    BROKEN = auto()


class JsonValueScanner:
    """Consumes the text of exactly one JSON value, chunk by chunk, each character once."""

    def __init__(self) -> None:
        self._state = _ScanPhase.VALUE
        self._closers: list[str] = []
        self._in_key = False
        self._scalar: list[str] = []
        self._hex = ""
        self._high_surrogate = False
        self._pieces: list[str] = []  # consumed, not yet taken
        self._safe = 0  # self._pieces[: self._safe] is closable
        self._safe_in_string = False

    @property
    def done(self) -> bool:
        return self._state is _ScanPhase.DONE

    @property
    def broken(self) -> bool:
        return self._state is _ScanPhase.BROKEN

    def feed(self, text: str, pos: int = 0) -> int:
        """Consume ``text[pos:]`` until the value completes or turns out invalid.

        Returns where it stopped: ``len(text)``, or the first character after
        the value (a number ends only when a non-number character arrives,
        which is not consumed), or the offending character.
        """
        end = len(text)
        while pos < end and self._state is not _ScanPhase.DONE and self._state is not _ScanPhase.BROKEN:
            pos = self._step(text, pos)
        return pos

    def finish(self) -> None:
        """End of input: a trailing number or literal is complete if it is valid."""
        if self._state is _ScanPhase.SCALAR:
            self._end_scalar()

    def text(self) -> str:
        """All consumed text not yet taken (for values read whole, like a name or a key)."""
        return "".join(self._pieces)

    def take(self) -> str:
        """The closable prefix consumed since the last take (may be empty)."""
        if not self._safe:
            return ""
        taken = "".join(self._pieces[: self._safe])
        del self._pieces[: self._safe]
        self._safe = 0
        return taken

    def closer(self) -> str:
        """What completes everything taken so far into valid JSON ("" once done)."""
        quote = '"' if self._safe_in_string else ""
        return quote + "".join(reversed(self._closers))

    # ------------------------------------------------------------ internals

    def _step(self, text: str, pos: int) -> int:
        state = self._state
        if state is _ScanPhase.STRING:
            return self._string(text, pos)
        if state is _ScanPhase.ESCAPE:
            return self._escape(text, pos)
        if state is _ScanPhase.UNICODE:
            return self._unicode(text, pos)
        if state is _ScanPhase.SCALAR:
            run = _SCALAR_RUN.match(text, pos)
            if run is None:
                self._end_scalar()
                return pos
            self._scalar.append(run.group())
            self._pieces.append(run.group())
            return run.end()
        char = text[pos]
        if char in _WHITESPACE:
            self._pieces.append(char)
            return pos + 1
        if state is _ScanPhase.VALUE or state is _ScanPhase.ARRAY_FIRST:
            if char == "]" and state is _ScanPhase.ARRAY_FIRST:
                self._close(char)
            elif char in "{[":
                self._closers.append("}" if char == "{" else "]")
                self._state = _ScanPhase.OBJECT_FIRST if char == "{" else _ScanPhase.ARRAY_FIRST
                self._pieces.append(char)
                self._mark_safe(in_string=False)
            elif char == '"':
                self._open_string(key=False)
            elif char == "-" or (char.isascii() and char.isalnum()):
                self._state = _ScanPhase.SCALAR
                return pos
            else:
                self._state = _ScanPhase.BROKEN
                return pos
        elif state is _ScanPhase.OBJECT_FIRST or state is _ScanPhase.OBJECT_KEY:
            if char == '"':
                self._open_string(key=True)
            elif char == "}" and state is _ScanPhase.OBJECT_FIRST:
                self._close(char)
            else:
                self._state = _ScanPhase.BROKEN
                return pos
        elif state is _ScanPhase.COLON:
            if char != ":":
                self._state = _ScanPhase.BROKEN
                return pos
            self._pieces.append(char)
            self._state = _ScanPhase.VALUE
        elif state is _ScanPhase.AFTER:
            if char == ",":
                self._pieces.append(char)
                self._state = _ScanPhase.OBJECT_KEY if self._closers[-1] == "}" else _ScanPhase.VALUE
            elif char == self._closers[-1]:
                self._close(char)
            else:
                self._state = _ScanPhase.BROKEN
                return pos
        return pos + 1

    def _open_string(self, key: bool) -> None:
        self._in_key = key
        self._state = _ScanPhase.STRING
        self._pieces.append('"')
        if not key:
            self._mark_safe(in_string=True)

    def _string(self, text: str, pos: int) -> int:
        char = text[pos]
        if self._high_surrogate and char != "\\":
            self._state = _ScanPhase.BROKEN  # a high surrogate escape must be followed by a low one
            return pos
        run = _STRING_RUN.match(text, pos)
        if run is not None:
            # Models sometimes put raw newlines/tabs in strings; strict JSON clients reject them.
            self._pieces.append(_CONTROL.sub(_escape_control, run.group()))
            if not self._in_key:
                self._mark_safe(in_string=True)
            return run.end()
        self._pieces.append(char)
        if char == "\\":
            self._state = _ScanPhase.ESCAPE
        elif self._in_key:
            self._in_key = False
            self._state = _ScanPhase.COLON
        else:
            self._value_done()
        return pos + 1

    def _escape(self, text: str, pos: int) -> int:
        char = text[pos]
        if char == "u":
            self._hex = ""
            self._state = _ScanPhase.UNICODE
        elif char in _SIMPLE_ESCAPES and not self._high_surrogate:
            self._state = _ScanPhase.STRING
        else:
            self._state = _ScanPhase.BROKEN
            return pos
        self._pieces.append(char)
        if self._state is _ScanPhase.STRING and not self._in_key:
            self._mark_safe(in_string=True)
        return pos + 1

    def _unicode(self, text: str, pos: int) -> int:
        char = text[pos]
        if char not in _HEX_DIGITS:
            self._state = _ScanPhase.BROKEN
            return pos
        self._pieces.append(char)
        self._hex += char
        if len(self._hex) == 4:
            code = int(self._hex, 16)
            is_high = 0xD800 <= code <= 0xDBFF
            is_low = 0xDC00 <= code <= 0xDFFF
            # A high surrogate needs a low one right after it; a low one needs a high one before it.
            if is_low != self._high_surrogate:
                self._state = _ScanPhase.BROKEN
                return pos
            self._high_surrogate = is_high
            self._state = _ScanPhase.STRING
            if not is_high and not self._in_key:
                self._mark_safe(in_string=True)
        return pos + 1

    def _end_scalar(self) -> None:
        if _SCALAR.fullmatch("".join(self._scalar)):
            self._scalar.clear()
            self._value_done()
        else:
            self._state = _ScanPhase.BROKEN

    def _close(self, char: str) -> None:
        self._closers.pop()
        self._pieces.append(char)
        self._value_done()

    def _value_done(self) -> None:
        self._state = _ScanPhase.AFTER if self._closers else _ScanPhase.DONE
        self._mark_safe(in_string=False)

    def _mark_safe(self, in_string: bool) -> None:
        self._safe = len(self._pieces)
        self._safe_in_string = in_string
