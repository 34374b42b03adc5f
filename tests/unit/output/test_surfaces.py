"""The response surfaces (pdserve.output.surfaces): one emptiness rule per surface, and one builder for a
local choice state and a decode leg's relayed chunk: the proxy's answer (generate ``derender``/``text`` on
the decode leg, JSON over the wire, the chat/completions surface on the relayed choice) equals the coupled
endpoint's (the same surface on the choice state), chunk for chunk and for the batch answer."""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.output.policy import usage_of
from pdserve.output.request_state import ChoiceUpdate, OutputConfig, RequestState
from pdserve.output.surfaces import (
    GENERATE_SURFACES,
    ChatSurface,
    CompletionsSurface,
    DerenderSurface,
    Relayed,
    TextSurface,
    TokensSurface,
    generate_surface,
)
from pdserve.parsers import ChatParser
from pdserve.protocol.engine import EngineOutput, PositionLogprobs
from pdserve.protocol.generate import OutputMode
from pdserve.protocol.openai import (
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    DeltaMessage,
    TextDelta,
    UsageInfo,
)
from pdserve.text.detokenizer import StopConfig
from pdserve.text.logprobs import chat_top_limit, completion_top_limit
from tests.unit.output.test_stream_chunk import CHAT, PARSERS, PIECES, PROMPT, TOK

HIDDEN = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], include_reasoning=False,
                               tools=CHAT.tools)


def blank(payload: Any) -> bytes:
    """The wire bytes with what two builds never share blanked: clock reads and random tool call ids."""
    raw = msgspec.json.encode(payload)
    raw = re.sub(rb'"created":\d+', b'"created":0', raw)
    return re.sub(rb"chatcmpl-tool-[0-9a-f]+", b"chatcmpl-tool-*", raw)


def over_the_wire(chunk: dict[str, Any]) -> dict[str, Any]:
    """What the proxy reads of a decode leg's chunk: its JSON, parsed."""
    return json.loads(msgspec.json.encode(chunk))


def candidates(token: int, top: int | None) -> list[PositionLogprobs] | None:
    if top is None:
        return None
    return [PositionLogprobs([token, token, 13, 151643, 99, 102], [-0.25, -0.25, -1.0, -1e5, -2.5, -3.0],
                             [2, 2, 1, 3, 4, 5])]


def total_usage(states: list[RequestState]) -> UsageInfo:
    return usage_of(len(PROMPT), sum(s.completion_tokens for s in states))


def relayed_chat_answer(surface: ChatSurface, response: dict[str, Any]) -> dict[str, Any]:
    """The proxy's batch chat answer from a decode leg's generate ``derender`` response."""
    choices = [surface.relayed(c) for c in response["choices"]]
    usage = UsageInfo.model_validate(response.get("usage") or {})
    return surface.answer(choices, usage, prompt_token_ids=list(PROMPT),
                          kv_transfer_params=response.get("kv_transfer_params")).model_dump(mode="json")


def outputs(ids: list[int], top: int | None, finish: str) -> list[EngineOutput]:
    return [EngineOutput(request_id="r", new_token_ids=[t], new_logprobs=candidates(t, top),
                         finish_reason=finish if k == len(ids) - 1 else None) for k, t in enumerate(ids)]


def state(mode: OutputMode, streaming: bool, top: int | None, top_limit: int | None, encoded: bool,
          chat: ChatCompletionRequest | None = None) -> RequestState:
    factory = (lambda: ChatParser(PARSERS, TOK, chat, PROMPT)) if chat is not None else None
    return RequestState("r", 1, OutputConfig(
        mode=mode, prompt_token_ids=PROMPT, tokenizer=TOK, stop=StopConfig(eos_token_ids=tuple(TOK.eos_token_ids)),
        parser_factory=factory, streaming=streaming, skip_special_tokens=factory is None,
        want_logprobs=top is not None, top_logprobs_limit=top_limit, encoded_logprobs=encoded,
    ))


# ---------------------------------------------------------------- the registry


def test_every_output_mode_has_one_surface() -> None:
    assert set(GENERATE_SURFACES) == {"tokens", "text", "derender"}
    for mode, surface in GENERATE_SURFACES.items():
        assert surface.output_mode == mode and generate_surface(mode) is surface
        assert surface("r", "m").labels == ("generate", mode)
    assert ChatSurface("c", "m").labels == ("chat", "derender")
    assert CompletionsSurface("c", "m").labels == ("completions", "text")


