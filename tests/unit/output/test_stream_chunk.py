"""The hot-path stream chunks (generate's, and the coupled chat stream's: plain dicts, with ``text``'s decoded
logprobs as plain structs) encode, key for key and in key order, to what the wire models dump, for any output
of any mode (derender with the qwen3 + hermes parsers), finish, usage/metrics and logprobs."""

from __future__ import annotations

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from pdserve.output.generate_builders import model_stream_chunk, stream_chunk
from pdserve.output.openai_builders import chat_chunk, model_chat_chunk
from pdserve.output.request_state import OutputConfig, RequestState
from pdserve.parsers import ChatParser, ParserConfig
from pdserve.protocol.engine import EngineOutput, PositionLogprobs
from pdserve.protocol.openai import ChatCompletionRequest, UsageInfo
from pdserve.text.detokenizer import StopConfig
from pdserve.text.tokenizer import Tokenizer

TOK = Tokenizer.load("qwen3")
PIECES = ["Paris", " is", " 中文", "é", "🙂", "\n", " 42", "naïve", "<think>", "</think>", "<tool_call>",
          '{"name": "f", "arguments": {"x": 1}}', "</tool_call>"]
PROMPT = TOK.encode("Hello")
CHAT = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                             tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
PARSERS = ParserConfig("qwen3", "hermes", enable_auto_tool_choice=True)


@given(
    mode=st.sampled_from(["tokens", "text", "derender"]),
    pieces=st.lists(st.sampled_from(PIECES), min_size=1, max_size=8),
    finish=st.sampled_from(["stop", "length", "abort"]),
    stop_reason=st.none() | st.integers(0, 5),
    with_usage=st.booleans(),
    with_metrics=st.booleans(),
    top=st.none() | st.integers(0, 4),
)
def test_plain_chunks_equal_the_models_dump(mode: str, pieces: list[str], finish: str, stop_reason: int | None,
                                            with_usage: bool, with_metrics: bool, top: int | None) -> None:
    ids = TOK.encode("".join(pieces))
    factory = (lambda: ChatParser(PARSERS, TOK, CHAT, PROMPT)) if mode == "derender" else None
    config = OutputConfig(mode=mode, prompt_token_ids=PROMPT, tokenizer=TOK,  # type: ignore[arg-type]
                          stop=StopConfig(eos_token_ids=tuple(TOK.eos_token_ids)), parser_factory=factory,
                          streaming=True, skip_special_tokens=mode != "derender", want_logprobs=top is not None,
                          top_logprobs_limit=top)
    state = RequestState("generate-tokens-x#1", 1, config)
    usage = UsageInfo(prompt_tokens=3, completion_tokens=len(ids), total_tokens=3 + len(ids)) if with_usage else None
    metrics = {"time_to_first_token_ms": 1.5, "mean_itl_ms": None} if with_metrics else None
    first = True
    for k, token in enumerate(ids):
        last = k == len(ids) - 1
        # The sampled id first, then candidates (one repeats it, as an engine's top-k may), a NaN and a floor.
        logprobs = None if top is None else [PositionLogprobs(
            [token, token, 13, 151643, 99], [-0.25, -0.25, float("nan"), -1e5, -2.5], [2, 2, 1, 3, 4])]
        out = EngineOutput(request_id="generate-tokens-x#1", new_token_ids=[token], new_logprobs=logprobs,
                           finish_reason=finish if last else None, stop_reason=stop_reason if last else None)
        update = state.add(out)
        if update is None:
            continue
        fast = stream_chunk(state, update, usage, first_for_choice=first, metrics=metrics)
        reference = model_stream_chunk(state, update, usage, first_for_choice=first, metrics=metrics)
        # What goes on the wire: same keys, same order, same values.
        assert msgspec.json.encode(fast) == msgspec.json.encode(reference)
        first = False


@given(
    pieces=st.lists(st.sampled_from(PIECES), min_size=1, max_size=8),
    finish=st.sampled_from(["stop", "length", "abort"]),
    stop_reason=st.none() | st.integers(0, 5),
    with_usage=st.booleans(),
    with_metrics=st.booleans(),
    return_ids=st.booleans(),
    parsed=st.booleans(),
    top=st.none() | st.integers(0, 4),
)
def test_plain_chat_chunks_equal_the_models_dump(pieces: list[str], finish: str, stop_reason: int | None,
                                                 with_usage: bool, with_metrics: bool, return_ids: bool, parsed: bool,
                                                 top: int | None) -> None:
    """The coupled chat stream's chunk (openai_builders.chat_chunk), plain where it can be, against the models."""
    ids = TOK.encode("".join(pieces))
    factory = (lambda: ChatParser(PARSERS, TOK, CHAT, PROMPT)) if parsed else None
    config = OutputConfig(mode="derender", prompt_token_ids=PROMPT, tokenizer=TOK,
                          stop=StopConfig(eos_token_ids=tuple(TOK.eos_token_ids)), parser_factory=factory,
                          streaming=True, skip_special_tokens=False, want_logprobs=top is not None,
                          top_logprobs_limit=top)
    state = RequestState("chatcmpl-x", 1, config)
    usage = UsageInfo(prompt_tokens=3, completion_tokens=len(ids), total_tokens=3 + len(ids)) if with_usage else None
    metrics = {"time_to_first_token_ms": 1.5, "mean_itl_ms": None} if with_metrics else None
    for k, token in enumerate(ids):
        last = k == len(ids) - 1
        logprobs = None if top is None else [PositionLogprobs([token, 13], [-0.25, -1.5], [1, 2])]
        update = state.add(EngineOutput(request_id="chatcmpl-x", new_token_ids=[token], new_logprobs=logprobs,
                                        finish_reason=finish if last else None,
                                        stop_reason=stop_reason if last else None))
        if update is None:
            continue
        choice = state.choices[0]
        fast = chat_chunk(choice, update, "chatcmpl-x", "m", return_ids, usage, metrics=metrics)
        reference = model_chat_chunk(choice, update, "chatcmpl-x", "m", return_ids, usage, metrics=metrics)
        reference["created"] = fast["created"]  # a clock read apart
        assert msgspec.json.encode(fast) == msgspec.json.encode(reference)
