"""Registry and startup validation, prompt-aware start, flushing, ids, cost, and the building blocks."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from parser_support import TOOL_CALL_ID, assert_stream_matches_batch, chunk_steps, make_parser, stream, token_pieces

from pdserve.parsers import REASONING_PARSERS, TOOL_PARSERS, ChatParser, ParserConfig
from pdserve.parsers.json_scanner import JsonValueScanner
from pdserve.parsers.reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser
from pdserve.parsers.tools import HermesToolParser, Qwen3CoderToolParser
from pdserve.parsers.tools.schema import coerce, schema_types
from pdserve.protocol.openai import ChatCompletionRequest
from pdserve.text.tokenizer import Tokenizer
from tests.fixtures.parser_cases import CASES_BY_NAME, QWEN3_HERMES, WEATHER, Setup

QWEN3_HERMES_CONFIG = ParserConfig("qwen3", "hermes", enable_auto_tool_choice=True)
QWEN3_CODER_CONFIG = ParserConfig("qwen3", "qwen3_coder", enable_auto_tool_choice=True)


def _request(**extra: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **extra)


def _step_all(parser: ChatParser, pieces: list[str]) -> list[Any]:
    return [parser.step(piece, [], None)[0] for piece in pieces]


# ---------------------------------------------------------------- registry and validation


def test_registry_names_and_aliases() -> None:
    assert set(REASONING_PARSERS) == {"deepseek_r1", "step5", "qwen3"}
    assert set(TOOL_PARSERS) == {"hermes", "qwen3_json", "qwen3_coder", "qwen3_xml"}
    assert ParserConfig(tool_call_parser="qwen3_xml", enable_auto_tool_choice=True).tool_class is Qwen3CoderToolParser
    assert ParserConfig(tool_call_parser="qwen3_json", enable_auto_tool_choice=True).tool_class is HermesToolParser
    assert ParserConfig(reasoning_parser="qwen3").reasoning_class is Qwen3ReasoningParser
    assert ParserConfig(reasoning_parser="deepseek_r1").reasoning_class is DeepSeekR1ReasoningParser


def test_unknown_names_list_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown reasoning parser 'r1'.*deepseek_r1, qwen3, step5"):
        ParserConfig(reasoning_parser="r1")
    # vLLM 0.33 has no tool parser named qwen3 (only the reasoning one).
    with pytest.raises(ValueError, match=r"tool call parser 'qwen3'.*hermes, qwen3_coder, qwen3_json, qwen3_xml"):
        ParserConfig(tool_call_parser="qwen3")


def test_tool_parser_is_active_only_with_auto_tool_choice() -> None:
    assert not ParserConfig().configured
    assert not ParserConfig(tool_call_parser="hermes").configured
    assert ParserConfig(tool_call_parser="hermes").tool_class is None
    assert ParserConfig(tool_call_parser="hermes", enable_auto_tool_choice=True).configured
    assert ParserConfig(reasoning_parser="qwen3").configured


class _Vocab:
    def __init__(self, *tokens: str) -> None:
        self._ids = {token: i for i, token in enumerate(tokens)}

    def token_to_id(self, token: str) -> int | None:
        return self._ids.get(token)


def test_validate_requires_single_token_markup(tokenizer: Tokenizer) -> None:
    for reasoning in ("deepseek_r1", "qwen3"):
        for tools in ("hermes", "qwen3_coder"):
            ParserConfig(reasoning, tools, enable_auto_tool_choice=True).validate(tokenizer)
    with pytest.raises(ValueError, match=r"parser 'qwen3' needs '<think>', '</think>' as single tokens"):
        ParserConfig("qwen3").validate(_Vocab("<tool_call>", "</tool_call>"))
    with pytest.raises(ValueError, match=r"parser 'hermes' needs '</tool_call>'"):
        ParserConfig(None, "hermes", enable_auto_tool_choice=True).validate(_Vocab("<tool_call>"))
    # An inactive tool parser (no --enable-auto-tool-choice) is not checked.
    ParserConfig("deepseek_r1", "hermes").validate(_Vocab("<think>", "</think>"))


# ---------------------------------------------------------------- without a parser


def test_without_parser_content_is_the_plain_text(tokenizer: Tokenizer) -> None:
    text = "<think>a</think><tool_call>{}</tool_call>"
    for config, request in ((ParserConfig(), _request()), (QWEN3_HERMES_CONFIG, None)):
        parser = ChatParser(config, tokenizer, request, None)
        assert not parser.active and not parser.hide_metadata
        message, finish = parser.parse(text, [], None)
        assert (message.content, message.reasoning, message.tool_calls, finish) == (text, None, [], "stop")
        streaming = ChatParser(config, tokenizer, request, None)
        delta, finish = streaming.step("<think>", [151667], None)
        assert delta is not None and delta.content == "<think>" and finish is None
        assert streaming.step("", [], "length") == (None, "length")


def test_empty_output_without_parser_keeps_empty_content(tokenizer: Tokenizer) -> None:
    message, _ = ChatParser(ParserConfig(), tokenizer, _request(), None).parse("", [], "stop")
    assert message.content == ""


# ---------------------------------------------------------------- prompt-aware start


def test_qwen3_is_reasoning_end_looks_at_the_current_turn_only(tokenizer: Tokenizer) -> None:
    qwen3 = Qwen3ReasoningParser(tokenizer, {})
    r1 = DeepSeekR1ReasoningParser(tokenizer, {})
    open_turn = "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
    closed_turn = open_turn + "<think>\n\n</think>\n\n"
    history = "<|im_start|>assistant\n<think>\nold\n</think>\n\nold answer<|im_end|>\n" + open_turn
    assert not qwen3.is_reasoning_end(tokenizer.encode(open_turn))
    assert qwen3.is_reasoning_end(tokenizer.encode(closed_turn))
    assert not qwen3.is_reasoning_end(tokenizer.encode(history))
    assert not qwen3.is_reasoning_end(tokenizer.encode(open_turn + "<think>\n"))
    # deepseek_r1 scans the whole prompt (reference 10.1): an earlier turn's </think> counts.
    assert r1.is_reasoning_end(tokenizer.encode(history))
    assert not r1.is_reasoning_end(tokenizer.encode(open_turn))
    # With thinking disabled and no think markers in the turn, reasoning is over before it starts.
    assert Qwen3ReasoningParser(tokenizer, {"enable_thinking": False}).is_reasoning_end(tokenizer.encode(open_turn))


def test_qwen3_thinking_disabled_without_prompt_starts_in_content(tokenizer: Tokenizer) -> None:
    request = _request(chat_template_kwargs={"enable_thinking": False})
    message, _ = ChatParser(ParserConfig("qwen3"), tokenizer, request, None).parse("Just this.</think>", [], "stop")
    assert (message.reasoning, message.content) == (None, "Just this.")


@pytest.mark.parametrize(
    ("reasoning_parser", "text", "expected"),
    [
        ("deepseek_r1", "\n<think>a</think>b", ("a", "b")),
        ("deepseek_r1", " \n\t<think>a</think>b", ("a", "b")),
        ("deepseek_r1", "\nabc</think>b", ("\nabc", "b")),
        ("deepseek_r1", "\n</think>b", ("\n", "b")),
        ("deepseek_r1", "\n", ("\n", None)),
        # Only whitespace is dropped: other text before <think> stays reasoning (vLLM's batch drops it).
        ("deepseek_r1", "x\n<think>a</think>b", ("x\na", "b")),
        ("deepseek_r1", "<think>a\n<think>b</think>c", ("a\nb", "c")),
        # qwen3 swallows <think> wherever it comes in reasoning and keeps all other reasoning text.
        ("qwen3", "\n<think>a</think>b", ("\na", "b")),
    ],
)
def test_whitespace_before_think(
    tokenizer: Tokenizer, reasoning_parser: str, text: str, expected: tuple[str | None, str | None]
) -> None:
    config = ParserConfig(reasoning_parser)
    message, _ = ChatParser(config, tokenizer, _request(), None).parse(text, [], "stop")
    assert (message.reasoning, message.content) == expected
    for size in (1, 2, 3):
        steps = [(text[i : i + size], []) for i in range(0, len(text), size)]
        folded = stream(ChatParser(config, tokenizer, _request(), None), steps, "stop", size == 2)
        assert (folded.reasoning, folded.content) == expected


def test_empty_reasoning_is_a_string_for_deepseek_r1_only(tokenizer: Tokenizer) -> None:
    """vLLM's deepseek_r1 always returns a reasoning string when it parsed reasoning; qwen3 gives None."""
    for text in ("", "</think>rest"):
        r1, _ = ChatParser(ParserConfig("deepseek_r1"), tokenizer, _request(), None).parse(text, [], "stop")
        qwen3, _ = ChatParser(ParserConfig("qwen3"), tokenizer, _request(), None).parse(text, [], "stop")
        assert (r1.reasoning, qwen3.reasoning) == ("", None)
    closed = tokenizer.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    after_prompt, _ = ChatParser(ParserConfig("deepseek_r1"), tokenizer, _request(), closed).parse("", [], "stop")
    hidden, _ = ChatParser(ParserConfig("deepseek_r1"), tokenizer, _request(include_reasoning=False), None).parse(
        "</think>rest", [], "stop"
    )
    assert (after_prompt.reasoning, hidden.reasoning) == (None, None)