# ---------------------------------------------------------------- the emptiness rule

deltas = st.sampled_from([None, TextDelta(), TextDelta(content="x"), TextDelta(reasoning="r"),
                          DeltaMessage(), DeltaMessage(content="y")])


@given(ids=st.lists(st.integers(0, 9), max_size=2), text=st.sampled_from(["", "a"]), delta=deltas,
       finish=st.sampled_from([None, "stop"]), entries=st.sampled_from([None, b"[]", b'[{"token":"a"}]']),
       return_ids=st.booleans())
def test_a_step_makes_a_chunk_exactly_when_its_surface_says_it_carries_one(
        ids: list[int], text: str, delta: Any, finish: str | None, entries: bytes | None, return_ids: bool) -> None:
    update = ChoiceUpdate(0, ids, None, text=text, delta=delta, logprobs_json=entries, finish_reason=finish)
    delta_empty = delta is None or delta.is_empty()
    # The rules as each endpoint has always written them.
    expected = {
        DerenderSurface: bool(ids or text or not delta_empty or finish),
        TextSurface: bool(ids or text or finish),
        TokensSurface: bool(ids or finish),
        ChatSurface: bool(not delta_empty or finish or entries not in (None, b"[]") or (return_ids and ids)),
        CompletionsSurface: bool(text or finish or ids),
    }
    for kind, carries in expected.items():
        surface = kind("r", "m", return_token_ids=return_ids) if kind in (ChatSurface, CompletionsSurface) \
            else kind("r", "m")  # type: ignore[call-arg]
        assert surface.carries(update) is carries, kind
        assert (surface.chunk(update) is not None) is carries, kind
    # A relayed choice is asked the same question.
    relayed = Relayed({"index": 0, "token_ids": ids, "text": text, "finish_reason": finish},
                      json.loads(entries) if entries is not None else None, delta=delta)
    chat = ChatSurface("c", "m", return_token_ids=return_ids)
    assert chat.carries(relayed) is expected[ChatSurface]
    assert CompletionsSurface("c", "m").carries(relayed) is expected[CompletionsSurface]


# ---------------------------------------------------------------- local and relayed agree


@settings(max_examples=60, deadline=None)
@given(pieces=st.lists(st.sampled_from(PIECES), min_size=1, max_size=8), finish=st.sampled_from(["stop", "length"]),
       parsed=st.booleans(), top=st.none() | st.integers(0, 3), return_ids=st.booleans())
def test_chat_from_a_relayed_derender_chunk_equals_chat_from_the_choice_state(
        pieces: list[str], finish: str, parsed: bool, top: int | None, return_ids: bool) -> None:
    ids = TOK.encode("".join(pieces))
    chat = CHAT if parsed else None
    # The decode leg (generate derender) and the coupled chat endpoint run the same state; chat's cut.
    rstate = state("derender", True, top, chat_top_limit(top), True, chat)
    leg = DerenderSurface("generate-tokens-r", "m", want_logprobs=top is not None)
    local = ChatSurface("chatcmpl-r", "m", return_token_ids=return_ids)
    proxied = ChatSurface("chatcmpl-r", "m", return_token_ids=return_ids)
    assert blank(local.opening()) == blank(proxied.opening())
    for out in outputs(ids, top, finish):
        update = rstate.add(out)
        assert update is not None
        mine = local.chunk(update)
        decoded = leg.chunk(update)
        theirs = proxied.relayed_chunk(over_the_wire(decoded)["choices"], None) if decoded is not None else None
        assert blank(mine) == blank(theirs)


@settings(max_examples=40, deadline=None)
@given(pieces=st.lists(st.sampled_from(PIECES), min_size=1, max_size=8), finish=st.sampled_from(["stop", "length"]),
       parsed=st.booleans(), hidden=st.booleans(), top=st.none() | st.integers(0, 3), return_ids=st.booleans())
