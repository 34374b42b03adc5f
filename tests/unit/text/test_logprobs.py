"""Logprob conversion: tokens shape keeps ids and all candidates; decoded shapes repair byte pieces."""

from __future__ import annotations

import math

from pdserve.protocol.engine import PositionLogprobs
from pdserve.text.logprobs import (
    LogprobDecoder,
    chat_top_limit,
    completion_logprobs,
    prompt_logprob_dicts,
    to_generate_logprobs,
)
from pdserve.text.tokenizer import Tokenizer

TOK = Tokenizer.load("qwen3")


def pos(ids: list[int], lps: list[float], ranks: list[int] | None = None) -> PositionLogprobs:
    return PositionLogprobs(ids, lps, ranks or list(range(1, len(ids) + 1)))


def test_tokens_shape_clamps_and_dedups() -> None:
    [entry] = to_generate_logprobs([pos([5, 5, 7], [-math.inf, -math.inf, float("nan")], [3, 1, 2])], [5])
    assert entry.token_id == 5 and entry.logprob == -9999.0 and entry.rank == 3
    assert [t.token_id for t in entry.top_logprobs] == [5, 7]
    assert entry.top_logprobs[1].logprob == -9999.0


def test_split_emoji_pieces_are_repaired_with_context() -> None:
    ids = TOK.encode(" 🎉ok")
    dec = LogprobDecoder(TOK)
    content = dec.chat_content([pos([i], [-0.1]) for i in ids], ids, None)
    tokens = [c.token for c in content]
    assert "".join(tokens) == " 🎉ok"
    assert all("\ufffd" not in t for t in tokens)
    for c in content:
        assert c.bytes == list(c.token.encode())


def test_context_carries_across_calls() -> None:
    ids = TOK.encode("🫠")
    assert len(ids) == 3
    dec = LogprobDecoder(TOK)
    first = dec.chat_content([pos([ids[0]], [-1.0])], ids[:1], None)
    rest = dec.chat_content([pos([i], [-1.0]) for i in ids[1:]], ids[1:], None)
    assert "".join(c.token for c in first + rest) == "🫠"


def test_chat_cut_counts_sampled_first() -> None:
    dec = LogprobDecoder(TOK)
    [c] = dec.chat_content([pos([10, 11, 12, 13], [-3.0, -1.0, -2.0, -4.0], [3, 1, 2, 4])], [10], chat_top_limit(2))
    assert [t.token for t in c.top_logprobs] == [TOK.token_strings[10], TOK.token_strings[11]]
    assert chat_top_limit(None) is None and chat_top_limit(0) == 0


def test_sampled_missing_gets_floor_entry() -> None:
    [c] = LogprobDecoder(TOK).chat_content([pos([11], [-1.0])], [10], None)
    assert c.logprob == -9999.0 and c.top_logprobs == []


def test_completion_shape_offsets() -> None:
    ids = TOK.encode("a bc")
    content = LogprobDecoder(TOK).chat_content([pos([i, 0], [-0.5, -2.0]) for i in ids], ids, None)
    comp = completion_logprobs(content, text_offset=10)
    assert comp.tokens == ["a", " bc"] and comp.text_offset == [10, 11]
    assert comp.top_logprobs[0] == {"a": -0.5, "!": -2.0}


def test_prompt_logprobs_first_is_none() -> None:
    out = prompt_logprob_dicts(TOK, [None, pos([9707, 3], [-0.2, -3.0], [1, 2])])
    assert out[0] is None and out[1][9707].decoded_token == "Hello" and out[1][3].rank == 2


def test_missing_position_gets_floor() -> None:
    [entry] = to_generate_logprobs([None], [42])
    assert entry.token_id == 42 and entry.logprob == -9999.0 and entry.top_logprobs == []


def test_an_id_outside_the_vocabulary_in_the_repair_context_decodes_to_nothing() -> None:
    """A model with a padded vocabulary can sample an id the tokenizer lacks; a split character after
    it is still repaired from the ids before (it used to raise IndexError: a 500)."""
    ids = TOK.encode("🦩")
    assert len(ids) == 2
    padded = TOK.vocab_size + 5
    dec = LogprobDecoder(TOK, [ids[0], padded])
    [entry] = dec.chat_content([pos([ids[1]], [-0.1])], [ids[1]], None)
    assert entry.token and "\ufffd" not in entry.token
    assert LogprobDecoder(TOK, [padded]).token_string(padded) == ""
