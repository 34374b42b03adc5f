"""Logprob conversion: engine ids -> the generate ``tokens`` shape or decoded OpenAI shapes.

Decoded strings come from the tokenizer's per-id table; only a piece that ends
in U+FFFD (one byte of a character split across tokens) is re-decoded with the
preceding sampled ids as context, as vLLM does.

Decoded entries are msgspec structs (:class:`TokenLogprobs`), not pydantic models: with ``logprobs=20`` a
streamed token carries 21 of them, and building 21 validated models per token cost about 200 µs in process.
They dump to exactly the keys of ``ChatCompletionLogProbsContent`` (msgspec encodes them as they are), and
the OpenAI models read them by attribute where a response is built through pydantic.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from pdserve.protocol.engine import PositionLogprobs
from pdserve.protocol.generate import GenerateLogProb, GenerateLogProbsContent, PromptLogprob
from pdserve.protocol.openai import ChatCompletionLogProbsContent, CompletionLogProbs
from pdserve.text.byte_stream import REPLACEMENT_CHAR
from pdserve.text.tokenizer import Tokenizer

LOGPROB_FLOOR = -9999.0
REPAIR_CONTEXT = 4


class TokenLogprob(msgspec.Struct):
    """One candidate, as ``ChatCompletionLogProb`` dumps it (same keys, same order)."""

    token: str
    logprob: float = LOGPROB_FLOOR
    bytes: list[int] | None = None


class TokenLogprobs(TokenLogprob):
    """One output token with its candidates, as ``ChatCompletionLogProbsContent`` dumps it."""

    top_logprobs: list[TokenLogprob] = []


def clamp_logprob(value: float) -> float:
    """The floor for anything below it, and for NaN (which compares false: one comparison, per candidate)."""
    return max(LOGPROB_FLOOR, value)  # a NaN becomes the floor, as before


def distinct_candidates(position: PositionLogprobs) -> list[tuple[int, float, int]]:
    """(id, logprob, rank) in engine order, sampled first, each id once."""
    seen: set[int] = set()
    out = []
    for token_id, logprob, rank in zip(position.token_ids, position.logprobs, position.ranks):
        if token_id not in seen:
            seen.add(token_id)
            out.append((token_id, logprob, rank))
    return out


def to_generate_logprobs(
    positions: Sequence[PositionLogprobs | None], sampled_ids: Sequence[int]
) -> list[GenerateLogProbsContent]:
    """The ``tokens`` level: int ids, every engine candidate kept (sampled first).

    A position the engine gave no logprobs for gets the floor value, as vLLM reports it.
    """
    content = []
    for position, sampled_id in zip(positions, sampled_ids):
        if position is None or not position.token_ids:
            content.append(GenerateLogProbsContent(token_id=sampled_id, logprob=LOGPROB_FLOOR))
            continue
        cands = distinct_candidates(position)
        tops = [GenerateLogProb(token_id=t, logprob=clamp_logprob(lp), rank=r or None) for t, lp, r in cands]
        sampled = tops[0]
        content.append(
            GenerateLogProbsContent(
                token_id=sampled.token_id, logprob=sampled.logprob, rank=sampled.rank, top_logprobs=tops
            )
        )
    return content


class LogprobDecoder:
    """Decodes logprob ids of one sequence; keeps the last sampled ids as repair context."""

    def __init__(self, tokenizer: Tokenizer, context: Sequence[int] = ()):
        self._tok = tokenizer
        self.context: list[int] = list(context)[-REPAIR_CONTEXT:]

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tok

    def remember(self, sampled_id: int) -> None:
        """A sampled id joins the repair context (the last few, for a split character that follows)."""
        self.context = (self.context + [sampled_id])[-REPAIR_CONTEXT:]

    def token_string(self, token_id: int) -> str:
        return self.piece(token_id)[0]

    def piece(self, token_id: int) -> tuple[str, list[int]]:
        """The id's string and its UTF-8 bytes: from the tables, re-decoded only for a split character."""
        if not self._tok.in_vocab(token_id):
            return "", []
        piece = self._tok.token_strings[token_id]
        if piece.endswith(REPLACEMENT_CHAR):
            repaired = self._repair(token_id)
            return repaired, list(repaired.encode("utf-8"))
        return piece, self._tok.token_bytes(token_id)

    def _piece_is_split(self, token_id: int) -> bool:
        """The id's piece is part of a character split across ids (an id outside the vocabulary, which
        a model with a padded vocabulary can sample, has no piece: it decodes to nothing)."""
        return token_id in self._tok.split_piece_ids

    def _repair(self, token_id: int) -> str:
        """Decode a byte-fallback piece with up to 4 preceding sampled ids, keep only its own text."""
        for k in range(1, min(REPAIR_CONTEXT, len(self.context)) + 1):
            ctx = self.context[-k:]
            full = self._tok.decode(ctx + [token_id])
            if full.endswith(REPLACEMENT_CHAR):
                continue
            clean = list(ctx)
            while clean and self._piece_is_split(clean[-1]):
                clean.pop()
            prefix = self._tok.decode(clean)
            if full.startswith(prefix):
                return full[len(prefix) :]
            common = 0
            while common < min(len(prefix), len(full)) and prefix[common] == full[common]:
                common += 1
            return full[common:]
        return ""

    def _entry(self, token_id: int, logprob: float) -> TokenLogprob:
        token, token_bytes = self.piece(token_id)
        return TokenLogprob(token, clamp_logprob(logprob), token_bytes)

    def chat_content(
        self, positions: Sequence[PositionLogprobs | None], sampled_ids: Sequence[int], top_limit: int | None
    ) -> list[TokenLogprobs]:
        """OpenAI chat shape; ``top_limit`` cuts the candidate list (sampled counted first)."""
        out = []
        for position, sampled_id in zip(positions, sampled_ids):
            cands = distinct_candidates(position) if position is not None else []
            if not cands or cands[0][0] != sampled_id:
                out.append(TokenLogprobs(self.token_string(sampled_id)))
            else:
                kept = cands if top_limit is None else cands[:top_limit]
                tops = [self._entry(t, lp) for t, lp, _ in kept]
                head = self._entry(sampled_id, cands[0][1])
                out.append(TokenLogprobs(head.token, head.logprob, head.bytes, tops))
            self.remember(sampled_id)
        return out


