"""Stateless derender: rebuild a choice from what the client sent, then feed it the next chunk.

Batch derender replays a finished generate choice; streaming derender replays the
client-carried :class:`~pdserve.protocol.derender.DerenderStreamState` (:func:`replay`) and
advances it by one generate chunk (:func:`advance`). Both go through the same
:class:`~pdserve.output.request_state.ChoiceState` (detokenizer, parser, logprob decoder) as the
inline path, so their output equals inline output by construction. The parsed path replays every
earlier chunk (O(n) per call, as in vLLM); the plain path replays only a short tail, enough to
rebuild a character split across tokens. With a :class:`Resume`, a chunk that follows the previous
one of its stream on this server continues the live state that chunk left behind
(:mod:`pdserve.output.derender_cache`) instead, with the same result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from pdserve.output.derender_cache import DerenderCache, StreamKey
from pdserve.output.policy import assistant_delta
from pdserve.output.request_state import ChoiceState, ChoiceUpdate, OutputConfig
from pdserve.protocol.derender import DerenderStreamState
from pdserve.protocol.engine import EngineOutput, PositionLogprobs
from pdserve.protocol.errors import RequestError
from pdserve.protocol.generate import GenerateLogProbs, GenerateTokensChoice, GenerateTokensStreamChoice
from pdserve.text.logprobs import REPAIR_CONTEXT, LogprobDecoder
from pdserve.text.tokenizer import Tokenizer

# Plain-path replay window: enough ids to rebuild any character split across tokens.
PLAIN_REPLAY_IDS = 8


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


def replay_final(config: OutputConfig, choice: GenerateTokensChoice, request_id: str) -> ChoiceState:
    """Batch derender: a finished generate choice fed through a fresh choice state in one output."""
    state = ChoiceState(choice.index, config)
    state.add(
        EngineOutput(
            request_id=request_id, index=choice.index, new_token_ids=choice.token_ids or [],
            new_logprobs=positions_of(choice.logprobs), finish_reason=choice.finish_reason or "stop",
            stop_reason=choice.stop_reason,
        )
    )
    return state


def _vllm_window_ids(tokenizer: Tokenizer, window: list[str]) -> list[int]:
    """The ids of vLLM's plain decode window (``prev_tokens``, token strings; "" for a skipped special)."""
    ids = []
    for token in window:
        token_id = tokenizer.token_to_id(token) if token else None
        if token and token_id is None:
            raise RequestError(f"invalid stream_state: prev_tokens holds {token!r}, which is not a token of this "
                               "model", param="stream_state.prev_tokens")
        if token_id is not None:
            ids.append(token_id)
    return ids


def carried_state(
    tokenizer: Tokenizer, previous: DerenderStreamState, prompt_len: int, delta_len: int, parsed: bool, max_len: int,
    vocab_size: int,
) -> DerenderStreamState:
    """Check the client-carried state against this model and chunk, in pdserve's terms.

    A state that cannot belong to this stream is a 400, never a 200 with text made up from part of
    it. On the plain path a state that only holds vLLM's decode window continues from that window.
    """
    if not parsed and previous.prev_tokens and not previous.output_token_ids:
        previous = previous.model_copy(update={
            "output_token_ids": _vllm_window_ids(tokenizer, previous.prev_tokens)[-PLAIN_REPLAY_IDS:],
            "prev_tokens": [], "prefix_offset": 0, "read_offset": 0,
        })
    total = prompt_len + len(previous.output_token_ids) + delta_len
    if total > max_len:
        raise RequestError(
            f"prompt_token_ids ({prompt_len}) + stream_state.output_token_ids ({len(previous.output_token_ids)})"
            f" + this chunk's token_ids ({delta_len}) is {total} ids, over max_model_len ({max_len})",
            param="stream_state.output_token_ids",
        )
    for name in ("output_token_ids", "logprob_context_token_ids"):
        ids = getattr(previous, name)
        # Ids are >= 0 by their wire type; max() is one C loop over what may be the whole output.
        if ids and max(ids) >= vocab_size:
            raise RequestError(f"invalid stream_state: {name} has ids outside the vocabulary",
                               param=f"stream_state.{name}")
    # Chunk lengths, where there are any, sum to the ids' count (the wire type checks that).
    if parsed and previous.output_token_ids and not previous.output_chunk_lens:
        raise RequestError("invalid stream_state: output_chunk_lens must sum to len(output_token_ids) (the "
                           "parser replays every earlier chunk)", param="stream_state.output_chunk_lens")
    return previous


def replay(config: OutputConfig, stream_state: DerenderStreamState, parsed: bool, index: int,
           request_id: str = "") -> ChoiceState:
    """The choice state the carried state stands for (its earlier output already sent and discarded).

    ``parsed``: a parser reads the output, so every earlier chunk is replayed as it came (the
    parser's state depends on the chunking); otherwise the ids before the replay window join the
    prompt, as context only.
    """
    if parsed:
        cs = ChoiceState(index, config)
        pos = 0
        for n in stream_state.output_chunk_lens:
            ids = stream_state.output_token_ids[pos : pos + n]
            cs.add(EngineOutput(request_id=request_id, index=index, new_token_ids=ids))
            pos += n
        return cs
    out = stream_state.output_token_ids
    head, tail = out[: max(0, len(out) - PLAIN_REPLAY_IDS)], out[-PLAIN_REPLAY_IDS:]
    cs = ChoiceState(index, replace(config, prompt_token_ids=list(config.prompt_token_ids) + head))
    if tail:
        cs.add(EngineOutput(request_id=request_id, index=index, new_token_ids=tail))
    return cs


