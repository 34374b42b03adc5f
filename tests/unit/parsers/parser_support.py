"""Helpers for the parser tests: build parsers for cases, stream in chunks, fold deltas, compare."""

from __future__ import annotations

import functools
import itertools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenizers.decoders import DecodeStream

from pdserve.parsers import ChatParser, ParserConfig
from pdserve.protocol.openai import ChatCompletionRequest, ChatMessage, StreamDelta
from pdserve.text.tokenizer import Tokenizer
from tests.fixtures.parser_cases import CASES_BY_NAME, ParserCase, Setup

TOOL_CALL_ID = re.compile(r"chatcmpl-tool-[0-9a-f]{32}")


def parser_config(setup: Setup) -> ParserConfig:
    return ParserConfig(setup.reasoning, setup.tools, enable_auto_tool_choice=setup.tools is not None)


def render_prompt_ids(tokenizer: Tokenizer, request: ChatCompletionRequest) -> list[int]:
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools else None
    text = tokenizer.apply_chat_template(
        request.messages,
        tools=tools,
        add_generation_prompt=request.add_generation_prompt,
        continue_final_message=request.continue_final_message,
        **(request.chat_template_kwargs or {}),
    )
    return tokenizer.encode(text)


@functools.cache
def _case_prompt_ids(tokenizer: Tokenizer, case_name: str) -> tuple[int, ...]:
    return tuple(render_prompt_ids(tokenizer, ChatCompletionRequest(**CASES_BY_NAME[case_name].request)))


def make_parser(tokenizer: Tokenizer, case: ParserCase, setup: Setup) -> ChatParser:
    """A parser for the case, primed with the case's rendered prompt."""
    request = ChatCompletionRequest(**case.request)
    return ChatParser(parser_config(setup), tokenizer, request, _case_prompt_ids(tokenizer, case.name))


def token_pieces(tokenizer: Tokenizer, ids: Sequence[int]) -> list[str]:
    """Per-token text as an incremental detokenizer emits it ("" while a multi-byte char is incomplete)."""
    stream = DecodeStream(skip_special_tokens=False)
    pieces = [stream.step(tokenizer.hf, token_id) or "" for token_id in ids]
    assert "".join(pieces) == tokenizer.decode(ids)
    return pieces


def chunk_steps(pieces: Sequence[str], ids: Sequence[int], cuts: Sequence[int]) -> list[tuple[str, list[int]]]:
    """Group consecutive tokens into engine steps, cutting before each index in ``cuts``."""
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(ids)}), len(ids)]
    return [("".join(pieces[a:b]), list(ids[a:b])) for a, b in itertools.pairwise(bounds) if b > a]


@dataclass
class Folded:
    """Deltas of one choice folded back into a message."""

    content: str | None = None
    reasoning: str | None = None
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    finish_reason: str | None = None


def _append(current: str | None, text: str | None) -> str | None:
    if text is None:
        return current
    assert text != "", "deltas never carry empty strings"
    return (current or "") + text


def fold(deltas: Sequence[StreamDelta], finish_reason: str | None) -> Folded:
    folded = Folded(finish_reason=finish_reason)
    for delta in deltas:
        assert not delta.is_empty(), "an empty delta is returned as None"
        folded.content = _append(folded.content, delta.content)
        folded.reasoning = _append(folded.reasoning, delta.reasoning)
        for call in delta.tool_calls:
            assert call.function is not None
            if call.index not in folded.calls:
                # The first delta of a call carries id, type and name.
                assert call.id is not None and TOOL_CALL_ID.fullmatch(call.id), call
                assert call.type == "function" and call.function.name, call
                folded.calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
            else:
                assert call.id is None and call.type is None and call.function.name is None, call
            folded.calls[call.index]["arguments"] += call.function.arguments or ""
    assert list(folded.calls) == list(range(len(folded.calls))), "tool calls are indexed 0, 1, ... in order"
    return folded


def stream(
    parser: ChatParser, steps: Sequence[tuple[str, list[int]]], finish_reason: str, separate_finish: bool
) -> Folded:
    """Feed the steps; the finish reason rides on the last step, or on an extra empty step."""
    deltas: list[StreamDelta] = []
    resolved: str | None = None
    for i, (text, ids) in enumerate(steps):
        last = i == len(steps) - 1 and not separate_finish
        delta, resolved = parser.step(text, ids, finish_reason if last else None)
        assert (resolved is None) != last
        if delta is not None:
            deltas.append(delta)
    if separate_finish or not steps:
        delta, resolved = parser.step("", [], finish_reason)
        if delta is not None:
            deltas.append(delta)
    return fold(deltas, resolved)


def assert_stream_matches_batch(folded: Folded, message: ChatMessage, finish_reason: str, exact_args: bool) -> None:
    """Folded deltas == the batch message; a delta never carries "", so "" and None fold alike."""
    assert (folded.content or "") == (message.content or "")
    assert folded.reasoning == (message.reasoning or None)
    assert folded.finish_reason == finish_reason
    assert [c["name"] for c in folded.calls.values()] == [c.function.name for c in message.tool_calls]
    for streamed, call in zip(folded.calls.values(), message.tool_calls, strict=True):
        assert json.loads(streamed["arguments"]) == json.loads(call.function.arguments)
        if exact_args:
            assert streamed["arguments"] == call.function.arguments


def assert_matches_case(message: ChatMessage, finish_reason: str, case: ParserCase) -> None:
    assert message.content == case.content
    assert message.reasoning == case.reasoning
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        (c.name, c.arguments) for c in case.tool_calls
    ]
    for call in message.tool_calls:
        assert TOOL_CALL_ID.fullmatch(call.id) and call.type == "function"
    assert finish_reason == case.finish_reason
