"""Self-consistency on arbitrary (mostly malformed) markup soup, for every parser combination.

No expectations here, only the invariants that must hold for any output and
any chunking: stream == batch, every tool call has valid JSON arguments, and
the parser never raises.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from parser_support import assert_stream_matches_batch, parser_config, stream

from pdserve.parsers import ChatParser
from pdserve.protocol.openai import ChatCompletionRequest
from pdserve.text.tokenizer import Tokenizer
from tests.fixtures.parser_cases import EVENT, WEATHER, Setup

FRAGMENTS = [
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=",
    "</parameter>", ">", "<", "</", "<tool", "<para", "\n", " ", "\t", "  \n", "get_weather", "create_event",
    "city", "attendees", "all_day", "location", "5", "true", "null", "1.5e3", "-", "Paris", "東京", "😀",
    "{", "}", "[", "]", '"', ":", ",", '"name"', '"arguments"', '"name": "get_weather"',
    '{"name": "get_weather", "arguments": {"city": "Pa', 'ris"}}', '{"room": "B2"}', "\\", '\\"', "\\u00e9",
    "\\ud83d", "\\ude00", "abc", "Answer.",
]  # fmt: skip

SETUPS = [Setup(r, t) for r in (None, "deepseek_r1", "qwen3") for t in (None, "hermes", "qwen3_coder")]
TOOL_CHOICES = ["auto", "none", "required", {"type": "function", "function": {"name": "get_weather"}}]


@pytest.mark.parametrize("setup", SETUPS, ids=lambda s: s.label)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_stream_equals_batch_on_markup_soup(tokenizer: Tokenizer, setup: Setup, data: st.DataObject) -> None:
    text = "".join(data.draw(st.lists(st.sampled_from(FRAGMENTS), max_size=40), label="fragments"))
    request = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}],
        tools=[WEATHER, EVENT],
        tool_choice=data.draw(st.sampled_from(TOOL_CHOICES), label="tool_choice"),
        parallel_tool_calls=data.draw(st.booleans(), label="parallel"),
        include_reasoning=data.draw(st.booleans(), label="include_reasoning"),
        chat_template_kwargs={"enable_thinking": data.draw(st.booleans(), label="thinking")},
    )
    prompt_tail = data.draw(st.sampled_from(["", "<think>\n", "<think>\n\n</think>\n\n", None]), label="prompt")
    prompt = None if prompt_tail is None else tokenizer.encode("<|im_start|>assistant\n" + prompt_tail)
    finish_reason = data.draw(st.sampled_from(["stop", "length", "abort"]), label="finish")
    config = parser_config(setup)

    message, finish = ChatParser(config, tokenizer, request, prompt).parse(text, [], finish_reason)

    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, len(text) - 1)), max_size=30), label="cuts")))
    bounds = [0, *(c for c in cuts if c < len(text)), len(text)]
    steps = [(text[a:b], []) for a, b in itertools.pairwise(bounds) if b > a]
    parser = ChatParser(config, tokenizer, request, prompt)
    folded = stream(parser, steps, finish_reason, data.draw(st.booleans(), label="separate_finish"))
    assert_stream_matches_batch(folded, message, finish, exact_args=setup.tools == "qwen3_coder")
