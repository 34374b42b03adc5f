"""Logprob content encoded for stream chunks, without a struct per candidate.

With ``logprobs=20`` every streamed token carries 21 candidates. Building a decoded entry per
candidate (a method call each, the piece looked up and checked) and encoding its UTF-8 bytes as a
list of ints cost about 70 µs per token in process, more than the rest of the chunk ten times over;
a struct per candidate with its piece and bytes' JSON from two tables still cost 18 µs on random ids
(25 with the caches cold, as they are after an engine step), most of it cache misses on the tables.
Here a candidate is one read of the tokenizer's ``logprob_candidate_formats`` (its JSON, the value
left open) filled with its value, and a token's values are encoded in one call. The bytes are
exactly what msgspec writes for :meth:`LogprobDecoder.chat_content`'s structs and what the
``tokens``-level models dump to (property-tested), so a chunk embeds them as ``msgspec.Raw``.

A piece that ends in U+FFFD (its text is repaired from the preceding sampled ids) is prepared where
it occurs; so is an id past the tokenizer's vocabulary (a padded model vocabulary samples them); a
candidate list not in the engine's shape goes through the decoder's structs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import msgspec

from pdserve.protocol.engine import PositionLogprobs
from pdserve.text.logprobs import LOGPROB_FLOOR, LogprobDecoder, clamp_logprob, distinct_candidates
from pdserve.text.tokenizer import logprob_candidate_format

_encode = msgspec.json.Encoder().encode
_T = TypeVar("_T")


def _sampled_repeat(ids: list[int]) -> int | None:
    """Where the sampled id (first) comes back among the candidates: -1 if it does not, None if
    any id repeats otherwise (the caller then takes the general path).

    The sampled id usually comes back among the top-k; the top-k ids themselves are distinct.
    """
    count = len(set(ids))
    if count == len(ids):
        return -1
    if count == len(ids) - 1 and ids.count(ids[0]) == 2:
        return ids.index(ids[0], 1)
    return None


def _without(values: list[_T], j: int) -> list[_T]:
    return values if j < 0 else values[:j] + values[j + 1 :]


def _encoded_values(logprobs: list[float]) -> list[bytes]:
    """Each value as msgspec writes it, clamped to the floor (NaN too): one encode for the row.

    msgspec writes a NaN or an infinity as ``null``; a row with one, or with a value under the
    floor, is clamped and encoded again. A float's JSON never holds a comma."""
    values = _encode(logprobs)
    if b"null" in values or min(logprobs) < LOGPROB_FLOOR:
        values = _encode([clamp_logprob(v) for v in logprobs])
    return values[1:-1].split(b",")


class ChatLogprobJson:
    """One sequence's chat-shape logprob content as JSON: ``LogprobDecoder.chat_content``, encoded.

    Shares the decoder's repair context, so the two can be used in turn on one sequence.
    """

    def __init__(self, decoder: LogprobDecoder) -> None:
        self._decoder = decoder
        tokenizer = decoder.tokenizer
        self._formats = tokenizer.logprob_candidate_formats
        self._split_ids = tokenizer.split_piece_ids

    def content(
        self, positions: Sequence[PositionLogprobs | None], sampled_ids: Sequence[int], top_limit: int | None
    ) -> bytes:
        """The JSON array ``chat_content(positions, sampled_ids, top_limit)`` encodes to."""
        entries: list[bytes] = []
        for position, sampled_id in zip(positions, sampled_ids):
            entry = self._entry(position, sampled_id, top_limit)
            if entry is None:
                entries.extend(map(_encode, self._decoder.chat_content([position], [sampled_id], top_limit)))
            else:
                self._decoder.remember(sampled_id)
                entries.append(entry)
        return b"[" + b",".join(entries) + b"]"

    def _entry(self, position: PositionLogprobs | None, sampled_id: int, top_limit: int | None) -> bytes | None:
        if position is None or not position.token_ids or position.token_ids[0] != sampled_id:
            return None
        j = _sampled_repeat(position.token_ids)
        if j is None:
            return None
        ids = _without(position.token_ids, j)
        values = _encoded_values(_without(position.logprobs, j))
        if top_limit is not None:
            ids = ids[:top_limit]
        formats = self._formats
        if self._split_ids.isdisjoint(position.token_ids) and max(position.token_ids) < len(formats):
            # Every candidate's piece is in the table (the usual case): a plain subscript, as a call to
            # _format per candidate is a measurable share of this loop.
            tops = [formats[t] % v for t, v in zip(ids, values)]
            head = formats[sampled_id] % values[0]
        else:
            tops = [self._format(t) % v for t, v in zip(ids, values)]
            head = self._format(sampled_id) % values[0]
        return head[:-1] + b',"top_logprobs":[' + b",".join(tops) + b"]}"

    def _format(self, token_id: int) -> bytes:
        """An id's candidate format: from the table, or as repaired here and now for a split character
        (an id outside the vocabulary has none: it decodes to nothing)."""
        if token_id not in self._split_ids and 0 <= token_id < len(self._formats):
            return self._formats[token_id]
        return logprob_candidate_format(self._decoder.token_string(token_id))


class _IdLogprob(msgspec.Struct):
    """A ``tokens``-level candidate, as ``GenerateLogProb`` dumps it (same keys, same order)."""

    token_id: int
    logprob: float
    rank: int | None


class _IdLogprobs(_IdLogprob):
    top_logprobs: list[_IdLogprob]


def generate_content_json(positions: Sequence[PositionLogprobs | None], sampled_ids: Sequence[int]) -> bytes:
    """The ``tokens``-level content (``to_generate_logprobs``) as the JSON array its models dump to:
    plain structs, one encode."""
    entries = []
    for position, sampled_id in zip(positions, sampled_ids):
        if position is None or not position.token_ids:
            entries.append(_IdLogprobs(sampled_id, LOGPROB_FLOOR, None, []))
            continue
        j = _sampled_repeat(position.token_ids)
        if j is None:
            columns = [list(column) for column in zip(*distinct_candidates(position))]
        else:
            columns = [_without(column, j) for column in (position.token_ids, position.logprobs, position.ranks)]
        tops = [
            _IdLogprob(t, max(LOGPROB_FLOOR, v), r or None) for t, v, r in zip(*columns)
        ]
        entries.append(_IdLogprobs(tops[0].token_id, tops[0].logprob, tops[0].rank, tops))
    return _encode(entries)