# ---------------------------------------------------------------- streaming mechanics


def test_finish_only_step_flushes_a_held_partial_tag(tokenizer: Tokenizer) -> None:
    parser = ChatParser(ParserConfig("qwen3"), tokenizer, _request(), None)
    deltas = _step_all(parser, list("<think>\nx\n</think>\n\nabc</thi"))
    assert "".join(d.content for d in deltas if d is not None and d.content) == "\n\nabc"
    delta, finish = parser.step("", [], "stop")
    assert delta is not None and delta.content == "</thi" and finish == "stop"


def test_finish_only_step_closes_unstreamed_tool_arguments(tokenizer: Tokenizer) -> None:
    request = _request(tools=[WEATHER])
    parser = ChatParser(QWEN3_CODER_CONFIG, tokenizer, request, None)
    _step_all(parser, ["<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"])
    delta, finish = parser.step("", [], "length")
    assert finish == "length"
    assert delta is not None and [c.function.arguments for c in delta.tool_calls if c.function] == ['"}']


def test_whitespace_before_a_tool_call_is_deferred_then_dropped(tokenizer: Tokenizer) -> None:
    parser = ChatParser(QWEN3_HERMES_CONFIG, tokenizer, _request(tools=[WEATHER]), None)
    assert _step_all(parser, ["<think>\nr\n</think>", "\n\n", '<tool_call>\n{"name": "get_weather"'])[-1] is None
    delta, _ = parser.step(', "arguments": {}}', [], None)
    assert delta is not None and delta.content is None and delta.tool_calls[0].function.name == "get_weather"