def test_the_chat_batch_answer_from_a_relayed_response_equals_the_local_one(
        pieces: list[str], finish: str, parsed: bool, hidden: bool, top: int | None, return_ids: bool) -> None:
    ids = TOK.encode("".join(pieces))
    chat = (HIDDEN if hidden else CHAT) if parsed else None
    rstate = state("derender", False, top, chat_top_limit(top), False, chat)
    for out in outputs(ids, top, finish):
        rstate.add(out)
    usage = total_usage([rstate])
    local = ChatSurface("chatcmpl-r", "m", return_token_ids=return_ids).batch([rstate], usage)
    leg = DerenderSurface("generate-tokens-r", "m", want_logprobs=top is not None).batch([rstate], usage)
    proxied = relayed_chat_answer(ChatSurface("chatcmpl-r", "m", return_token_ids=return_ids),
                                  over_the_wire(leg.model_dump(mode="json")))
    assert blank(local.model_dump(mode="json")) == blank(proxied)


@settings(max_examples=60, deadline=None)
@given(pieces=st.lists(st.sampled_from(PIECES), min_size=1, max_size=8), finish=st.sampled_from(["stop", "length"]),
       top=st.none() | st.integers(0, 3), return_ids=st.booleans(), stream=st.booleans())
def test_completions_from_relayed_text_equal_completions_from_the_choice_state(
        pieces: list[str], finish: str, top: int | None, return_ids: bool, stream: bool) -> None:
    ids = TOK.encode("".join(pieces))
    # The coupled endpoint cuts candidates as it decodes; the decode leg sends every one and the proxy cuts.
    mine_state = state("text", stream, top, completion_top_limit(top), False)
    leg_state = state("text", stream, top, None, stream)
    local = CompletionsSurface("cmpl-r", "m", return_token_ids=return_ids, logprobs=top)
    proxied = CompletionsSurface("cmpl-r", "m", return_token_ids=return_ids, logprobs=top)
    leg = TextSurface("generate-tokens-r", "m", want_logprobs=top is not None)
    for out in outputs(ids, top, finish):
        mine, theirs = mine_state.add(out), leg_state.add(out)
        assert mine is not None and theirs is not None
        if stream:
            decoded = leg.chunk(theirs)
            relayed = proxied.chunk(proxied.relayed(over_the_wire(decoded)["choices"][0])) if decoded else None
            assert blank(local.chunk(mine)) == blank(relayed)
    if not stream:
        usage = total_usage([mine_state])
        answer = leg.batch([leg_state], usage)
        response = over_the_wire(answer.model_dump(mode="json"))
        relayed_choices = [proxied.relayed(c, list(PROMPT)) for c in response["choices"]]
        proxied_answer = proxied.answer([relayed_choices], UsageInfo.model_validate(response["usage"])).model_dump(
            mode="json")
        assert blank(local.batch([mine_state], usage).model_dump(mode="json")) == blank(proxied_answer)


def test_completions_text_offsets_run_per_choice_across_prompts() -> None:
    surface = CompletionsSurface("cmpl-r", "m", n=2)
    entries = [msgspec.json.decode(b'{"token":"ab","logprob":-1.0,"bytes":null,"top_logprobs":[]}')]
    relayed = [Relayed({"index": i, "text": "ab", "token_ids": [1]},
                       [ChatCompletionLogProbsContent.model_validate(e) for e in entries]) for i in (0, 1)]
    first = surface.chunk(relayed[0], prompt=1)
    again = surface.chunk(relayed[0], prompt=1)
    other = surface.chunk(relayed[1], prompt=0)
    assert first is not None and again is not None and other is not None
    assert first["choices"][0]["index"] == 2 and other["choices"][0]["index"] == 1
    assert first["choices"][0]["logprobs"]["text_offset"] == [0]
    assert again["choices"][0]["logprobs"]["text_offset"] == [2]
    assert other["choices"][0]["logprobs"]["text_offset"] == [0]


def test_the_usage_chunk_closes_only_when_asked() -> None:
    usage = total_usage([state("text", True, None, None, False)])
    assert ChatSurface("c", "m").closing(usage) == []
    (chunk,) = ChatSurface("c", "m", include_usage=True).closing(usage)
    assert chunk == {"id": "c", "object": "chat.completion.chunk", "model": "m", "choices": [],
                     "usage": {"prompt_tokens": len(PROMPT), "total_tokens": len(PROMPT), "completion_tokens": 0}}
    (gen,) = TokensSurface("g", "m", include_usage=True).closing(usage)
    assert gen["request_id"] == "g" and gen["output_mode"] == "tokens"
