"""Stateless derender (pdserve.output.derender): a stream advanced one call at a time, with its
state carried through the client as JSON, says what the inline choice state says for the same
chunks, and replaying the carried state rebuilds the inline state.
"""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.output import derender
from pdserve.output.request_state import ChoiceState, OutputConfig
from pdserve.parsers import ChatParser, ParserConfig
from pdserve.protocol.derender import DerenderStreamState
from pdserve.protocol.engine import EngineOutput
from pdserve.protocol.generate import GenerateTokensStreamChoice
from pdserve.protocol.openai import ChatCompletionRequest
from pdserve.text.detokenizer import StopConfig
from pdserve.text.tokenizer import Tokenizer

TOK = Tokenizer.load("qwen3")
CHAT = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
PROMPT = TOK.encode(TOK.apply_chat_template(CHAT.messages, add_generation_prompt=True))
PARSERS = ParserConfig("qwen3", None)
PIECES = ["Paris", " is", " 中文", "é", "🙂", "<think>", "</think>", "\n", " 42", "naïve", "ß"]


def _config(parsed: bool) -> OutputConfig:
    factory = (lambda: ChatParser(PARSERS, TOK, CHAT, PROMPT)) if parsed else None
    return OutputConfig(mode="derender", prompt_token_ids=PROMPT, tokenizer=TOK, skip_special_tokens=not parsed,
                        stop=StopConfig(eos_token_ids=tuple(TOK.eos_token_ids)), parser_factory=factory,
                        streaming=True)


def _chunks(ids: list[int], cuts: list[int]) -> list[list[int]]:
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(ids)}), len(ids)]
    return [ids[a:b] for a, b in itertools.pairwise(bounds)]


def _delta_fields(delta: object) -> dict | None:
    if delta is None:
        return None
    return delta.model_dump(exclude={"role"}, exclude_none=True) or None  # type: ignore[attr-defined]


streams = st.tuples(
    st.lists(st.sampled_from(PIECES), min_size=1, max_size=12).map(lambda p: TOK.encode("".join(p))),
    st.lists(st.integers(1, 40), max_size=8),
    st.booleans(),
)


@settings(max_examples=60, deadline=None)
@given(streams)
def test_advancing_a_carried_state_says_what_the_inline_state_says(stream: tuple[list[int], list[int], bool]) -> None:
    ids, cuts, parsed = stream
    config = _config(parsed)
    inline = ChoiceState(0, config)
    carried = DerenderStreamState()
    chunks = _chunks(ids, cuts)
    for k, chunk in enumerate(chunks):
        finish = "length" if k == len(chunks) - 1 else None
        expected = inline.add(EngineOutput(request_id="r", index=0, new_token_ids=chunk, finish_reason=finish))
        wire = GenerateTokensStreamChoice(index=0, token_ids=chunk, finish_reason=finish)
        step = derender.advance(config, carried, parsed, wire, "r", None)
        assert expected is not None
        assert step.update.text == expected.text
        assert _delta_fields(step.update.delta) == _delta_fields(expected.delta)
        assert step.update.finish_reason == expected.finish_reason
        assert step.update.token_ids == chunk
        # The role opens every stream, even on a chunk whose text the parser holds back (vLLM does).
        if not carried.role_sent:
            assert step.update.delta is not None and step.update.delta.role == "assistant"
        elif step.update.delta is not None:
            assert step.update.delta.role is None
        # The client echoes the state as JSON.
        carried = DerenderStreamState.model_validate_json(step.state.model_dump_json())
        if parsed:
            rebuilt = derender.replay(config, carried, parsed, 0)
            assert rebuilt.token_ids == inline.token_ids
            assert rebuilt.text == inline.text
    if not parsed:
        assert inline.text == TOK.decode(ids)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.sampled_from(PIECES), min_size=2, max_size=10).map(lambda p: TOK.encode("".join(p))),
       st.integers(1, 30))
def test_plain_replay_keeps_only_a_short_tail(ids: list[int], cut: int) -> None:
    """The plain path carries at most PLAIN_REPLAY_IDS ids, whatever the stream's length, and the
    carried tail plus the next chunk decodes to the text the whole stream releases for that chunk."""
    config = _config(parsed=False)
    head, rest = ids[:cut], ids[cut:]
    first = derender.advance(config, DerenderStreamState(), False,
                             GenerateTokensStreamChoice(index=0, token_ids=head), "r", None)
    assert len(first.state.output_token_ids) <= derender.PLAIN_REPLAY_IDS
    if not rest:
        return
    second = derender.advance(config, first.state, False, GenerateTokensStreamChoice(index=0, token_ids=rest,
                              finish_reason="length"), "r", None)
    assert first.update.text + second.update.text == TOK.decode(ids)
