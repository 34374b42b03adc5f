"""Every fixture case, for every parser setup it targets: batch expectations and stream == batch.

The key property: for ANY chunking of the output into engine steps, folding
the ``step`` deltas gives the same content, reasoning, tool calls and finish
reason as ``parse`` on the whole text.
"""

from __future__ import annotations

import functools
import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from parser_support import (
    assert_matches_case,
    assert_stream_matches_batch,
    chunk_steps,
    make_parser,
    stream,
    token_pieces,
)

from pdserve.parsers import ChatParser
from pdserve.text.tokenizer import Tokenizer
from tests.fixtures.parser_cases import ALL_CASES, CASES_BY_NAME, ParserCase, Setup

CASE_SETUPS = [
    pytest.param(case, setup, id=f"{case.name}[{setup.label}]") for case in ALL_CASES for setup in case.setups
]
CODER_NAMES = ("qwen3_coder", "qwen3_xml")
PROPERTY = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@functools.cache
def _tokens(tokenizer: Tokenizer, case_name: str) -> tuple[list[int], list[str]]:
    ids = CASES_BY_NAME[case_name].engine_token_ids(tokenizer)
    return ids, token_pieces(tokenizer, ids)


def _batch(tokenizer: Tokenizer, case: ParserCase, setup: Setup) -> tuple[ChatParser, object, str]:
    ids, _ = _tokens(tokenizer, case.name)
    parser = make_parser(tokenizer, case, setup)
    message, finish = parser.parse(case.parser_text, ids, case.engine_finish_reason)
    return parser, message, finish


@pytest.mark.parametrize(("case", "setup"), CASE_SETUPS)
def test_batch_matches_expectation(tokenizer: Tokenizer, case: ParserCase, setup: Setup) -> None:
    _, pieces = _tokens(tokenizer, case.name)
    assert "".join(pieces) == case.parser_text, "the case's text must survive tokenization"
    parser, message, finish = _batch(tokenizer, case, setup)
    assert_matches_case(message, finish, case)
    assert parser.hide_metadata == case.hide_metadata


@pytest.mark.parametrize("mode", ["per_token", "one_step", "finish_only_tail", "per_char"])
@pytest.mark.parametrize(("case", "setup"), CASE_SETUPS)
def test_stream_matches_batch(tokenizer: Tokenizer, case: ParserCase, setup: Setup, mode: str) -> None:
    ids, pieces = _tokens(tokenizer, case.name)
    if mode == "per_char":
        steps = [(char, []) for char in case.parser_text]
    else:
        steps = chunk_steps(pieces, ids, range(len(ids)) if mode != "one_step" else [])
    parser = make_parser(tokenizer, case, setup)
    folded = stream(parser, steps, case.engine_finish_reason, separate_finish=mode == "finish_only_tail")
    _, message, finish = _batch(tokenizer, case, setup)
    assert_stream_matches_batch(folded, message, finish, exact_args=setup.tools in CODER_NAMES)
    assert (folded.content or "") == (case.content or "")
    assert folded.reasoning == case.streamed_reasoning


@pytest.mark.parametrize(("case", "setup"), CASE_SETUPS)
@PROPERTY
@given(data=st.data())
def test_any_token_chunking(tokenizer: Tokenizer, case: ParserCase, setup: Setup, data: st.DataObject) -> None:
    ids, pieces = _tokens(tokenizer, case.name)
    cuts = data.draw(st.lists(st.integers(1, max(1, len(ids) - 1)), max_size=len(ids)), label="cuts")
    separate_finish = data.draw(st.booleans(), label="separate_finish")
    folded = stream(
        make_parser(tokenizer, case, setup), chunk_steps(pieces, ids, cuts), case.engine_finish_reason, separate_finish
    )
    _, message, finish = _batch(tokenizer, case, setup)
    assert_stream_matches_batch(folded, message, finish, exact_args=setup.tools in CODER_NAMES)


@pytest.mark.parametrize(("case", "setup"), CASE_SETUPS)
@PROPERTY
@given(data=st.data())
def test_any_text_chunking(tokenizer: Tokenizer, case: ParserCase, setup: Setup, data: st.DataObject) -> None:
    """Cuts anywhere in the text (inside tags and JSON tokens too), independent of token boundaries."""
    text = case.parser_text
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, len(text) - 1)), max_size=24), label="cuts")))
    bounds = [0, *(c for c in cuts if c < len(text)), len(text)]
    steps = [(text[a:b], []) for a, b in itertools.pairwise(bounds) if b > a]
    folded = stream(make_parser(tokenizer, case, setup), steps, case.engine_finish_reason, data.draw(st.booleans()))
    _, message, finish = _batch(tokenizer, case, setup)
    assert_stream_matches_batch(folded, message, finish, exact_args=setup.tools in CODER_NAMES)
