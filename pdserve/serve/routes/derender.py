"""Stateless ``/derender`` endpoints: the compatibility path and the benchmark baseline.

They rebuild request state by *replaying* token ids into the same
:class:`~pdserve.output.request_state.ChoiceState` (detokenizer, parser,
logprob decoder) that the inline path uses, so their output equals inline
output by construction. Streaming calls carry their state on the client: the
parsed path replays every earlier chunk (O(n) per call, as in vLLM), the plain
path replays only a short tail to rebuild a split multi-byte character.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from pdserve.engine.api import EngineOutput, PositionLogprobs
from pdserve.output.generate_builders import usage_of
from pdserve.output.openai_builders import chat_chunk, completion_chunk, completion_response
from pdserve.output.request_state import ChoiceState, ChoiceUpdate, OutputConfig, RequestState
from pdserve.protocol.derender import (
    DerenderChatStreamRequest,
    DerenderCompletionStreamRequest,
    DerenderStreamState,
    chat_derender_adapter,
    completion_derender_adapter,
)
from pdserve.protocol.errors import RequestError
from pdserve.protocol.generate import GenerateLogProbs, GenerateTokensChoice, GenerateTokensStreamChoice
from pdserve.protocol.openai import (
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    CompletionRequest,
    UsageInfo,
)
from pdserve.serve.app import AppState, app_state, parse_body
from pdserve.serve.parsing import make_parser_factory, parsers_configured
from pdserve.serve.render import require_tokenizer
from pdserve.text.detokenizer import StopConfig
from pdserve.text.logprobs import LogprobDecoder

router = APIRouter()

# Plain-path replay window: enough ids to rebuild any character split across tokens.
PLAIN_REPLAY_IDS = 8
DEFAULT_MAX_LEN = 131072
MAX_LOGPROBS = 20


def _max_len(state: AppState) -> int:
    if state.engine is not None:
        return state.engine.info.max_model_len
    return state.config.max_model_len or DEFAULT_MAX_LEN


def positions_of(logprobs: GenerateLogProbs | None) -> list[PositionLogprobs] | None:
    """Tokens-level logprobs back into engine positions (sampled first, then candidates)."""
    if logprobs is None or logprobs.content is None:
        return None
    out = []
    for entry in logprobs.content:
        ids = [entry.token_id] + [t.token_id for t in entry.top_logprobs]
        lps = [entry.logprob] + [t.logprob for t in entry.top_logprobs]
        ranks = [entry.rank or 0] + [t.rank or 0 for t in entry.top_logprobs]
        out.append(PositionLogprobs(ids, lps, ranks))
    return out


def _eos_token_ids(state: AppState) -> tuple[int, ...]:
    """The model's EOS ids, primary first: the engine's where there is one (so derender agrees with
    generate on the same server), else those of the tokenizer dir (a render server)."""
    if state.engine is not None:
        return tuple(state.engine.info.eos_token_ids)
    return state.tokenizer.eos_token_ids if state.tokenizer is not None else ()


def _stop_tokens_config(state: AppState, request: ChatCompletionRequest | CompletionRequest | None) -> StopConfig:
    """What tells a stop token at the end of a response: the request's stop ids, the model's EOS ids."""
    if request is None:
        return StopConfig(eos_token_ids=_eos_token_ids(state))
    return StopConfig(
        include_stop_str_in_output=request.include_stop_str_in_output, min_tokens=request.min_tokens,
        stop_token_ids=frozenset(request.stop_token_ids or ()), eos_token_ids=_eos_token_ids(state),
        ignore_eos=request.ignore_eos,
    )


def _stop_config(
    state: AppState, finish_reason: str | None, stop_reason: int | str | None,
    request: ChatCompletionRequest | CompletionRequest | None,
) -> StopConfig:
    """Batch derender: stop strings to re-cut with, as vLLM does. None unless the response finished
    with "stop" and no stop token id; the matched string when the engine reported one (tokens mode
    returns the ids up to the one that completed it); else the request's list."""
    config = _stop_tokens_config(state, request)
    if finish_reason != "stop" or isinstance(stop_reason, int):
        return config
    if isinstance(stop_reason, str):
        return replace(config, stop=(stop_reason,))
    stops = request.stop if request else None
    if isinstance(stops, str):
        stops = [stops]
    return replace(config, stop=tuple(s for s in stops or () if s))


