"""The stream chunks (generate's, and the coupled chat stream's) are plain dicts, with logprob content as
JSON written ahead (text.logprob_json) or as structs. Each encodes, key for key and in key order, to what
the wire models dump (the references below, built from a struct-logprob state fed the same outputs), for
any output of any mode (derender with the qwen3 + hermes parsers), finish, usage/metrics and logprobs."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from pdserve.output.policy import assistant_delta
from pdserve.output.request_state import ChoiceState, ChoiceUpdate, OutputConfig, RequestState
from pdserve.output.surfaces import ChatSurface, generate_surface
from pdserve.parsers import ChatParser, ParserConfig
from pdserve.protocol.engine import EngineOutput, PositionLogprobs
from pdserve.protocol.generate import (
    GenerateDerenderStreamChoice,
    GenerateDerenderStreamResponse,
    GenerateLogProbs,
    GenerateTextStreamChoice,
    GenerateTextStreamResponse,
    GenerateTokensStreamChoice,
    GenerateTokensStreamResponse,
)
from pdserve.protocol.openai import (
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    DeltaMessage,
    StreamDelta,
    TextDelta,
    UsageInfo,
)
from pdserve.text.detokenizer import StopConfig
from pdserve.text.logprobs import to_generate_logprobs
from pdserve.text.tokenizer import Tokenizer

TOK = Tokenizer.load("qwen3")
PIECES = ["Paris", " is", " 中文", "é", "🙂", "🦩", "\n", " 42", "naïve", "<think>", "</think>", "<tool_call>",
          '{"name": "f", "arguments": {"x": 1}}', "</tool_call>"]
PROMPT = TOK.encode("Hello")
CHAT = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                             tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
PARSERS = ParserConfig("qwen3", "hermes", enable_auto_tool_choice=True)


def model_stream_chunk(state: RequestState, update: ChoiceUpdate, usage: UsageInfo | None, first_for_choice: bool,
                       metrics: dict[str, Any] | None = None) -> dict:
    """A generate stream chunk through the wire models."""
    cfg = state.config
    fields: dict[str, Any] = dict(
        index=update.index, finish_reason=update.finish_reason, stop_reason=update.stop_reason,
        token_ids=update.token_ids,
    )
    chunk: Any
    if cfg.mode == "tokens":
        logprobs = None
        if cfg.want_logprobs and update.logprobs is not None:
            logprobs = GenerateLogProbs(content=to_generate_logprobs(update.logprobs, update.token_ids))
        chunk = GenerateTokensStreamResponse(
            request_id=state.request_id, usage=usage, metrics=metrics,
            choices=[GenerateTokensStreamChoice(logprobs=logprobs, **fields)],
        )
    elif cfg.mode == "text":
        text_logprobs = None
        if cfg.want_logprobs and update.decoded_logprobs is not None:
            text_logprobs = ChatCompletionLogProbs(content=update.decoded_logprobs)
        chunk = GenerateTextStreamResponse(
            request_id=state.request_id, usage=usage, metrics=metrics,
            choices=[GenerateTextStreamChoice(text=update.text, logprobs=text_logprobs, **fields)],
        )
    else:
        hide = state.choices[update.index].hides_metadata
        delta = as_model(assistant_delta(update.delta) if first_for_choice else update.delta)
        chat_logprobs = None
        if cfg.want_logprobs and update.decoded_logprobs is not None and not hide:
            chat_logprobs = ChatCompletionLogProbs(content=update.decoded_logprobs)
        if hide:
            fields["token_ids"] = None
        chunk = GenerateDerenderStreamResponse(
            request_id=state.request_id, usage=usage, metrics=metrics,
            choices=[GenerateDerenderStreamChoice(delta=delta, logprobs=chat_logprobs, **fields)],
        )
    # vLLM omits these optional keys when null.
    omitted = {name for name in ("prompt_token_ids", "metrics") if getattr(chunk, name) is None}
    return chunk.model_dump(mode="json", exclude=omitted)


def as_model(delta: StreamDelta | None) -> DeltaMessage:
    """The wire model of a stream delta (a plain TextDelta included), for the reference builders."""
    if delta is None:
        return DeltaMessage()
    return delta.message() if isinstance(delta, TextDelta) else delta


def model_chat_chunk(choice_state: ChoiceState, update: ChoiceUpdate, response_id: str, model: str,
                     return_token_ids: bool, usage: UsageInfo | None, metrics: dict[str, Any] | None = None) -> dict:
    """A chat stream chunk through the wire models."""
    hide = choice_state.hides_metadata
    logprobs = update.decoded_logprobs if choice_state.config.want_logprobs else None
    choice = ChatCompletionResponseStreamChoice(
        index=update.index,
        delta=as_model(update.delta),
        logprobs=ChatCompletionLogProbs(content=logprobs) if logprobs is not None and not hide else None,
        finish_reason=update.finish_reason,
        stop_reason=update.stop_reason,
        token_ids=update.token_ids if return_token_ids and not hide else None,
    )
    return ChatCompletionStreamResponse(
        id=response_id, model=model, choices=[choice], usage=usage, metrics=metrics
    ).model_dump(mode="json")


def wire(chunk: dict) -> bytes:
    """A chunk's bytes, tool call ids (random, drawn by each state's own parser) blanked."""
    return blank_tool_ids(msgspec.json.encode(chunk))


def blank_tool_ids(encoded: bytes) -> bytes:
    return re.sub(rb"chatcmpl-tool-[0-9a-f]+", b"chatcmpl-tool-*", encoded)


def candidates(token: int, top: int | None) -> list[PositionLogprobs] | None:
    """The sampled id first, then candidates: one repeats it (as an engine's top-k may), a NaN, a floor,
    a split-character piece (its text depends on the ids before)."""
    if top is None:
        return None
    return [PositionLogprobs([token, token, 13, 151643, 99, 102], [-0.25, -0.25, float("nan"), -1e5, -2.5, -3.0],
                             [2, 2, 1, 3, 4, 5])]


def twin_updates(state: RequestState, reference_state: RequestState, ids: list[int], top: int | None, finish: str,
                 stop_reason: int | None) -> Iterator[tuple[ChoiceUpdate, ChoiceUpdate]]:
    """Feed ``ids`` one per output (the finish on the last) to both states; yield their updates where
    there are any (the two states always agree on that)."""
    for k, token in enumerate(ids):
        last = k == len(ids) - 1
        out = EngineOutput(request_id=state.request_id, new_token_ids=[token], new_logprobs=candidates(token, top),
                           finish_reason=finish if last else None, stop_reason=stop_reason if last else None)
        update, reference_update = state.add(out), reference_state.add(out)
        if update is None:
            assert reference_update is None
            continue
        assert reference_update is not None
        yield update, reference_update


def usage_and_metrics(ids: list[int], with_usage: bool,
                      with_metrics: bool) -> tuple[UsageInfo | None, dict[str, Any] | None]:
    usage = UsageInfo(prompt_tokens=3, completion_tokens=len(ids), total_tokens=3 + len(ids)) if with_usage else None
    return usage, {"time_to_first_token_ms": 1.5, "mean_itl_ms": None} if with_metrics else None


def twin_states(request_id: str, encoded: bool = True, **config: Any) -> tuple[RequestState, RequestState]:
    """The state under test (logprobs as JSON where asked) and the reference's (logprobs as structs)."""
    return (RequestState(request_id, 1, OutputConfig(encoded_logprobs=encoded, **config)),
            RequestState(request_id, 1, OutputConfig(**config)))


@given(
    mode=st.sampled_from(["tokens", "text", "derender"]),
    pieces=st.lists(st.sampled_from(PIECES), min_size=1, max_size=8),
    finish=st.sampled_from(["stop", "length", "abort"]),
    stop_reason=st.none() | st.integers(0, 5),
    with_usage=st.booleans(),
    with_metrics=st.booleans(),
    top=st.none() | st.integers(0, 4),
    encoded=st.booleans(),
    as_event=st.booleans(),
)
def test_plain_chunks_equal_the_models_dump(mode: str, pieces: list[str], finish: str, stop_reason: int | None,
                                            with_usage: bool, with_metrics: bool, top: int | None,
                                            encoded: bool, as_event: bool) -> None:
    """``as_event``: the chunks as the stream writes them (GenerateSurface.event: a running step's bytes from
    the choice's template), else as dicts (GenerateSurface.build)."""
    ids = TOK.encode("".join(pieces))
    factory = (lambda: ChatParser(PARSERS, TOK, CHAT, PROMPT)) if mode == "derender" else None
    state, reference_state = twin_states(
        "generate-%d-100%-x#1", encoded, mode=mode, prompt_token_ids=PROMPT, tokenizer=TOK,
        stop=StopConfig(eos_token_ids=tuple(TOK.eos_token_ids)), parser_factory=factory, streaming=True,
        skip_special_tokens=mode != "derender", want_logprobs=top is not None, top_logprobs_limit=top,
    )
    usage, metrics = usage_and_metrics(ids, with_usage, with_metrics)
    surface = generate_surface(mode)(state.request_id, "m", want_logprobs=top is not None)  # type: ignore[arg-type]
    first = True
    for update, reference_update in twin_updates(state, reference_state, ids, top, finish, stop_reason):
        reference = model_stream_chunk(reference_state, reference_update, usage, first_for_choice=first,
                                       metrics=metrics)
        # What goes on the wire: same keys, same order, same values.
        if as_event:
            assert blank_tool_ids(surface.event(update, usage, metrics)) == b"data: " + wire(reference) + b"\n\n"
        else:
            assert wire(surface.build(update, usage, metrics)) == wire(reference)
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
    encoded=st.booleans(),
)
def test_plain_chat_chunks_equal_the_models_dump(pieces: list[str], finish: str, stop_reason: int | None,
                                                 with_usage: bool, with_metrics: bool, return_ids: bool, parsed: bool,
                                                 top: int | None, encoded: bool) -> None:
    """The coupled chat stream's chunk (ChatSurface.build) against the models."""
    ids = TOK.encode("".join(pieces))
    factory = (lambda: ChatParser(PARSERS, TOK, CHAT, PROMPT)) if parsed else None
    state, reference_state = twin_states(
        "chatcmpl-x", encoded, mode="derender", prompt_token_ids=PROMPT, tokenizer=TOK,
        stop=StopConfig(eos_token_ids=tuple(TOK.eos_token_ids)), parser_factory=factory, streaming=True,
        skip_special_tokens=False, want_logprobs=top is not None, top_logprobs_limit=top,
    )
    usage, metrics = usage_and_metrics(ids, with_usage, with_metrics)
    surface = ChatSurface("chatcmpl-x", "m", return_token_ids=return_ids)
    for update, reference_update in twin_updates(state, reference_state, ids, top, finish, stop_reason):
        assert update.has_logprob_entries == reference_update.has_logprob_entries
        assert update.hides_metadata == state.choices[0].hides_metadata
        fast = surface.build(update, usage, metrics)
        reference = model_chat_chunk(reference_state.choices[0], reference_update, "chatcmpl-x", "m", return_ids,
                                     usage, metrics=metrics)
        reference["created"] = fast["created"]  # a clock read apart
        assert wire(fast) == wire(reference)