def chat_top_limit(logprobs: int | None) -> int | None:
    """Chat's cut: the first k candidates (sampled first); None keeps all (-1 = whole vocab)."""
    if logprobs is None or logprobs < 0:
        return None
    return logprobs


def completion_top_limit(logprobs: int | None) -> int | None:
    """Completions' cut: ``logprobs`` counts alternatives besides the sampled token, so k + 1 are kept."""
    return None if logprobs is None else logprobs + 1


def completion_logprobs(
    content: Sequence[TokenLogprobs | ChatCompletionLogProbsContent], text_offset: int = 0
) -> CompletionLogProbs:
    """Completions shape from decoded chat-shape entries (running ``text_offset``): this frontend's own
    structs, or a relayed response's entries validated into the OpenAI model (proxy.relay)."""
    result = CompletionLogProbs()
    for entry in content:
        result.tokens.append(entry.token)
        result.token_logprobs.append(entry.logprob)
        result.top_logprobs.append({t.token: t.logprob for t in entry.top_logprobs} if entry.top_logprobs else None)
        result.text_offset.append(text_offset)
        text_offset += len(entry.token)
    return result


def prompt_logprob_dicts(
    tokenizer: Tokenizer | None, positions: Sequence[PositionLogprobs | None]
) -> list[dict[int, PromptLogprob] | None]:
    out: list[dict[int, PromptLogprob] | None] = []
    for position in positions:
        if position is None:
            out.append(None)
            continue
        out.append(
            {
                t: PromptLogprob(
                    logprob=clamp_logprob(lp),
                    rank=r or None,
                    decoded_token=tokenizer.token_strings[t] if tokenizer and tokenizer.in_vocab(t) else None,
                )
                for t, lp, r in distinct_candidates(position)
            }
        )
    return out