def test_step_after_finish_is_an_error(tokenizer: Tokenizer) -> None:
    parser = ChatParser(ParserConfig("qwen3"), tokenizer, _request(), None)
    parser.step("x", [], "stop")
    with pytest.raises(RuntimeError, match="after the step that carried the finish reason"):
        parser.step("y", [], None)


def test_tool_call_ids_are_stable_per_index(tokenizer: Tokenizer) -> None:
    case = CASES_BY_NAME["reasoning_then_two_tool_calls"]
    parser = make_parser(tokenizer, case, QWEN3_HERMES)
    ids = case.engine_token_ids(tokenizer)
    seen: dict[int, list[str]] = {}
    for text, step_ids in chunk_steps(token_pieces(tokenizer, ids), ids, range(len(ids))):
        delta, _ = parser.step(text, step_ids, None)
        for call in delta.tool_calls if delta else []:
            seen.setdefault(call.index, [])
            if call.id is not None:
                seen[call.index].append(call.id)
    _, finish = parser.step("", [], "stop")
    assert finish == "tool_calls" and parser.tools_streamed
    assert sorted(seen) == [0, 1] and all(len(found) == 1 for found in seen.values())
    assert parser.tool_call_ids == [seen[0][0], seen[1][0]] and seen[0] != seen[1]
    assert all(TOOL_CALL_ID.fullmatch(i) for i in parser.tool_call_ids)


def test_include_reasoning_false_hides_reasoning_and_metadata(tokenizer: Tokenizer) -> None:
    parser = ChatParser(ParserConfig("qwen3"), tokenizer, _request(include_reasoning=False), None)
    assert parser.hide_metadata
    assert _step_all(parser, ["<think>\nsecret"]) == [None]
    delta, _ = parser.step("</think>\n\nok", [], "stop")
    assert delta is not None and (delta.reasoning, delta.content) == (None, "\n\nok")


# ---------------------------------------------------------------- O(delta) cost