def _check_bounds(state: AppState, choices: Sequence[GenerateTokensChoice], prompt_ids: Sequence[int] | None) -> None:
    limit = _max_len(state)
    if prompt_ids is not None and len(prompt_ids) > limit:
        raise RequestError(f"prompt_token_ids has {len(prompt_ids)} ids, over the model length {limit}")
    for c in choices:
        if not c.token_ids:
            raise RequestError(f"choice {c.index} has empty or null token_ids")
        if len(c.token_ids) > limit:
            raise RequestError(f"choice {c.index} has {len(c.token_ids)} token ids, over the model length {limit}")
        if any(t < 0 or t >= state.tokenizer.vocab_size for t in c.token_ids):  # type: ignore[union-attr]
            raise RequestError(f"choice {c.index} has token ids outside the vocabulary")
        content = c.logprobs.content if c.logprobs is not None else None
        if content is not None and any(len(e.top_logprobs) > MAX_LOGPROBS + 1 for e in content):
            raise RequestError(f"choice {c.index} has more than {MAX_LOGPROBS + 1} logprob candidates per position")


def _require_context(state: AppState, chat: ChatCompletionRequest | None) -> None:
    if parsers_configured(state) and chat is None:
        raise RequestError(
            "chat_request is required when a tool or reasoning parser is configured because plain "
            "detokenization would leak raw parser markup into content"
        )


def _chat_config(
    state: AppState, chat: ChatCompletionRequest | None, prompt_ids: Sequence[int], stop: StopConfig, streaming: bool,
    want_logprobs: bool,
) -> OutputConfig:
    factory = make_parser_factory(state, chat, prompt_ids)
    skip_special = False if factory is not None else (chat is None or chat.skip_special_tokens is not False)
    top_limit = chat.top_logprobs if chat is not None and chat.logprobs else None
    return OutputConfig(
        mode="derender", prompt_token_ids=prompt_ids, tokenizer=state.tokenizer, skip_special_tokens=skip_special,
        stop=stop, want_logprobs=want_logprobs, top_logprobs_limit=top_limit, parser_factory=factory,
        streaming=streaming,
    )


def _completion_config(
    state: AppState, req: CompletionRequest | None, prompt_ids: Sequence[int], stop: StopConfig, want_logprobs: bool
) -> OutputConfig:
    top_limit = None if req is None or req.logprobs is None else req.logprobs + 1
    return OutputConfig(
        mode="text", prompt_token_ids=prompt_ids, tokenizer=state.tokenizer,
        skip_special_tokens=req is None or req.skip_special_tokens, stop=stop, want_logprobs=want_logprobs,
        top_logprobs_limit=top_limit,
    )


def _replay_final(config: OutputConfig, choice: GenerateTokensChoice, request_id: str) -> ChoiceState:
    state = ChoiceState(choice.index, config)
    state.add(
        EngineOutput(
            request_id=request_id, index=choice.index, new_token_ids=choice.token_ids or [],
            new_logprobs=positions_of(choice.logprobs), finish_reason=choice.finish_reason or "stop",
            stop_reason=choice.stop_reason,
        )
    )
    return state


@router.post("/v1/chat/completions/derender")
async def chat_derender(request: Request) -> JSONResponse:
    state = app_state(request)
    require_tokenizer(state)
    req = await parse_body(request, chat_derender_adapter)
    if isinstance(req, DerenderChatStreamRequest):
        return _chat_derender_stream(req, state)
    gen, chat = req.generate_response, req.chat_request
    _require_context(state, chat)
    prompt_ids = req.prompt_token_ids or gen.prompt_token_ids or []
    _check_bounds(state, gen.choices, prompt_ids)
    choices = []
    for c in gen.choices:
        stop = _stop_config(state, c.finish_reason or "stop", c.stop_reason, chat)
        config = _chat_config(state, chat, prompt_ids, stop, False, c.logprobs is not None)
        cs = _replay_final(config, c, gen.request_id)
        message, finish, hide = cs.final_message()
        logprobs = ChatCompletionLogProbs(content=cs.decoded_logprobs) if c.logprobs is not None and not hide else None
        return_ids = bool(chat and chat.return_token_ids) and not hide
        choices.append(
            ChatCompletionResponseChoice(
                index=c.index, message=message, logprobs=logprobs, finish_reason=finish,
                stop_reason=cs.stop_reason, token_ids=c.token_ids if return_ids else None,
            )
        )
    completion = sum(len(c.token_ids or []) for c in gen.choices)
    response = ChatCompletionResponse(
        id=gen.request_id, model=req.model or state.model_name, choices=choices,
        usage=usage_of(req.prompt_tokens or 0, completion), kv_transfer_params=gen.kv_transfer_params,
        prompt_token_ids=gen.prompt_token_ids if chat and chat.return_token_ids else None,
    )
    return JSONResponse(response.model_dump(mode="json"))


