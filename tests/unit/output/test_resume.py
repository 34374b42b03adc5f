"""A resumed stream (``prior_output_chunks``): a choice state that replays the chunks a first leg sent
continues exactly as the uninterrupted state does, chunk for chunk — the same text, message deltas
(reasoning, content, tool calls), ids and finish — whatever the output, its chunking and the cut.

This is what decode-leg migration relies on: the client's stream, assembled from the first leg's chunks
and the resumed leg's, is the uninterrupted stream.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.output.request_state import ChoiceState, ChoiceUpdate, OutputConfig, RequestState
from pdserve.parsers import ChatParser, ParserConfig
from pdserve.protocol.engine import EngineOutput
from pdserve.protocol.generate import GenerateRequest
from pdserve.protocol.openai import ChatCompletionRequest
from pdserve.text.detokenizer import StopConfig
from pdserve.text.tokenizer import Tokenizer
from tests.fixtures.parser_cases import WEATHER

TOK = Tokenizer.load("qwen3")
CHAT = ChatCompletionRequest(messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER])
PROMPT = TOK.encode(TOK.apply_chat_template(CHAT.messages, add_generation_prompt=True))
PARSERS = ParserConfig("qwen3", "hermes", enable_auto_tool_choice=True)
PIECES = ["<think>", "</think>", "\n", "Let me", " check", " 中文", "é", "🙂", "<tool_call>", "</tool_call>",
          '{"name": "get_weather", "arguments": {"city": "Pa', 'ris"}}', " 42", "naïve", "Done."]


def _config(mode: str, stop: tuple[str, ...] = ()) -> OutputConfig:
    parsed = mode == "derender"
    factory = (lambda: ChatParser(PARSERS, TOK, CHAT, PROMPT)) if parsed else None
    return OutputConfig(mode=mode, prompt_token_ids=PROMPT, tokenizer=TOK, skip_special_tokens=not parsed,  # type: ignore[arg-type]
                        stop=StopConfig(stop, eos_token_ids=tuple(TOK.eos_token_ids)), parser_factory=factory,
                        streaming=True, want_logprobs=True, encoded_logprobs=True)


def _seen(update: ChoiceUpdate | None) -> tuple[object, ...] | None:
    """What an update sends, but a tool call's id: each parser makes up its own (a call that starts after
    the resume gets the new leg's id, sent once as always)."""
    if update is None:
        return None
    delta = None if update.delta is None else update.delta.model_dump(exclude_none=True)
    for call in (delta or {}).get("tool_calls") or []:
        call.pop("id", None)
    return update.text, delta, update.token_ids, update.finish_reason, update.stop_reason


def _output(chunk: list[int], last: bool) -> EngineOutput:
    return EngineOutput(request_id="r", index=0, new_token_ids=chunk, finish_reason="stop" if last else None)


streams = st.tuples(
    st.lists(st.sampled_from(PIECES), min_size=2, max_size=14).map(lambda p: TOK.encode("".join(p))),
    st.lists(st.integers(1, 40), max_size=10),
    st.integers(1, 40),
)


@pytest.mark.parametrize("mode", ["tokens", "text", "derender"])
@settings(max_examples=60, deadline=None)
@given(stream=streams)
def test_a_resumed_state_continues_as_the_uninterrupted_one(mode: str, stream: tuple[list[int], list[int], int]) -> None:
    ids, cuts, cut_at = stream
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(ids)}), len(ids)]
    chunks = [ids[a:b] for a, b in itertools.pairwise(bounds)]
    split = 1 + cut_at % len(chunks)
    config = _config(mode)
    whole = ChoiceState(0, config)
    sent = [_seen(whole.add(_output(c, i == len(chunks) - 1))) for i, c in enumerate(chunks)]
    # What the first leg sent: the ids of its chunks up to the cut, as a proxy saw them on the wire (ids
    # of a character not yet complete are not sent, so the new leg makes them again).
    prior = [list(s[2]) for s in sent[:split] if s is not None and s[2]]
    resumed = ChoiceState(0, config)
    resumed.resume(prior)
    pos = sum(len(c) for c in prior)
    rest = [ids[a:b] for a, b in itertools.pairwise([pos, *(b for b in bounds if b > pos)])]
    continued = [_seen(resumed.add(_output(c, i == len(rest) - 1))) for i, c in enumerate(rest)]
    if pos == bounds[split]:  # the cut fell where the first leg's chunks did: chunk for chunk the same
        assert continued == sent[split:]
    assembled = sent[:split] + continued
    assert _joined(assembled) == _joined(sent)
    assert resumed.token_ids == whole.token_ids
    assert resumed.text == whole.text
    if mode == "derender":
        assert _message(assembled) == _message(sent)


def _joined(seen: list[tuple[object, ...] | None]) -> tuple[str, list[int]]:
    """The text and the ids a client assembles from the updates."""
    steps = [s for s in seen if s is not None]
    return "".join(str(s[0]) for s in steps), [i for s in steps for i in s[2]]  # type: ignore[attr-defined]


def _message(seen: list[tuple[object, ...] | None]) -> dict[str, str]:
    """Reasoning, content and tool-call arguments as a client assembles them from the deltas."""
    out: dict[str, str] = {"reasoning": "", "content": "", "tools": ""}
    for step in seen:
        delta = step[1] if step else None
        if not isinstance(delta, dict):
            continue
        out["reasoning"] += delta.get("reasoning") or delta.get("reasoning_content") or ""
        out["content"] += delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            out["tools"] += (function.get("name") or "") + (function.get("arguments") or "")
    return out


def test_a_request_state_counts_prior_output_as_completion_tokens() -> None:
    request = GenerateRequest(token_ids=[*PROMPT, *TOK.encode("Hello there")], stream=True,
                              sampling_params={"max_tokens": 4}, output_mode="text",
                              prior_output_chunks=[len(TOK.encode("Hello there"))])
    state = RequestState("r", 1, _config("text"))
    state.resume(request.prior_output_chunk_ids)
    assert request.prompt_ids == PROMPT
    assert state.completion_tokens == len(TOK.encode("Hello there"))
    update = state.add(EngineOutput(request_id="r", index=0, new_token_ids=TOK.encode(" world")))
    assert update is not None and update.text == " world" and update.token_ids == TOK.encode(" world")


def test_text_held_back_for_a_stop_string_is_not_sent_twice() -> None:
    """The client has every prior id's text, so nothing of it is held back after the resume."""
    state = ChoiceState(0, _config("text", stop=("STOP here",)))
    state.resume([TOK.encode("one two")])
    update = state.add(_output(TOK.encode(" three"), True))
    assert update is not None and update.text == " three"