def _long_output(n: int) -> str:
    thought = "".join(f"step {i}: consider <b>{i}</b> and < or > signs.\n" for i in range(n))
    args = json.dumps({"city": "x" * (40 * n), "notes": [f"note {i}" for i in range(n)]})
    return (
        f"<think>\n{thought}</think>\n\nSure.\n<tool_call>\n"
        + json.dumps({"name": "get_weather"})[:-1]
        + (f', "arguments": {args}}}\n</tool_call>')
    )


def _stream_counting(tokenizer: Tokenizer, text: str) -> tuple[int, int]:
    """(characters the tag scanners examined, characters the JSON scanners consumed) for per-token steps."""
    ids = tokenizer.encode(text)
    parser = ChatParser(QWEN3_HERMES_CONFIG, tokenizer, _request(tools=[WEATHER]), None)
    consumed = 0
    original_feed = JsonValueScanner.feed

    def counting_feed(self: JsonValueScanner, chunk: str, pos: int = 0) -> int:
        nonlocal consumed
        end = original_feed(self, chunk, pos)
        consumed += end - pos
        return end

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(JsonValueScanner, "feed", counting_feed)
        folded = stream(parser, chunk_steps(token_pieces(tokenizer, ids), ids, range(len(ids))), "stop", False)
    assert len(folded.calls) == 1
    return parser.scanned_chars, consumed


def test_streaming_cost_is_linear_in_the_output(tokenizer: Tokenizer) -> None:
    """Structural, not timed: work counters grow with the output, never with output x steps."""
    small, large = _long_output(100), _long_output(400)
    scanned_small, consumed_small = _stream_counting(tokenizer, small)
    scanned_large, consumed_large = _stream_counting(tokenizer, large)
    steps_large = len(tokenizer.encode(large))
    # Two stages (reasoning, tools) each see every character once, plus a bounded hold-back per step.
    assert scanned_large <= 2 * len(large) + 2 * 2 * 11 * steps_large
    assert scanned_large / scanned_small < 4.6  # x4 output -> about x4 work (quadratic would be x16)
    # The JSON body is consumed once: each character fed to a JSON scanner exactly once.
    assert consumed_large <= len(large) and consumed_large / consumed_small < 4.6


# ---------------------------------------------------------------- hermes details


def test_hermes_arguments_before_name_are_held_until_the_name(tokenizer: Tokenizer) -> None:
    parser = ChatParser(QWEN3_HERMES_CONFIG, tokenizer, _request(tools=[WEATHER]), None)
    text = '<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_weather"}\n</tool_call>'
    message, finish = parser.parse(text, [], "stop")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert finish == "tool_calls"


def test_hermes_call_is_released_whole_when_its_body_closes(tokenizer: Tokenizer) -> None:
    """A streamed call cannot be taken back, so nothing of it is sent before its JSON is known to be valid."""
    parser = ChatParser(QWEN3_HERMES_CONFIG, tokenizer, _request(tools=[WEATHER]), None)
    pieces = ["<think>\nr\n</think>\n\n<tool_call>\n", '{"name": "get_weather", ', '"arguments": {"city": "Pa', 'ris"}']
    assert _step_all(parser, pieces)[1:] == [None, None, None]
    delta, _ = parser.step("}", [], None)
    assert delta is not None and [(c.index, c.function.name, c.function.arguments) for c in delta.tool_calls] == [
        (0, "get_weather", '{"city": "Paris"}')
    ]
    assert parser.step("\n</tool_call>", [], "stop") == (None, "tool_calls")


@pytest.mark.parametrize("finish_reason", ["stop", "abort", None])
@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "f", "arguments": {"x": true}',  # the body never closes
        '<tool_call>\n{"name": "f", "arguments": {"x": true}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": {"x": tru}}\n</tool_call>',  # broken inside the arguments
        '<tool_call>\n{"name": "f", "arguments": {"x": 1}<tool_call>',  # a new region starts first
    ],
)
def test_hermes_broken_json_is_content_not_a_call(tokenizer: Tokenizer, text: str, finish_reason: str | None) -> None:
    request = _request(tools=[WEATHER])
    message, finish = ChatParser(QWEN3_HERMES_CONFIG, tokenizer, request, []).parse(text, [], finish_reason)
    assert (message.content, message.tool_calls, finish) == (text, [], finish_reason or "stop")
    steps = [(char, []) for char in text]
    folded = stream(ChatParser(QWEN3_HERMES_CONFIG, tokenizer, request, []), steps, finish_reason or "stop", True)
    assert (folded.content, folded.calls) == (text, {})