def _stream_choice(
    state: AppState, chunk_choices: list[GenerateTokensStreamChoice]
) -> GenerateTokensStreamChoice | None:
    if len(chunk_choices) > 1:
        raise RequestError("a streamed generate chunk carries one choice; send each choice's chunks separately")
    if not chunk_choices:
        return None
    choice = chunk_choices[0]
    vocab = state.tokenizer.vocab_size  # type: ignore[union-attr]
    if any(t < 0 or t >= vocab for t in choice.token_ids or []):
        raise RequestError(f"choice {choice.index} has token ids outside the vocabulary")
    return choice


def _vllm_window_ids(state: AppState, window: list[str]) -> list[int]:
    """The ids of vLLM's plain decode window (``prev_tokens``, token strings; "" for a skipped special)."""
    ids = []
    for token in window:
        token_id = state.tokenizer.token_to_id(token) if token else None  # type: ignore[union-attr]
        if token and token_id is None:
            raise RequestError(f"invalid stream_state: prev_tokens holds {token!r}, which is not a token of this "
                               "model", param="stream_state.prev_tokens")
        if token_id is not None:
            ids.append(token_id)
    return ids


def _carried_state(
    state: AppState, previous: DerenderStreamState, prompt_ids: Sequence[int], delta_ids: Sequence[int], parsed: bool
) -> DerenderStreamState:
    """Check the client-carried state against this server and chunk, in pdserve's terms.

    A state that cannot belong to this stream is a 400, never a 200 with text made up from part of
    it. On the plain path a state that only holds vLLM's decode window continues from that window.
    """
    if not parsed and previous.prev_tokens and not previous.output_token_ids:
        previous = previous.model_copy(update={
            "output_token_ids": _vllm_window_ids(state, previous.prev_tokens)[-PLAIN_REPLAY_IDS:],
            "prev_tokens": [], "prefix_offset": 0, "read_offset": 0,
        })
    limit = _max_len(state)
    total = len(prompt_ids) + len(previous.output_token_ids) + len(delta_ids)
    if total > limit:
        raise RequestError(
            f"prompt_token_ids ({len(prompt_ids)}) + stream_state.output_token_ids ({len(previous.output_token_ids)})"
            f" + this chunk's token_ids ({len(delta_ids)}) is {total} ids, over max_model_len ({limit})",
            param="stream_state.output_token_ids",
        )
    vocab = state.tokenizer.vocab_size  # type: ignore[union-attr]
    for name in ("output_token_ids", "logprob_context_token_ids"):
        if any(t < 0 or t >= vocab for t in getattr(previous, name)):
            raise RequestError(f"invalid stream_state: {name} has ids outside the vocabulary",
                               param=f"stream_state.{name}")
    if parsed and sum(previous.output_chunk_lens) != len(previous.output_token_ids):
        raise RequestError("invalid stream_state: output_chunk_lens must sum to len(output_token_ids) (the "
                           "parser replays every earlier chunk)", param="stream_state.output_chunk_lens")
    return previous


def _replayed_choice(
    config: OutputConfig, previous: DerenderStreamState, parsed: bool, index: int, request_id: str
) -> ChoiceState:
    """A choice state rebuilt from the carried state (its earlier output already discarded)."""
    if parsed:
        cs = ChoiceState(index, config)
        pos = 0
        for n in previous.output_chunk_lens:
            cs.add(EngineOutput(request_id=request_id, index=index, new_token_ids=previous.output_token_ids[pos : pos + n]))
            pos += n
    else:
        out = previous.output_token_ids
        head, tail = out[: max(0, len(out) - PLAIN_REPLAY_IDS)], out[-PLAIN_REPLAY_IDS:]
        cs = ChoiceState(index, replace(config, prompt_token_ids=list(config.prompt_token_ids) + head))
        if tail:
            cs.add(EngineOutput(request_id=request_id, index=index, new_token_ids=tail))
    return cs


