"""Incremental search for literal markup tags in streamed text.

The parsers must cost O(new text) per engine step, never a re-scan of the
whole output. ``TagScanner`` keeps only what has not been classified yet: the
new delta plus a held-back suffix that could still grow into a tag (at most
the longest tag minus one character). Which tags count depends on the
caller's state (``>`` ends a function name but is plain text in a value), so
the caller passes the active ``TagSet`` on every call.
"""

from __future__ import annotations

import re


class TagSet:
    """A fixed set of literal tags, compiled once (define instances at module level)."""

    def __init__(self, *tags: str) -> None:
        self.tags = frozenset(tags)
        # Longest first, so the longest tag wins when two start at the same place.
        self._pattern = re.compile("|".join(re.escape(t) for t in sorted(tags, key=len, reverse=True)))
        self._prefixes = frozenset(t[:k] for t in tags for k in range(1, len(t)))
        self._max_prefix = max(len(t) for t in tags) - 1
        self._first_chars = tuple(sorted({t[0] for t in tags}))
        # The one character every tag starts with ("<" for most sets here), None when they differ: one
        # find (or, on the hot path, TagScanner.take_plain, one ``in``) answers may_start.
        self.first = self._first_chars[0] if len(self._first_chars) == 1 else None

    def may_start(self, text: str, pos: int = 0) -> bool:
        """Whether a tag (or a tag's prefix) could start in ``text[pos:]``: a tag's first character is
        there. Most steps' text holds none, and this is checked in C before any regex or slicing."""
        if self.first is not None:
            return text.find(self.first, pos) >= 0
        return any(text.find(first, pos) >= 0 for first in self._first_chars)

    def search(self, text: str, pos: int) -> re.Match[str] | None:
        return self._pattern.search(text, pos)

    def partial_suffix_len(self, text: str, pos: int) -> int:
        """Length of the longest suffix of ``text[pos:]`` that is a proper prefix of a tag."""
        end = len(text)
        if not self.may_start(text, max(pos, end - self._max_prefix)):
            return 0
        for k in range(min(self._max_prefix, end - pos), 0, -1):
            if text[end - k :] in self._prefixes:
                return k
        return 0


class TagScanner:
    """Splits pushed text into (text, tag) pieces against a caller-chosen ``TagSet``.

    ``scanned`` counts characters examined; it grows by the pushed length plus
    a bounded hold-back per push, which is how tests assert the O(delta) cost.
    """

    def __init__(self) -> None:
        self._buf = ""
        self._pos = 0
        self.scanned = 0

    def push(self, text: str) -> None:
        if self._pos:
            self._buf = self._buf[self._pos :]
            self._pos = 0
        self._buf += text

    def take_plain(self, text: str, tags: TagSet) -> bool:
        """Take ``text`` whole when nothing is buffered and no tag can start in it, so that ``push`` and
        ``next`` would give it back as text with nothing held (most steps): the caller uses it as is.
        False: nothing was taken; push it."""
        first = tags.first
        if self._pos != len(self._buf) or (first in text if first is not None else tags.may_start(text)):
            return False
        self.scanned += len(text)
        return True

    def next(self, tags: TagSet) -> tuple[str, str | None]:
        """Text up to the next tag, and the tag.

        When no complete tag is left, returns ``(text, None)`` where text stops
        before a suffix that may be the start of a tag; that suffix stays
        buffered until more text is pushed or ``drain`` is called.
        """
        start = self._pos
        buf = self._buf
        if not tags.may_start(buf, start):
            # No tag can start in what is left (most steps): all of it is text, nothing is held.
            self.scanned += len(buf) - start
            self._pos = len(buf)
            return buf[start:], None
        match = tags.search(buf, start)
        if match is not None:
            self.scanned += match.end() - start
            self._pos = match.end()
            return buf[start : match.start()], match.group()
        end = len(buf)
        hold = tags.partial_suffix_len(buf, start)
        self.scanned += end - start + hold
        self._pos = end - hold
        return buf[start : self._pos], None

    def drain(self) -> str:
        """Everything still buffered (at end of output a partial tag is plain text)."""
        rest = self._buf[self._pos :]
        self._buf = ""
        self._pos = 0
        return rest
