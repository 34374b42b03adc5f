"""The little a parser needs from a tokenizer, and the startup check built on it."""

from __future__ import annotations

from typing import Protocol


class Vocab(Protocol):
    """Satisfied by ``pdserve.text.tokenizer.Tokenizer`` (and by test fakes)."""

    def token_to_id(self, token: str) -> int | None: ...


def require_single_tokens(vocab: Vocab, parser: str, tags: tuple[str, ...]) -> None:
    """Fail at startup, not on the first request, when the model lacks the parser's markup tokens."""
    missing = [tag for tag in tags if vocab.token_to_id(tag) is None]
    if missing:
        raise ValueError(
            f"parser {parser!r} needs {', '.join(repr(t) for t in missing)} as single tokens, "
            "but the tokenizer's vocabulary has no such token; pick a parser that matches the model "
            "(or drop the parser flag)"
        )
