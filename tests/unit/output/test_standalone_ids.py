"""The detokenizer's standalone-id path (Tokenizer.standalone_pieces, IncrementalDetokenizer.take_standalone)
changes nothing a client sees: every update's text and ids equal those of the decoder's own path, for any
ids (whole words, pieces of characters, specials, added markup), any chunking and any prompt tail."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.output.request_state import ChoiceState, OutputConfig
from pdserve.parsers import ChatParser, ParserConfig
from pdserve.protocol.engine import EngineOutput
from pdserve.protocol.openai import ChatCompletionRequest, StreamDelta
from pdserve.text.byte_stream import REPLACEMENT_CHAR
from pdserve.text.detokenizer import StopConfig
from pdserve.text.tokenizer import Tokenizer

TOK = Tokenizer.load("qwen3")
TABLE = TOK.standalone_pieces
assert TABLE is not None  # Qwen3's decoder is byte-level
# Ids that are pieces of one character, and added tokens: the ones the table must leave to the decoder.
SPLIT = TOK.encode("🇫🇷👩‍👩‍👧 中文 ｶﾀｶﾅ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 café")
ADDED = sorted(TOK.added_ids)
PARSERS = ParserConfig("qwen3", "hermes", enable_auto_tool_choice=True)
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
ids_strategy = st.lists(
    st.one_of(st.integers(0, TOK.vocab_size - 1), st.sampled_from(SPLIT), st.sampled_from(ADDED),
              st.sampled_from(TOK.encode(" the quick brown fox"))),
    min_size=1, max_size=40)


def feed(ids: list[int], chunks: list[int], prompt: list[int], skip: bool, finish: str, fast: bool,
         parser: ChatCompletionRequest | None = None):
    """The updates of a stream (``parser``: a derender stream, parsed for that chat request), as a client
    reads them."""
    factory = None if parser is None else (lambda: ChatParser(PARSERS, TOK, parser, prompt))
    config = OutputConfig(mode="text" if parser is None else "derender", prompt_token_ids=prompt, tokenizer=TOK,
                          skip_special_tokens=skip, streaming=True, stop=StopConfig(eos_token_ids=TOK.eos_token_ids),
                          parser_factory=factory)
    state = ChoiceState(0, config)
    assert state.detok is not None
    if not fast:
        state.detok._standalone = None  # the decoder's own path for every id
    sent, pos = [], 0
    for size in chunks:
        step, pos = ids[pos : pos + size], pos + size
        done = pos >= len(ids)
        update = state.add(EngineOutput(request_id="r", new_token_ids=step, finish_reason=finish if done else None))
        assert update is not None
        sent.append((update.text, update.token_ids, update.finish_reason, update.hides_metadata, seen(update.delta)))
        if done:
            break
    return sent, state


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ids=ids_strategy, chunks=st.lists(st.integers(1, 4), min_size=40, max_size=40),
       prompt=st.lists(st.sampled_from(SPLIT + TOK.encode("Hi")), min_size=1, max_size=6),
       skip=st.booleans(), finish=st.sampled_from(["length", "stop"]))
def test_standalone_ids_change_no_update(ids: list[int], chunks: list[int], prompt: list[int], skip: bool,
                                         finish: str) -> None:
    fast, fast_state = feed(ids, chunks, prompt, skip, finish, fast=True)
    slow, slow_state = feed(ids, chunks, prompt, skip, finish, fast=False)
    assert fast == slow
    assert fast_state.text == slow_state.text and fast_state.token_ids == slow_state.token_ids


def seen(delta: StreamDelta | None) -> tuple[object, ...] | None:
    """A delta as a client reads it, tool call ids (random) left out."""
    if delta is None:
        return None
    calls = [(c.index, c.function.name if c.function else None, c.function.arguments if c.function else None)
             for c in delta.tool_calls]
    return delta.role, delta.content, delta.reasoning, calls


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ids=ids_strategy, chunks=st.lists(st.integers(1, 4), min_size=40, max_size=40),
       prompt=st.lists(st.sampled_from(SPLIT + TOK.encode("Hi") + ADDED), min_size=1, max_size=6),
       skip=st.booleans(), finish=st.sampled_from(["length", "stop"]), include_reasoning=st.booleans())
def test_standalone_ids_change_no_derender_delta(ids: list[int], chunks: list[int], prompt: list[int], skip: bool,
                                                 finish: str, include_reasoning: bool) -> None:
    """A streamed message's deltas (through the reasoning and tool parsers, reasoning shown or hidden) are
    those of the decoder's own path too."""
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[TOOL],
                                 include_reasoning=include_reasoning)
    fast, fast_state = feed(ids, chunks, prompt, skip, finish, fast=True, parser=chat)
    slow, slow_state = feed(ids, chunks, prompt, skip, finish, fast=False, parser=chat)
    assert fast == slow
    assert fast_state.text == slow_state.text and fast_state.token_ids == slow_state.token_ids


def test_the_table_holds_whole_ordinary_tokens_only() -> None:
    assert TABLE[TOK.encode(" fox")[0]] == " fox"
    assert all(TABLE[i] is None for i in TOK.added_ids)
    assert all(TABLE[i] is None for i in SPLIT if REPLACEMENT_CHAR in TOK.token_strings[i])


def test_standalone_ids_are_counted_and_skip_the_decoder() -> None:
    words = TOK.encode(" one two three four")
    config = OutputConfig(mode="text", prompt_token_ids=TOK.encode("Count:"), tokenizer=TOK, streaming=True)
    state = ChoiceState(0, config)
    assert state.detok is not None
    stepped = []
    stream_step = TOK.stream_step
    TOK.stream_step = lambda stream, token_id: stepped.append(token_id) or stream_step(stream, token_id)  # type: ignore[method-assign]
    try:
        before = TOK.decoded_ids
        texts = [state.add(EngineOutput(request_id="r", new_token_ids=[t])).text for t in words]  # type: ignore[union-attr]
        counted = TOK.decoded_ids - before
    finally:
        del TOK.stream_step
    assert counted == len(words)  # each still counts as detokenized
    assert texts == [TOK.decode([t]) for t in words]
    assert stepped == []  # every id came from the table


def test_stop_strings_keep_the_decoder_path() -> None:
    """With stop strings text is held back, so no id may go out on its own."""
    config = OutputConfig(mode="text", prompt_token_ids=[], tokenizer=TOK, stop=StopConfig(("three",)))
    state = ChoiceState(0, config)
    assert state.detok is not None and state.detok.take_standalone(TOK.encode(" one")[0]) is None
