"""Incremental detokenizer: chunking invariance, stop strings, id/text alignment."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.text.detokenizer import IncrementalDetokenizer, StopConfig, find_stop_string
from pdserve.text.tokenizer import Tokenizer

TOK = Tokenizer.load("qwen3")
PROMPT = [151644, 77091, 198]


def run(ids: list[int], chunks: list[int], *, skip: bool = False, stop: StopConfig = StopConfig(),
        stop_terminated: bool = False) -> tuple[IncrementalDetokenizer, list[tuple[str, int]]]:
    detok = IncrementalDetokenizer(TOK, PROMPT, skip_special_tokens=skip, stop=stop)
    released = []
    pos = 0
    for size in chunks:
        if pos >= len(ids):
            break
        step = ids[pos : pos + size]
        pos += size
        last = pos >= len(ids)
        detok.update(step, stop_terminated and last)
        finished = last or detok.stopped
        if finished:
            detok.finish()
        r = detok.release(finished)
        released.append((r.text, r.num_ids))
        if detok.stopped:
            break
    return detok, released


token_ids = st.lists(st.integers(min_value=0, max_value=TOK.vocab_size - 1), min_size=1, max_size=60)
chunkings = st.lists(st.integers(min_value=1, max_value=8), min_size=60, max_size=60)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ids=token_ids, chunks=chunkings, skip=st.booleans())
def test_any_chunking_equals_batch_decode(ids: list[int], chunks: list[int], skip: bool) -> None:
    detok, released = run(ids, chunks, skip=skip)
    text = "".join(t for t, _ in released)
    assert text == TOK.decode(ids, skip_special_tokens=skip)
    assert detok.text == text
    assert sum(n for _, n in released) == len(ids)


# Multi-byte heavy ids: characters that take several byte-level tokens.
MULTIBYTE = TOK.encode("🇫🇷👩‍👩‍👧 中文 ｶﾀｶﾅ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 café")


@settings(max_examples=100, deadline=None)
@given(chunks=chunkings)
def test_multibyte_chunking(chunks: list[int]) -> None:
    _, released = run(MULTIBYTE, chunks)
    assert "".join(t for t, _ in released) == TOK.decode(MULTIBYTE)
    assert all("\ufffd" not in t for t, _ in released)


def test_stop_token_text_left_out() -> None:
    ids = TOK.encode("Hi there") + [151645]
    detok, released = run(ids, [1] * len(ids), stop_terminated=True)
    assert detok.text == "Hi there"
    assert sum(n for _, n in released) == len(ids)
    inc = StopConfig(include_stop_str_in_output=True)
    detok, _ = run(ids, [1] * len(ids), stop=inc, stop_terminated=True)
    assert detok.text == "Hi there<|im_end|>"


@pytest.mark.parametrize("size", [1, 2, 3, 100])
def test_stop_string_cut_and_alignment(size: int) -> None:
    ids = TOK.encode("one two three four")
    detok, released = run(ids, [size] * 20, stop=StopConfig(("three",)))
    assert detok.stop_string == "three"
    assert "".join(t for t, _ in released) == "one two "
    # ids kept up to the one completing "three"; trailing ids dropped.
    assert TOK.decode(detok.output_ids) == "one two three"
    assert sum(n for _, n in released) == len(detok.output_ids)


def test_text_never_released_past_hold_back() -> None:
    ids = TOK.encode("abcdefgh STOP tail")
    _, released = run(ids, [1] * len(ids), stop=StopConfig(("STOP",)))
    texts = [t for t, _ in released]
    assert "".join(texts) == "abcdefgh "
    assert all("S" not in t for t in texts)


def test_ids_released_only_with_their_text() -> None:
    """A held-back token's id is held too (vLLM #36830): ids and text stay aligned per release."""
    ids = TOK.encode("alpha beta gamma delta")
    detok, released = run(ids, [1] * len(ids), stop=StopConfig(("zzzzzz",)))
    out, pos = "", 0
    for text, n in released:
        out += text
        pos += n
        assert TOK.decode(ids[:pos]) == out or out.startswith(TOK.decode(ids[:pos]))
        assert out.startswith(TOK.decode(ids[:pos]))


def test_include_stop_str() -> None:
    ids = TOK.encode("one two three. four")
    detok, released = run(ids, [1] * 20, stop=StopConfig(("three",), include_stop_str_in_output=True))
    assert "".join(t for t, _ in released) == "one two three"


def test_min_tokens_blocks_early_stop() -> None:
    ids = TOK.encode("stop here, then stop again")
    n_first = len(TOK.encode("stop here"))
    detok, released = run(ids, [1] * 30, stop=StopConfig(("stop",), min_tokens=n_first))
    assert "".join(t for t, _ in released) == "stop here, then "


def test_earliest_ending_match_wins() -> None:
    assert find_stop_string("xx abcd", 7, ["bcd", "abc"], include=False) == ("abc", 3)
    assert find_stop_string("xx abcd", 7, ["abcd", "cd"], include=True) == ("abcd", 7)
    assert find_stop_string("xx abcd", 2, ["xx"], include=False) is None


# Text whose characters take several byte-level tokens: a random split point often ends the prompt
# in the middle of one (its decode then ends with U+FFFD).
WIDE_TEXT = st.text(
    alphabet=st.sampled_from(list("ab ,.\n") + list("😀👩‍👧🇫🇷✅") + list("ภาษาไทยสวัสดี") + list("中文字符日本語한국어犇猋骉龘靐")),
    min_size=1,
    max_size=40,
)