def test_hermes_body_cut_by_length_after_the_name_stays_a_call(tokenizer: Tokenizer) -> None:
    """pdserve's documented difference: max_tokens cut a call short; the model did not break it."""
    text = '<tool_call>\n{"name": "f", "arguments": {"x": true}'
    message, finish = ChatParser(QWEN3_HERMES_CONFIG, tokenizer, _request(tools=[WEATHER]), []).parse(text, [], "length")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [("f", {"x": True})]
    assert (message.content, finish) == (None, "length")


def _json_values() -> st.SearchStrategy[Any]:
    scalars = (
        st.none()
        | st.booleans()
        | st.integers(-(10**6), 10**6)
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text()
    )
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
        max_leaves=12,
    )


@settings(max_examples=300, deadline=None)
@given(value=_json_values(), indent=st.sampled_from([None, 1]), ascii_only=st.booleans(), data=st.data())
def test_json_scanner_prefixes_are_closable(value: Any, indent: int | None, ascii_only: bool, data: Any) -> None:
    text = json.dumps(value, indent=indent, ensure_ascii=ascii_only)
    cut = data.draw(st.integers(0, len(text)), label="cut")
    scanner = JsonValueScanner()
    taken, pos = [], 0
    for size in [*data.draw(st.lists(st.integers(1, 8), max_size=len(text)), label="chunks"), len(text)]:
        chunk = text[pos : min(cut, pos + size)]
        assert scanner.feed(chunk) == len(chunk) or scanner.done
        taken.append(scanner.take())
        pos += len(chunk)
        if pos >= cut:
            break
    if cut == len(text):
        scanner.finish()
        taken.append(scanner.take())
        assert scanner.done and "".join(taken) == text and scanner.closer() == ""
    emitted = "".join(taken)
    assert text.startswith(emitted)
    if emitted:
        json.loads(emitted + scanner.closer())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arguments=st.dictionaries(st.text(max_size=6), _json_values(), max_size=4), data=st.data())
def test_hermes_any_arguments_any_cut(tokenizer: Tokenizer, arguments: dict[str, Any], data: Any) -> None:
    body = json.dumps({"name": "get_weather", "arguments": arguments}, ensure_ascii=data.draw(st.booleans()))
    text = f"<tool_call>\n{body}\n</tool_call>"
    cut = data.draw(st.integers(len("<tool_call>\n") + len('{"name": "get_weather"'), len(text)), label="cut")
    finish_reason = "stop" if cut == len(text) else "length"
    request = _request(tools=[WEATHER])
    message, finish = ChatParser(QWEN3_HERMES_CONFIG, tokenizer, request, None).parse(text[:cut], [], finish_reason)
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    if cut == len(text):
        assert json.loads(message.tool_calls[0].function.arguments) == arguments
    steps = [(char, []) for char in text[:cut]]
    folded = stream(ChatParser(QWEN3_HERMES_CONFIG, tokenizer, request, None), steps, finish_reason, True)
    assert_stream_matches_batch(folded, message, finish, exact_args=False)


# ---------------------------------------------------------------- qwen3_coder typing


def test_schema_types() -> None:
    assert schema_types({"type": "integer"}) == {"integer"}
    assert schema_types({"type": ["string", "null"]}) == {"string", "null"}
    assert schema_types({"anyOf": [{"type": "number"}, {"type": "boolean"}]}) == {"number", "boolean"}
    assert schema_types({"enum": ["a", 1]}) == {"string", "integer"}
    assert schema_types({"description": "untyped"}) == frozenset()
    # "float" is not JSON Schema, but tool specs use it and vLLM reads it as a number.
    assert schema_types({"type": "float"}) == {"number"}
    assert schema_types({"type": ["float", "null"]}) == {"number", "null"}
    assert schema_types({"anyOf": [{"type": "float"}]}) == {"number"}


