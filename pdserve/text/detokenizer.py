"""Incremental detokenization with stop strings, keeping token ids aligned with text.

One instance per output sequence. Each engine step costs work proportional to
its new tokens: ``tokenizers.decoders.DecodeStream`` does the byte-level
bookkeeping, stop strings are searched only in the region the new text can
complete, and the hold-back is the ``max(len(stop)) - 1`` characters that a
stop string could still claim.

Token ids are released together with the text they produced (a token whose
text is still held back for stop matching stays held too), so a parser fed
``(delta_text, delta_ids)`` never sees an id whose text it has not seen
(vLLM #36830 / #51641).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.text.byte_stream import REPLACEMENT_CHAR
from pdserve.text.tokenizer import Tokenizer

# How many prompt ids prime the stream: enough for any multi-byte character.
_PRIME_IDS = 16


@dataclass(frozen=True, slots=True)
class StopConfig:
    """How a sequence ends: stop strings (matched here) and the stop token ids (matched by the engine)."""

    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    # The model's EOS ids, primary first: the engine reports the primary one with a null stop_reason.
    eos_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def hold_back(self) -> int:
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1

    def stop_token_end(
        self, finish_reason: str | None, stop_reason: int | str | None, new_ids: Sequence[int]
    ) -> tuple[bool, int | str | None]:
        """Whether the last of ``new_ids`` ended the sequence as a stop token, and the stop_reason to report.

        ``finish_reason == "stop"`` alone does not say that the last id is a stop token: a response
        that comes over the wire (derender) may have stopped on a stop string or elsewhere. As in
        vLLM, the last id counts only if it equals an integer ``stop_reason``, or — with a null one —
        is one of the request's ``stop_token_ids`` or (unless ``ignore_eos``) one of the model's EOS
        ids; the null stop_reason then becomes that id, except for the primary EOS.
        """
        if finish_reason != "stop" or isinstance(stop_reason, str) or not new_ids:
            return False, stop_reason
        last = new_ids[-1]
        if stop_reason is not None:
            return last == stop_reason, stop_reason
        honor_eos = not self.ignore_eos and bool(self.eos_token_ids)
        if honor_eos and last == self.eos_token_ids[0]:
            return True, None
        if last in self.stop_token_ids or (honor_eos and last in self.eos_token_ids):
            return True, last
        return False, None


@dataclass(slots=True)
class Released:
    """What one update releases to the client."""

    text: str
    num_ids: int  # how many more output ids (in order) are now released with that text


def find_stop_string(
    text: str, new_chars: int, stops: Sequence[str], include: bool, floor: int = 0
) -> tuple[str, int] | None:
    """Find the stop string that ends earliest among matches touching the last ``new_chars`` chars.

    Matches must start at or after ``floor`` (text before it came from the first
    ``min_tokens`` tokens). Returns ``(stop, cut)``: ``text[:cut]`` is the text to keep.
    """
    if new_chars <= 0 or not stops:
        return None
    best: tuple[int, int, str] | None = None  # (end, order, stop)
    for order, stop in enumerate(stops):
        start = max(floor, len(text) - new_chars - len(stop) + 1)
        pos = text.find(stop, start)
        if pos < 0:
            continue
        end = pos + len(stop)
        if best is None or end < best[0]:
            best = (end, order, stop)
    if best is None:
        return None
    end, _, stop = best
    return stop, end if include else end - len(stop)


class IncrementalDetokenizer:
    """Turns one sequence's output ids into text, matching stop strings on the way.

    Only the unreleased tail of the text is kept as one string (at most the
    hold-back plus one step's text); released text is kept as a list of pieces,
    so appending never copies the whole output.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: StopConfig = StopConfig(),
    ):
        self._tok = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = stop
        self._context = list(prompt_token_ids[-_PRIME_IDS:])
        self._prime(self._context)  # sets _stream, _swallow and _swallow_ids
        self.output_ids: list[int] = []
        self._released_parts: list[str] = []
        self._released_chars = 0
        self._tail = ""  # text not released yet; starts at offset _released_chars
        # Absolute char offset where each output id's text ends (None while its bytes are incomplete).
        self._token_ends: list[int | None] = []
        self._pending_start = 0  # first id whose end is not known yet
        self._released_ids = 0
        # Text offset where stop strings may start (set once min_tokens ids were produced).
        self._stop_floor: int | None = 0 if stop.min_tokens == 0 else None
        self.stop_string: str | None = None
        # Without stop strings every step's text goes out whole, so a standalone id can skip the decoder.
        self._standalone = None if stop.stop else tokenizer.standalone_pieces

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None

    @property
    def text(self) -> str:
        """All text so far (released and held back); O(length), for batch responses."""
        return "".join(self._released_parts) + self._tail

    @property
    def _length(self) -> int:
        return self._released_chars + len(self._tail)

    def take_standalone(self, token_id: int) -> str | None:
        """The hot path for one id: add and release it at once when its text is its own
        (:attr:`Tokenizer.standalone_pieces`) and nothing is held (no stop strings, no bytes of a
        character pending, no prompt characters owed). Returns its text, or None having done nothing:
        then :meth:`update` and :meth:`release` take the id.

        The decode stream is not stepped: a byte-level stream's next text depends only on ids after
        the last whole character, so skipping ids that end on one leaves its answers unchanged.
        """
        table = self._standalone
        if table is None or self._pending_start != len(self.output_ids) or self._swallow_ids or self._tail:
            return None
        piece = table[token_id] if 0 <= token_id < len(table) else None
        if piece is None:
            return None
        self._tok.decoded_ids += 1
        self.output_ids.append(token_id)
        self._released_chars += len(piece)
        self._token_ends.append(self._released_chars)
        self._released_parts.append(piece)
        self._pending_start = self._released_ids = len(self.output_ids)
        return piece

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip_special)

    def _prime(self, context: Sequence[int]) -> None:
        """Start a fresh decode stream after ``context``: ids whose text is not output text.

        A DecodeStream primed with ids whose text ends in an incomplete character (U+FFFD) repeats
        that text on its next step, so the prompt would leak into the output. The stream is primed
        with the context up to its last complete character instead; the incomplete tail is fed as
        steps, and the characters the context's own decode gives it (``_swallow``) are dropped from
        the text that completes them. Output text is then ``decode(context + out)[len(decode(context)):]``.
        """
        context = list(context[-_PRIME_IDS:])
        text = clean_text = self._decode(context)
        clean = len(context)
        while clean and clean_text.endswith(REPLACEMENT_CHAR):
            clean -= 1
            clean_text = self._decode(context[:clean])
        self._stream = self._tok.decode_stream(context[:clean], self._skip_special)
        for token_id in context[clean:]:
            self._tok.stream_step(self._stream, token_id)  # incomplete bytes: no text yet
        # Characters the next decoded text still owes to the context, and the context ids holding them.
        self._swallow = len(text) - len(clean_text)
        self._swallow_ids = context[clean:]

    def _take(self, piece: str | None) -> str | None:
        """``piece`` without the characters still owed to the context (None: no complete text yet)."""
        if not piece or not self._swallow:
            return piece
        cut = min(self._swallow, len(piece))
        self._swallow -= cut
        if not self._swallow:
            self._swallow_ids = []
        return piece[cut:]

    def _decode_one(self, token_id: int) -> str | None:
        """The text this id completes; None while its character is incomplete."""
        try:
            return self._take(self._tok.stream_step(self._stream, token_id))
        except Exception:
            # DecodeStream refuses some prefixes (vLLM resets on "Invalid prefix"): restart it after
            # the ids whose text is out, and decode the pending ones (this one included) again.
            self._prime(self._context + self.output_ids[: self._pending_start])
            pieces = [self._take(self._tok.stream_step(self._stream, t)) for t in self.output_ids[self._pending_start :]]
            done = [p for p in pieces if p is not None]
            return "".join(done) if done else None

    def _append_text(self, piece: str) -> None:
        self._tail += piece
        end = self._length
        for i in range(self._pending_start, len(self._token_ends)):
            self._token_ends[i] = end
        self._pending_start = len(self._token_ends)

    def update(self, new_ids: Sequence[int], stop_terminated: bool) -> None:
        """Add one engine step's ids.

        ``stop_terminated``: the engine finished this sequence on a stop token / EOS, whose
        text is left out unless ``include_stop_str_in_output``.
        """
        if self.stopped:
            return
        last = len(new_ids) - 1
        for i, token_id in enumerate(new_ids):
            self.output_ids.append(token_id)
            self._token_ends.append(None)
            if i == last and stop_terminated and not self._stop.include_stop_str_in_output:
                self._token_ends[-1] = self._length
                self._pending_start = len(self._token_ends)
                continue
            before = self._length
            piece = self._decode_one(token_id)
            if piece is not None:  # "" when the text it completes was the prompt's
                self._append_text(piece)
            if self._stop_floor is None and len(self.output_ids) >= self._stop.min_tokens:
                # Stop strings only count in text produced after the first min_tokens tokens.
                self._stop_floor = self._length
            if self._stop.stop and self._stop_floor is not None and self._match_stop(before):
                return

    def _match_stop(self, before: int) -> bool:
        base = self._released_chars
        new_chars = self._length - max(before, self._stop_floor or 0)
        floor = max(0, (self._stop_floor or 0) - base)
        match = find_stop_string(self._tail, new_chars, self._stop.stop, self._stop.include_stop_str_in_output, floor)
        if match is None:
            return False
        self.stop_string, cut = match
        self._tail = self._tail[:cut]
        cut_abs = base + cut
        # The id that completed the stop string is the last one kept; ids of the cut text end at the cut.
        self._token_ends = [cut_abs if e is None or e > cut_abs else e for e in self._token_ends]
        self._pending_start = len(self._token_ends)
        return True

    def finish(self) -> None:
        """Flush bytes of an incomplete character at the end (they decode to U+FFFD)."""
        if self.stopped or self._pending_start >= len(self.output_ids):
            return
        pending = [
            tid
            for tid, end in zip(self.output_ids[self._pending_start :], self._token_ends[self._pending_start :])
            if end is None
        ]
        if pending:
            self._append_text(self._take(self._decode(self._swallow_ids + pending)) or "")
        self._pending_start = len(self._token_ends)

    def release(self, finished: bool) -> Released:
        """Text and ids that may go to the client now (everything when finished or stopped)."""
        if finished or self.stopped:
            keep = 0
            ids_upto = len(self.output_ids)
        else:
            keep = min(len(self._tail), self._stop.hold_back)
            limit = self._length - keep
            ids_upto = self._released_ids
            while ids_upto < self._pending_start:
                end = self._token_ends[ids_upto]
                if end is None or end > limit:
                    break
                ids_upto += 1
        text = self._tail[: len(self._tail) - keep]
        if text:
            self._released_parts.append(text)
            self._released_chars += len(text)
            self._tail = self._tail[len(self._tail) - keep :]
        released = Released(text=text, num_ids=ids_upto - self._released_ids)
        self._released_ids = ids_upto
        return released
