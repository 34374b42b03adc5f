"""Logprob content encoded for stream chunks, without a struct's list of byte values per candidate.

With ``logprobs=20`` every streamed token carries 21 candidates. Building a decoded entry per
candidate (a method call each, the piece looked up and checked) and encoding its UTF-8 bytes as a
list of ints cost about 70 µs per token in process, more than the rest of the chunk ten times over.
Here each id's piece and its bytes' JSON come from the tokenizer's startup tables
(``token_strings``, ``token_bytes_json``), a candidate is a three-field struct built in a
comprehension, and a chunk's content is one encode. The bytes are exactly what msgspec writes for
:meth:`LogprobDecoder.chat_content`'s structs and what the ``tokens``-level models dump to
(property-tested), so a chunk embeds them as ``msgspec.Raw``.

A piece that ends in U+FFFD (its text is repaired from the preceding sampled ids) is prepared where
it occurs; so is an id past the tokenizer's vocabulary (a padded model vocabulary samples them); a
candidate list not in the engine's shape goes through the decoder's structs.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from pdserve.protocol.engine import PositionLogprobs
from pdserve.text.logprobs import LOGPROB_FLOOR, LogprobDecoder, TokenLogprobs, clamp_logprob, distinct_candidates

_encode = msgspec.json.Encoder().encode


class _Candidate(msgspec.Struct):
    """A chat-shape candidate as :class:`~pdserve.text.logprobs.TokenLogprob` encodes, its bytes' JSON ready."""

    token: str
    logprob: float
    bytes: msgspec.Raw


class _Entry(_Candidate):
    top_logprobs: list[_Candidate]


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


def _without(values: list, j: int) -> list:
    return values if j < 0 else values[:j] + values[j + 1 :]


class ChatLogprobJson:
    """One sequence's chat-shape logprob content as JSON: ``LogprobDecoder.chat_content``, encoded.

    Shares the decoder's repair context, so the two can be used in turn on one sequence.
    """

    def __init__(self, decoder: LogprobDecoder) -> None:
        self._decoder = decoder
        tokenizer = decoder.tokenizer
        self._strings = tokenizer.token_strings
        self._raws = tokenizer.token_bytes_json
        self._split_ids = tokenizer.split_piece_ids

    def content(
        self, positions: Sequence[PositionLogprobs | None], sampled_ids: Sequence[int], top_limit: int | None
    ) -> bytes:
        """The JSON array ``chat_content(positions, sampled_ids, top_limit)`` encodes to."""
        entries: list[_Entry | TokenLogprobs] = []
        for position, sampled_id in zip(positions, sampled_ids):
            entry = self._entry(position, sampled_id, top_limit)
            if entry is None:
                entries.extend(self._decoder.chat_content([position], [sampled_id], top_limit))
            else:
                self._decoder.remember(sampled_id)
                entries.append(entry)
        return _encode(entries)

    def _entry(self, position: PositionLogprobs | None, sampled_id: int, top_limit: int | None) -> _Entry | None:
        if position is None or not position.token_ids or position.token_ids[0] != sampled_id:
            return None
        j = _sampled_repeat(position.token_ids)
        if j is None:
            return None
        ids, logprobs = _without(position.token_ids, j), _without(position.logprobs, j)
        head_logprob = clamp_logprob(logprobs[0])
        if top_limit is not None:
            ids = ids[:top_limit]
        strings, raws = self._strings, self._raws
        if self._split_ids.isdisjoint(position.token_ids) and max(position.token_ids) < len(strings):
            # Every candidate's piece is in the tables (the usual case); clamp_logprob inlined: a call
            # per candidate is a measurable share of this loop.
            tops = [
                _Candidate(strings[t], v if v >= LOGPROB_FLOOR else LOGPROB_FLOOR, raws[t])
                for t, v in zip(ids, logprobs)
            ]
            return _Entry(strings[sampled_id], head_logprob, raws[sampled_id], tops)
        tops = []
        for t, v in zip(ids, logprobs):
            piece, piece_raw = self._piece(t)
            tops.append(_Candidate(piece, v if v >= LOGPROB_FLOOR else LOGPROB_FLOOR, piece_raw))
        token, raw = self._piece(sampled_id)
        return _Entry(token, head_logprob, raw, tops)

    def _piece(self, token_id: int) -> tuple[str, msgspec.Raw]:
        """An id's piece and its bytes' JSON: from the tables, or as repaired here and now for a split
        character (an id outside the vocabulary has none: it decodes to nothing)."""
        if token_id not in self._split_ids and 0 <= token_id < len(self._strings):
            return self._strings[token_id], self._raws[token_id]
        piece, raw = self._decoder.piece(token_id)
        return piece, msgspec.Raw(_encode(raw))


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
            _IdLogprob(t, v if v >= LOGPROB_FLOOR else LOGPROB_FLOOR, r or None) for t, v, r in zip(*columns)
        ]
        entries.append(_IdLogprobs(tops[0].token_id, tops[0].logprob, tops[0].rank, tops))
    return _encode(entries)