def _continue_stream(
    config: OutputConfig, previous: DerenderStreamState, parsed: bool, choice: GenerateTokensStreamChoice,
    request_id: str,
) -> tuple[ChoiceState, ChoiceUpdate]:
    """Rebuild the choice from ``previous`` and feed it this chunk."""
    try:
        cs = _replayed_choice(config, previous, parsed, choice.index, request_id)
        update = cs.add(EngineOutput(
            request_id=request_id, index=choice.index, new_token_ids=choice.token_ids or [],
            finish_reason=choice.finish_reason, stop_reason=choice.stop_reason,
        ))
    except Exception as e:  # a state that does not replay is the client's
        raise RequestError(f"invalid stream_state: derender failed ({e})") from None
    if update is None:
        raise RequestError("invalid stream_state: this choice already finished")
    return cs, update


def _chunk_logprobs(
    state: AppState, previous: DerenderStreamState, choice: GenerateTokensStreamChoice, top_limit: int | None
) -> list[ChatCompletionLogProbsContent]:
    decoder = LogprobDecoder(state.tokenizer, previous.logprob_context_token_ids)  # type: ignore[arg-type]
    return decoder.chat_content(positions_of(choice.logprobs) or [], choice.token_ids or [], top_limit)


def _next_state(previous: DerenderStreamState, delta_ids: list[int], parsed: bool) -> DerenderStreamState:
    new = previous.model_copy(deep=True)
    new.role_sent = True
    new.logprob_context_token_ids = (previous.logprob_context_token_ids + delta_ids)[-4:]
    if delta_ids:
        if parsed:
            new.output_token_ids = previous.output_token_ids + delta_ids
            new.output_chunk_lens = previous.output_chunk_lens + [len(delta_ids)]
        else:
            new.output_token_ids = (previous.output_token_ids + delta_ids)[-PLAIN_REPLAY_IDS:]
    return new


def _chat_derender_stream(req: DerenderChatStreamRequest, state: AppState) -> JSONResponse:
    chat = req.chat_request
    if chat is not None and chat.stop:
        raise RequestError(
            "stop strings are not supported by streaming derender (text already sent cannot be cut); "
            "use batch derender or output_mode='text'", param="chat_request.stop",
        )
    _require_context(state, chat)
    parsed = parsers_configured(state)
    if parsed and req.prompt_token_ids is None:
        raise RequestError("prompt_token_ids (the full prompt) is required when a parser is configured")
    previous = req.stream_state or DerenderStreamState()
    gchunk = req.generate_chunk
    choice = _stream_choice(state, gchunk.choices)
    prompt_ids = req.prompt_token_ids or gchunk.prompt_token_ids or []
    model = req.model or state.model_name
    usage = None
    if gchunk.usage is not None:
        usage = UsageInfo(prompt_tokens=req.prompt_tokens or gchunk.usage.prompt_tokens or 0,
                          completion_tokens=gchunk.usage.completion_tokens or 0)
        usage.total_tokens = usage.prompt_tokens + (usage.completion_tokens or 0)
    if choice is None:
        empty = {"id": gchunk.request_id, "object": "chat.completion.chunk", "model": model, "choices": [],
                 "usage": usage.model_dump() if usage else None}
        return JSONResponse({"chunk": empty, "stream_state": previous.model_dump()})
    delta_ids = choice.token_ids or []
    previous = _carried_state(state, previous, prompt_ids, delta_ids, parsed)
    # Logprobs belong to this chunk's own ids (not to the text it happens to release), so they are
    # decoded here with the carried context rather than by the replayed choice.
    config = _chat_config(state, chat, prompt_ids, _stop_tokens_config(state, chat), True, False)
    cs, update = _continue_stream(config, previous, parsed, choice, gchunk.request_id)
    rstate = RequestState(gchunk.request_id, choice.index + 1, config)
    rstate.choices[choice.index] = cs
    new_state = _next_state(previous, delta_ids, parsed)
    if update.delta is not None:
        for call in update.delta.tool_calls:
            if call.id is None:
                continue
            if call.index < len(new_state.last_tool_call_ids):
                call.id = new_state.last_tool_call_ids[call.index]
            else:
                new_state.last_tool_call_ids.append(call.id)
            new_state.tools_streamed = True
        if not previous.role_sent:
            update.delta.role = "assistant"
    update.token_ids = delta_ids
    hide = cs.parser is not None and cs.parser.hide_metadata
    if choice.logprobs is not None and not hide:
        top_limit = chat.top_logprobs if chat is not None and chat.logprobs else None
        update.decoded_logprobs = _chunk_logprobs(state, previous, choice, top_limit)
    return_ids = bool(chat and chat.return_token_ids)
    chunk = chat_chunk(rstate, update, gchunk.request_id, model, return_ids, usage, force_logprobs=True)
    return JSONResponse({"chunk": chunk, "stream_state": new_state.model_dump()})