def next_state(previous: DerenderStreamState, delta_ids: Sequence[int], parsed: bool) -> DerenderStreamState:
    """The state to hand back after this chunk's ids (the role counts as sent from now on).

    Lists that change are built anew and the others shared, never deep-copied: the output ids
    are the bulk of the state, and a deep copy of them costs more than the rest of a cached chunk.
    """
    update: dict[str, object] = {
        "role_sent": True,
        "logprob_context_token_ids": (previous.logprob_context_token_ids + list(delta_ids))[-REPAIR_CONTEXT:],
        "last_tool_call_ids": list(previous.last_tool_call_ids),  # _pin_tool_call_ids appends to it
    }
    if delta_ids:
        if parsed:
            update["output_token_ids"] = previous.output_token_ids + list(delta_ids)
            update["output_chunk_lens"] = previous.output_chunk_lens + [len(delta_ids)]
        else:
            update["output_token_ids"] = (previous.output_token_ids + list(delta_ids))[-PLAIN_REPLAY_IDS:]
    return previous.model_copy(update=update)


@dataclass(frozen=True)
class Resume:
    """Where :func:`advance` looks for the live state of this choice's stream and leaves the next one."""

    cache: DerenderCache[ChoiceState]
    stream: StreamKey


@dataclass
class StreamStep:
    """One streamed derender call: the advanced choice, what this chunk released, the next state."""

    choice: ChoiceState
    update: ChoiceUpdate
    state: DerenderStreamState


def _pin_tool_call_ids(update: ChoiceUpdate, state: DerenderStreamState) -> None:
    """A replayed parser makes up fresh tool-call ids; the ones the client already has stay."""
    if update.delta is None:
        return
    for call in update.delta.tool_calls:
        if call.id is None:
            continue
        if call.index < len(state.last_tool_call_ids):
            call.id = state.last_tool_call_ids[call.index]
        else:
            state.last_tool_call_ids.append(call.id)
        state.tools_streamed = True


def advance(
    config: OutputConfig, previous: DerenderStreamState, parsed: bool, chunk: GenerateTokensStreamChoice,
    request_id: str, top_limit: int | None, resume: Resume | None = None,
) -> StreamStep:
    """Replay ``previous`` (already checked by :func:`carried_state`) and feed it this chunk.

    With ``resume``, the state a previous call left for exactly this stream and output is
    continued instead of a replay, and the advanced state is left for the next chunk (unless the
    choice finished: a replay after the last chunk would not know it finished). Only the choice
    state is cached; everything else comes from ``previous`` as on a replay, so the response is
    the same either way.

    The update carries the chunk's own ids and its logprobs, decoded here with the carried context
    (they belong to this chunk's ids, not to the text it happens to release); they and the ids are
    withheld where the request hides reasoning. The role is named on the first delta of a stream.
    """
    cs = None
    if resume is not None and previous.output_token_ids:  # nothing consumed yet: nothing to look up
        cs = resume.cache.take(resume.stream, previous.output_token_ids, previous.output_chunk_lens)
    if cs is None:
        cs = replay(config, previous, parsed, chunk.index, request_id)
    delta_ids = chunk.token_ids or []
    update = cs.add(EngineOutput(
        request_id=request_id, index=chunk.index, new_token_ids=delta_ids,
        finish_reason=chunk.finish_reason, stop_reason=chunk.stop_reason,
    ))
    if update is None:
        raise RequestError("invalid stream_state: this choice already finished")
    state = next_state(previous, delta_ids, parsed)
    if resume is not None and not cs.finished and state.output_token_ids:  # an empty state is never looked up
        resume.cache.put(resume.stream, state.output_token_ids, state.output_chunk_lens, cs)
    _pin_tool_call_ids(update, state)
    if not previous.role_sent:  # even when the parser held this chunk's text back (vLLM names the role first)
        update.delta = assistant_delta(update.delta)
    update.token_ids = list(delta_ids)
    update.decoded_logprobs = None
    if chunk.logprobs is not None and not cs.hides_metadata:
        decoder = LogprobDecoder(config.tokenizer, previous.logprob_context_token_ids)  # type: ignore[arg-type]
        update.decoded_logprobs = decoder.chat_content(positions_of(chunk.logprobs) or [], delta_ids, top_limit)
    return StreamStep(cs, update, state)


def next_text_offset(previous_offset: int, update: ChoiceUpdate) -> int:
    """Completions ``logprobs.text_offset`` after this chunk: past its logprob tokens, else its text."""
    if update.decoded_logprobs:
        return previous_offset + sum(len(entry.token) for entry in update.decoded_logprobs)
    return previous_offset + len(update.text)