def streamed_output(prompt: list[int], output: list[int], chunks: list[int], skip: bool = False) -> list[str]:
    """The text deltas a client gets for ``output`` after ``prompt``, fed in ``chunks``."""
    detok = IncrementalDetokenizer(TOK, prompt, skip_special_tokens=skip)
    deltas, pos = [], 0
    for size in chunks:
        step = output[pos : pos + size]
        pos += size
        detok.update(step, False)
        if pos >= len(output):
            detok.finish()
            deltas.append(detok.release(True).text)
            return deltas
        deltas.append(detok.release(False).text)
    detok.finish()
    deltas.append(detok.release(True).text)
    return deltas


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=WIDE_TEXT, split=st.floats(min_value=0, max_value=1), chunks=chunkings, skip=st.booleans())
def test_output_after_any_prompt_split_is_the_rest_of_the_text(
    text: str, split: float, chunks: list[int], skip: bool
) -> None:
    """Deltas concatenate to ``decode(prompt + output)[len(decode(prompt)):]``, wherever the prompt ends
    (mid-character included), and the first delta never repeats the prompt."""
    ids = TOK.encode(text)
    k = round(split * len(ids))
    prompt, output = ids[:k], ids[k:]
    deltas = streamed_output(prompt, output, chunks, skip)
    prompt_text = TOK.decode(prompt, skip_special_tokens=skip)
    assert "".join(deltas) == TOK.decode(ids, skip_special_tokens=skip)[len(prompt_text) :]


@pytest.mark.parametrize("text", ["Hi 😀👩‍👩‍👧 🫠𓀀 end", "Hi สวัสดี 犇猋骉", "Hi 中文 龘靐 日本語"])
def test_every_split_point_keeps_the_prompt_out(text: str) -> None:
    ids = TOK.encode(text)
    assert any(TOK.decode(ids[:k]).endswith("\ufffd") for k in range(len(ids)))  # some split is mid-character
    for k in range(2, len(ids)):
        deltas = streamed_output(ids[:k], ids[k:], [1] * len(ids))
        assert "".join(deltas) == TOK.decode(ids)[len(TOK.decode(ids[:k])) :], k
        assert all("Hi" not in d for d in deltas), k


def test_prompt_char_left_incomplete_by_the_output() -> None:
    """An output that never completes the prompt's last character adds no text for it."""
    char = TOK.encode("𓀀")
    assert len(char) == 3
    assert "".join(streamed_output(TOK.encode("a") + char[:1], char[1:2], [1])) == ""
    assert "".join(streamed_output(TOK.encode("a") + char[:1], char[1:] + TOK.encode("b"), [1] * 3)) == "b"


EOS_IDS = (151645, 151643)


@pytest.mark.parametrize(
    ("stop", "finish", "stop_reason", "ids", "want"),
    [
        # vLLM's rule: a "stop" finish drops the last id only if it is a stop token.
        (StopConfig(eos_token_ids=EOS_IDS), "stop", None, [5, 6], (False, None)),
        (StopConfig(eos_token_ids=EOS_IDS), "stop", None, [5, 151645], (True, None)),
        (StopConfig(eos_token_ids=EOS_IDS), "stop", None, [5, 151643], (True, 151643)),
        (StopConfig(eos_token_ids=EOS_IDS, ignore_eos=True), "stop", None, [5, 151645], (False, None)),
        (StopConfig(stop_token_ids=frozenset({6})), "stop", None, [5, 6], (True, 6)),
        (StopConfig(stop_token_ids=frozenset({151645}), eos_token_ids=EOS_IDS, ignore_eos=True), "stop", None,
         [151645], (True, 151645)),
        (StopConfig(), "stop", 6, [5, 6], (True, 6)),
        (StopConfig(), "stop", 7, [5, 6], (False, 7)),
        (StopConfig(stop_token_ids=frozenset({6})), "stop", "six", [5, 6], (False, "six")),
        (StopConfig(stop_token_ids=frozenset({6}), eos_token_ids=EOS_IDS), "length", None, [5, 6], (False, None)),
        (StopConfig(eos_token_ids=EOS_IDS), "stop", None, [], (False, None)),
    ],
)
def test_stop_token_end(stop: StopConfig, finish: str, stop_reason: int | str | None, ids: list[int],
                        want: tuple[bool, int | str | None]) -> None:
    assert stop.stop_token_end(finish, stop_reason, ids) == want


class _RefusingStream:
    """A DecodeStream stand-in that refuses its next step, as DecodeStream does on an "Invalid prefix"."""

    def step(self, tokenizer: object, token_id: int) -> str | None:
        raise RuntimeError("Invalid prefix encountered")


@pytest.mark.parametrize("at", [1, 3, 5, 8])
def test_a_refused_step_restarts_without_losing_or_repeating_text(at: int) -> None:
    ids = TOK.encode("Hi 龘靐 🫠 ok")
    prompt, output = ids[:2], ids[2:]
    detok = IncrementalDetokenizer(TOK, prompt)
    deltas = []
    for i, token_id in enumerate(output):
        if i == at:
            detok._stream = _RefusingStream()  # type: ignore[assignment]
        detok.update([token_id], False)
        deltas.append(detok.release(False).text)
    detok.finish()
    deltas.append(detok.release(True).text)
    assert "".join(deltas) == TOK.decode(ids)[len(TOK.decode(prompt)) :]