@router.post("/v1/completions/derender")
async def completion_derender(request: Request) -> JSONResponse:
    state = app_state(request)
    require_tokenizer(state)
    req = await parse_body(request, completion_derender_adapter)
    if isinstance(req, DerenderCompletionStreamRequest):
        return _completion_derender_stream(req, state)
    n = len(req.generate_responses)
    for name in ("prompt_tokens", "prompt_token_ids"):
        value = getattr(req, name)
        if value is not None and len(value) != n:
            raise RequestError(f"{name} must have one entry per generate response ({n})")
    states = []
    for k, gen in enumerate(req.generate_responses):
        prompt_ids = (req.prompt_token_ids[k] if req.prompt_token_ids else None) or gen.prompt_token_ids or []
        _check_bounds(state, gen.choices, prompt_ids)
        config = _completion_config(state, req.completion_request, prompt_ids, StopConfig(), True)
        rstate = RequestState(gen.request_id, len(gen.choices), config)
        for c in gen.choices:
            stop = _stop_config(state, c.finish_reason or "stop", c.stop_reason, req.completion_request)
            cfg = _completion_config(state, req.completion_request, prompt_ids, stop, c.logprobs is not None)
            rstate.choices[c.index] = _replay_final(cfg, c, gen.request_id)
        states.append(rstate)
    return_ids = bool(req.completion_request and req.completion_request.return_token_ids)
    response = completion_response(states, req.generate_responses[0].request_id, req.model or state.model_name,
                                   return_ids)
    prompt_tokens = sum(req.prompt_tokens or [])
    response.usage = usage_of(prompt_tokens, response.usage.completion_tokens or 0)
    return JSONResponse(response.model_dump(mode="json"))


def _completion_derender_stream(req: DerenderCompletionStreamRequest, state: AppState) -> JSONResponse:
    creq = req.completion_request
    if creq is not None and creq.stop:
        raise RequestError("stop strings are not supported by streaming derender; use batch derender or "
                           "output_mode='text'", param="completion_request.stop")
    previous = req.stream_state or DerenderStreamState()
    gchunk = req.generate_chunk
    choice = _stream_choice(state, gchunk.choices)
    prompt_ids = req.prompt_token_ids or gchunk.prompt_token_ids or []
    if len(prompt_ids) > _max_len(state):
        raise RequestError("prompt_token_ids is longer than the model length")
    model = req.model or state.model_name
    if choice is None:
        empty = {"id": gchunk.request_id, "object": "text_completion", "model": model, "choices": [],
                 "usage": gchunk.usage.model_dump() if gchunk.usage else None}
        return JSONResponse({"chunk": empty, "stream_state": previous.model_dump()})
    delta_ids = choice.token_ids or []
    previous = _carried_state(state, previous, prompt_ids, delta_ids, False)
    config = _completion_config(state, creq, prompt_ids, _stop_tokens_config(state, creq), False)
    cs, update = _continue_stream(config, previous, False, choice, gchunk.request_id)
    new_state = _next_state(previous, delta_ids, False)
    update.token_ids = delta_ids
    update.decoded_logprobs = None
    if choice.logprobs is not None:
        top_limit = None if creq is None or creq.logprobs is None else creq.logprobs + 1
        update.decoded_logprobs = _chunk_logprobs(state, previous, choice, top_limit)
    rstate = RequestState(gchunk.request_id, choice.index + 1, config)
    rstate.choices[choice.index] = cs
    return_ids = bool(creq and creq.return_token_ids)
    chunk = completion_chunk(rstate, update, choice.index, previous.logprob_text_offset, gchunk.request_id, model,
                             return_ids, None)
    offsets = chunk["choices"][0]["logprobs"]
    if offsets and offsets["tokens"]:
        new_state.logprob_text_offset = offsets["text_offset"][-1] + len(offsets["tokens"][-1])
    else:
        new_state.logprob_text_offset = previous.logprob_text_offset + len(update.text)
    return JSONResponse({"chunk": chunk, "stream_state": new_state.model_dump()})