@pytest.mark.parametrize(
    ("value", "types", "expected"),
    [
        ("5", {"integer"}, 5),
        (" -3 ", {"integer"}, -3),
        ("5.5", {"integer"}, "5.5"),
        ("5.5", {"number"}, 5.5),
        ("7", {"number"}, 7),
        ("5.0", {"number"}, 5),
        ("-2.50", {"number"}, -2.5),
        ("1e3", {"number"}, 1000),
        ("3.14", {"float"}, "3.14"),  # coerce takes JSON types; schema_types maps "float" to "number"
        ("5.0", {"integer"}, "5.0"),
        ("1e999", {"number"}, "1e999"),
        ("NaN", {"number"}, "NaN"),
        ("True", {"boolean"}, True),
        ("no", {"boolean"}, "no"),
        ("null", {"string", "null"}, None),
        ("null", {"string"}, "null"),
        ('{"a": [1]}', {"object"}, {"a": [1]}),
        ("[1, 2]", {"array"}, [1, 2]),
        ("[1, 2]", {"object"}, "[1, 2]"),
        ("{bad", {"object"}, "{bad"),
    ],
)
def test_coerce(value: str, types: set[str], expected: Any) -> None:
    result = coerce(value, frozenset(types))
    assert result == expected and type(result) is type(expected)


def test_coder_value_newlines_and_fallback_name(tokenizer: Tokenizer) -> None:
    coder = ParserConfig(None, "qwen3_coder", enable_auto_tool_choice=True)
    parser = ChatParser(coder, tokenizer, _request(tools=[WEATHER]), None)
    text = "<function=get_weather>\n<parameter=city>\n\nTwo\nlines\n\n</parameter>\n</function>"
    message, finish = parser.parse(text, [], "stop")
    # Exactly one leading and one trailing newline are markup; <function= alone also starts a call.
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "\nTwo\nlines\n"}
    assert finish == "tool_calls"
    cut, _ = ChatParser(coder, tokenizer, _request(tools=[WEATHER]), None).parse(
        "Hi <tool_call>\n<function=get_wea", [], "length"
    )
    assert (cut.content, cut.tool_calls) == ("Hi <tool_call>\n<function=get_wea", [])


def test_coder_float_and_whole_number_parameters(tokenizer: Tokenizer) -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "measure",
            "parameters": {"type": "object", "properties": {"ratio": {"type": "float"}, "size": {"type": "number"}}},
        },
    }
    coder = ParserConfig(None, "qwen3_coder", enable_auto_tool_choice=True)
    text = "<tool_call>\n<function=measure>\n" + "".join(
        f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in (("ratio", "3.14"), ("size", "5.0"))
    ) + "</function>\n</tool_call>"
    message, _ = ChatParser(coder, tokenizer, _request(tools=[tool]), None).parse(text, [], "stop")
    assert message.tool_calls[0].function.arguments == '{"ratio": 3.14, "size": 5}'


@pytest.mark.parametrize(
    "text",
    [
        # vLLM regression inputs (PR #36774): a function tag without its '>' must not break parsing.
        "<tool_call>\n<function=get_current_weather\n<parameter=city>Dallas</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=bad_func_no_gt\n</function>\n</tool_call>\n<tool_call>\n<function=get_current_weather>\n"
        "<parameter=city>Dallas</parameter>\n<parameter=state>TX</parameter>\n</function>\n</tool_call>",
    ],
)
def test_coder_malformed_function_tags(tokenizer: Tokenizer, text: str) -> None:
    coder = ParserConfig(None, "qwen3_coder", enable_auto_tool_choice=True)
    message, _ = ChatParser(coder, tokenizer, _request(tools=[WEATHER]), None).parse(text, [], "stop")
    assert all(call.function.name for call in message.tool_calls)
    arguments = [json.loads(call.function.arguments) for call in message.tool_calls]
    if "bad_func_no_gt" in text:
        named = [a for c, a in zip(message.tool_calls, arguments, strict=True) if c.function.name == "get_current_weather"]
        assert named == [{"city": "Dallas", "state": "TX"}]
    folded = stream(ChatParser(coder, tokenizer, _request(tools=[WEATHER]), None), [(c, []) for c in text], "stop", True)
    assert_stream_matches_batch(folded, message, "tool_calls" if message.tool_calls else "stop", exact_args=True)


def test_setup_cli_args() -> None:
    assert Setup("qwen3", "hermes").cli_args() == [
        "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--enable-auto-tool-choice",
    ]  # fmt: skip
    assert Setup().cli_args() == []
