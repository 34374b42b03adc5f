"""``tokenizers``' ``DecodeStream`` for a byte-level tokenizer, with the decode done on bytes in Python.

``DecodeStream.step`` decodes its whole window of ids again on every step, and the window only moves on
once the text stops ending in U+FFFD. A run of ids that never forms a character (a small or random model
repeating a lone UTF-8 continuation byte, say) therefore costs a decode of the whole run per id: 25 µs
an id after 256 of them in the Rust decoder, reached through Python, and growing. A byte-level
decoder (GPT-2 style: Qwen3, SmolLM2, Llama 3) maps each id to fixed bytes, so the same decode is a
join of those bytes and one UTF-8 decode with replacement, both in C: well under a microsecond for
such a window.

:class:`ByteLevelStream` takes ``DecodeStream``'s place step for step: the same algorithm (window, prefix,
prefix index, the priming a stream made with ``ids`` does on its first step, the "invalid prefix"
error), over the same decode, so every step returns what ``DecodeStream`` returns
(tests/unit/text/test_byte_stream.py checks it against ``DecodeStream`` on drawn sequences).
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence

REPLACEMENT_CHAR = "\ufffd"


def byte_level_alphabet() -> dict[str, int]:
    """The byte-level alphabet: the character standing for each byte in a byte-level token's string.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes take the characters from U+0100 on,
    in byte order (GPT-2's convention, which every byte-level tokenizer shares)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet: dict[str, int] = {chr(b): b for b in printable}
    others = [b for b in range(256) if chr(b) not in alphabet]
    alphabet.update({chr(256 + n): b for n, b in enumerate(others)})
    return alphabet


class InvalidPrefix(ValueError):
    """The window's text no longer starts with the text already returned (``DecodeStream``'s error)."""


class ByteLevelStream:
    """One sequence's incremental decoder; ``step`` as ``DecodeStream.step`` (the tokenizer argument is
    accepted and unused: ``id_bytes`` already holds what the decode needs).

    ``id_bytes(id)``: the id's bytes as the byte-level decoder gives them, or None for an id the decode
    leaves out (unknown ids; special ones when ``skip_special_tokens``). The window's text is kept
    decoded up to its last character that more bytes could still complete (Python's incremental UTF-8
    decoder), so a step decodes only its own bytes, however long the window has grown."""

    __slots__ = ("_id_bytes", "_window", "_sizes", "_decoder", "_decoded", "_prefix", "_prefix_size",
                 "_prefix_index")

    def __init__(self, id_bytes: Callable[[int], bytes | None], ids: Sequence[int] = ()) -> None:
        self._id_bytes = id_bytes
        self._window = bytearray()  # the window's ids' bytes, joined
        self._sizes: list[int] = []  # each window id's share of them
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._decoded = ""  # the window's text but for the bytes the decoder holds (an unfinished character)
        self._prefix = ""
        self._prefix_size = 0  # the prefix's UTF-8 length
        self._prefix_index = 0
        for token_id in ids:
            self._push(token_id)

    def _push(self, token_id: int) -> None:
        piece = self._id_bytes(token_id) or b""
        self._window += piece
        self._sizes.append(len(piece))
        self._decoded += self._decoder.decode(piece)

    def _text(self) -> str:
        """The window's text, as one lossy decode of its bytes gives it."""
        held = self._decoder.getstate()[0]
        return self._decoded + held.decode("utf-8", "replace") if held else self._decoded

    def _set_prefix(self, prefix: str, index: int) -> None:
        self._prefix, self._prefix_size, self._prefix_index = prefix, len(prefix.encode()), index

    def step(self, _tokenizer: object, token_id: int) -> str | None:
        sizes = self._sizes
        if not self._prefix and sizes:  # a stream made with ids: they become the prefix once whole
            primed = self._text()
            if not primed.endswith(REPLACEMENT_CHAR):
                self._set_prefix(primed, len(sizes))
        self._push(token_id)
        text = self._text()
        prefix = self._prefix
        # DecodeStream compares UTF-8 lengths.
        if text.endswith(REPLACEMENT_CHAR) or len(text.encode()) <= self._prefix_size:
            return None
        if not text.startswith(prefix):
            raise InvalidPrefix("Invalid prefix encountered")
        drop = self._prefix_index
        new_prefix_index = len(sizes) - drop
        del self._window[: sum(sizes[:drop])]
        del sizes[:drop]
        self._decoder.reset()
        self._decoded = self._decoder.decode(self._window)
        self._set_prefix(self._text(), new_prefix_index)
        return text[len(prefix):]
