"""ChoiceState: which "stop" drops the last id's text, and how stop strings then cut it.

The cases restate vLLM 0.33's derender stop tests (ids decoding to "one two three", stop strings,
stop ids, include_stop_str_in_output, a "length" finish) plus the EOS rule, with the real Qwen3
tokenizer; the expected texts are written from the words, not taken from the code.
"""

from __future__ import annotations

import pytest

from pdserve.output.request_state import ChoiceState, OutputConfig
from pdserve.protocol.engine import EngineOutput, PositionLogprobs
from pdserve.text.detokenizer import StopConfig
from pdserve.text.tokenizer import Tokenizer

TOK = Tokenizer.load("qwen3")
IM_END, END_OF_TEXT = 151645, 151643  # Qwen3's chat EOS and generation_config's second EOS
EOS = (IM_END, END_OF_TEXT)
WORDS = TOK.encode("one two three")
THREE = WORDS[-1]
assert TOK.decode(WORDS[:-1]) == "one two" and TOK.decode([THREE]) == " three"


def final(ids: list[int], finish: str, stop_reason: int | str | None = None, *, chunk: int | None = None,
          **stop: object) -> tuple[str, int | str | None, list[int]]:
    """Feed ``ids`` (in chunks of ``chunk``, the finish on the last) and return text, stop_reason, ids."""
    stop_config = StopConfig(eos_token_ids=EOS, **stop)  # type: ignore[arg-type]
    config = OutputConfig(mode="text", prompt_token_ids=TOK.encode("Count:"), tokenizer=TOK,
                          skip_special_tokens=False, stop=stop_config)  # a kept EOS would show
    state = ChoiceState(0, config)
    size = chunk or len(ids)
    for pos in range(0, len(ids), size):
        last = pos + size >= len(ids)
        state.add(EngineOutput(request_id="r", index=0, new_token_ids=ids[pos : pos + size],
                               finish_reason=finish if last else None, stop_reason=stop_reason if last else None))
    return state.text, state.stop_reason, state.token_ids


@pytest.mark.parametrize("chunk", [None, 1, 2])
def test_stop_without_a_stop_token_keeps_the_last_text(chunk: int | None) -> None:
    """A "stop" with a null stop_reason whose last id is ordinary text (a response from elsewhere)."""
    assert final(WORDS, "stop", chunk=chunk) == ("one two three", None, WORDS)
    rest = TOK.encode("This is the rest")
    assert final(rest, "stop", chunk=chunk)[0] == "This is the rest"


@pytest.mark.parametrize("chunk", [None, 1])
def test_request_stop_string_cuts_when_no_stop_reason_was_reported(chunk: int | None) -> None:
    assert final(WORDS, "stop", chunk=chunk, stop=("three",))[:2] == ("one two ", "three")
    assert final(WORDS, "stop", chunk=chunk, stop=("three",), include_stop_str_in_output=True)[:2] == \
        ("one two three", "three")


def test_stop_token_id_is_left_out_and_reported() -> None:
    assert final(WORDS, "stop", stop_token_ids=frozenset({THREE}))[:2] == ("one two", THREE)
    assert final(WORDS, "stop", THREE)[:2] == ("one two", THREE)
    # An integer stop_reason that is not the last id: the last id is text.
    assert final(WORDS, "stop", THREE + 1)[:2] == ("one two three", THREE + 1)


def test_stop_token_id_is_kept_with_include_stop_str_in_output() -> None:
    assert final(WORDS, "stop", stop_token_ids=frozenset({THREE}), include_stop_str_in_output=True)[:2] == \
        ("one two three", THREE)


def test_length_keeps_a_matching_stop_token() -> None:
    assert final(WORDS, "length", stop_token_ids=frozenset({THREE}))[:2] == ("one two three", None)


def test_eos_ids_are_left_out() -> None:
    assert final(WORDS + [IM_END], "stop")[:2] == ("one two three", None)
    assert final(WORDS + [END_OF_TEXT], "stop")[:2] == ("one two three", END_OF_TEXT)
    assert final(WORDS + [IM_END], "stop", ignore_eos=True)[:2] == ("one two three<|im_end|>", None)
    assert final(WORDS + [IM_END], "stop", include_stop_str_in_output=True)[:2] == ("one two three<|im_end|>", None)


def test_token_ids_are_never_trimmed() -> None:
    assert final(WORDS + [IM_END], "stop")[2] == WORDS + [IM_END]
    assert final(WORDS, "stop", stop_token_ids=frozenset({THREE}))[2] == WORDS


@pytest.mark.parametrize("streaming", [False, True])
def test_decoded_logprobs_are_kept_for_a_batch_answer_only(streaming: bool) -> None:
    """A batch answer sends every decoded entry at the end; a stream sends them chunk by chunk and keeps none
    (a long stream with logprobs=20 would otherwise hold 21 structs per token until it ends)."""
    config = OutputConfig(mode="text", prompt_token_ids=TOK.encode("Count:"), tokenizer=TOK, want_logprobs=True,
                          streaming=streaming)
    state = ChoiceState(0, config)
    sent = []
    for token in WORDS:
        update = state.add(EngineOutput(request_id="r", index=0, new_token_ids=[token],
                                        new_logprobs=[PositionLogprobs([token, 13], [-0.5, -1.5], [1, 2])]))
        assert update is not None and update.decoded_logprobs is not None
        sent += update.decoded_logprobs
    assert [entry.token for entry in sent] == [TOK.decode([t]) for t in WORDS]
    assert state.decoded_logprobs == ([] if streaming else sent)
