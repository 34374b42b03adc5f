"""Request-scoped output state: the one place where engine ids become text, messages and logprobs.

A :class:`RequestState` is created when a request starts and dropped when it
finishes, aborts or its client goes away. It owns one :class:`ChoiceState` per
sequence (detokenizer, parser, logprob context). Every surface (inline
``text``/``derender`` on generate, the coupled OpenAI endpoints and the
stateless ``/derender`` replay) feeds engine outputs through this class, so
their outputs agree by construction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdserve.output import live
from pdserve.output.timing import RequestTiming
from pdserve.protocol.engine import EngineOutput, PositionLogprobs
from pdserve.protocol.generate import OutputMode, decodes_text, parses_message
from pdserve.protocol.openai import ChatMessage, StreamDelta, TextDelta
from pdserve.text.detokenizer import IncrementalDetokenizer, StopConfig
from pdserve.text.logprob_json import ChatLogprobJson
from pdserve.text.logprobs import LogprobDecoder, TokenLogprobs
from pdserve.text.tokenizer import Tokenizer


class ChoiceParser(Protocol):
    """What the output layer needs from a per-choice chat parser (pdserve.parsers.ChatParser)."""

    @property
    def hide_metadata(self) -> bool: ...

    def step(
        self, delta_text: str, delta_ids: Sequence[int], finish_reason: str | None
    ) -> tuple[StreamDelta | None, str | None]: ...

    def parse(self, text: str, token_ids: Sequence[int], finish_reason: str | None) -> tuple[ChatMessage, str]: ...


@dataclass(frozen=True)
class OutputConfig:
    """How to postprocess one request's outputs."""

    mode: OutputMode
    prompt_token_ids: Sequence[int]
    tokenizer: Tokenizer | None = None
    skip_special_tokens: bool = True
    stop: StopConfig = StopConfig()
    want_logprobs: bool = False
    # Candidates kept per position at the decoded levels (None = all the engine returned).
    top_logprobs_limit: int | None = None
    # Builds the per-choice parser at the derender level; None = plain text into content.
    parser_factory: Callable[[], ChoiceParser] | None = None
    streaming: bool = False
    # Decoded logprobs come as chat-shape JSON (ChoiceUpdate.logprobs_json) rather than structs: what a
    # stream chunk embeds as it is. Streamed generate (text, derender) and chat ask for it; completions
    # (another shape) and batch answers (which keep every entry) take the structs.
    encoded_logprobs: bool = False


@dataclass(slots=True)
class ChoiceUpdate:
    """What one engine output released for one choice. One is made per token, so it has slots, and the
    fields every update sets come first: the hot paths pass them by position (keywords cost as much again)."""

    index: int
    token_ids: list[int]
    logprobs: list[PositionLogprobs | None] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""
    delta: StreamDelta | None = None
    decoded_logprobs: list[TokenLogprobs] | None = None
    # The same entries as a JSON array, when the config asks for them encoded (OutputConfig.encoded_logprobs).
    logprobs_json: bytes | None = None
    # The choice hides reasoning, so its ids and logprobs are withheld (ChoiceState.hides_metadata).
    hides_metadata: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def has_logprob_entries(self) -> bool:
        """Decoded logprob entries to send (structs or JSON)."""
        return bool(self.decoded_logprobs) or self.logprobs_json not in (None, b"[]")


@dataclass
class ChoiceState:
    """One output sequence: ids so far, detokenizer, parser, logprob context."""

    index: int
    config: OutputConfig
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs | None] = field(default_factory=list)
    decoded_logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    detok: IncrementalDetokenizer | None = None
    parser: ChoiceParser | None = None
    _released: int = 0
    _logprob_decoder: LogprobDecoder | None = None
    _logprob_json: ChatLogprobJson | None = None
    _decodes_text: bool = False  # the mode's answer carries text (protocol.generate.decodes_text)
    _streams_deltas: bool = False  # a streamed message: each update carries a delta
    # An update is its ids, text and (a streamed message) the delta of that text: no logprobs (add's shortest path).
    _plain: bool = False

    def __post_init__(self) -> None:
        cfg = self.config
        self._decodes_text = decodes_text(cfg.mode)
        needs_text = self._decodes_text or bool(cfg.stop.stop)
        if needs_text and cfg.tokenizer is not None:
            self.detok = IncrementalDetokenizer(
                cfg.tokenizer, cfg.prompt_token_ids, skip_special_tokens=cfg.skip_special_tokens, stop=cfg.stop
            )
            self.token_ids = self.detok.output_ids  # one list: the detokenizer keeps the ids it accepted
        if self._decodes_text and cfg.want_logprobs and cfg.tokenizer is not None:
            self._logprob_decoder = LogprobDecoder(cfg.tokenizer)
            if cfg.encoded_logprobs:
                self._logprob_json = ChatLogprobJson(self._logprob_decoder)
        self._streams_deltas = cfg.streaming and parses_message(cfg.mode)
        if self._streams_deltas and cfg.parser_factory is not None:
            self.parser = cfg.parser_factory()
        self._plain = self._decodes_text and not cfg.want_logprobs

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def hides_metadata(self) -> bool:
        """The request hides reasoning, so this choice's token ids and logprobs are withheld too.

        The parser decides; a batch choice has one once :meth:`final_message` ran.
        """
        return self.parser is not None and self.parser.hide_metadata

    @property
    def prompt_token_ids(self) -> Sequence[int]:
        return self.config.prompt_token_ids

    @property
    def logprob_entries(self) -> list[TokenLogprobs] | None:
        """A batch choice's decoded logprob entries; None when the request asked for none."""
        return self.decoded_logprobs if self.config.want_logprobs else None

    @property
    def stopped_by_string(self) -> bool:
        return self.detok is not None and self.detok.stopped

    @property
    def text(self) -> str:
        return self.detok.text if self.detok is not None else ""

    def add(self, out: EngineOutput) -> ChoiceUpdate | None:
        """Fold one engine output in; returns what to send for it (None once finished)."""
        if self.finish_reason is not None:
            return None
        detok = self.detok
        if detok is None:
            return self._add_ids(out)
        before = len(self.token_ids)  # the detokenizer's output_ids: it drops the ids after a stop string
        new_ids = out.new_token_ids
        start = self._released
        finish, stop_reason = out.finish_reason, out.stop_reason
        # The hot path: one running id whose text is its own goes out with it, no decoder step.
        text = detok.take_standalone(new_ids[0]) if finish is None and len(new_ids) == 1 else None
        if text is not None:
            self._released = start + 1
            if self._plain:  # most of a stream's tokens: the id, its own string and the delta of that, nothing else
                self.stop_reason = stop_reason
                update = ChoiceUpdate(self.index, [new_ids[0]], None, None, stop_reason, text)
                return self._with_delta(update, None) if self._streams_deltas else update
        else:
            stop_terminated, stop_reason = self.config.stop.stop_token_end(finish, stop_reason, new_ids)
            detok.update(new_ids, stop_terminated)
            if detok.stopped:
                finish, stop_reason = "stop", detok.stop_string
            if finish is not None:
                detok.finish()
            if not self._decodes_text:  # stop strings only: ids go out as they come
                released_ids = len(self.token_ids)
                text = ""
            else:
                released = detok.release(finish is not None)
                released_ids, text = start + released.num_ids, released.text
            self._released = released_ids
        self.finish_reason, self.stop_reason = finish, stop_reason
        if self.config.want_logprobs:
            self._extend_logprobs(out, len(self.token_ids) - before)
        if not self._decodes_text:
            new_logprobs = self.logprobs[before:] if self.config.want_logprobs else None
            return ChoiceUpdate(self.index, self.token_ids[before:], new_logprobs, finish, stop_reason)

        ids = self.token_ids[start : self._released]
        update = ChoiceUpdate(self.index, ids, None, finish, stop_reason, text)
        if self._logprob_decoder is not None:
            update.logprobs = self.logprobs[start : self._released]
            top_limit = self.config.top_logprobs_limit
            if self._logprob_json is not None:
                update.logprobs_json = self._logprob_json.content(update.logprobs, ids, top_limit)
            else:
                update.decoded_logprobs = self._logprob_decoder.chat_content(update.logprobs, ids, top_limit)
                if not self.config.streaming:  # a batch answer sends them all at the end; a stream, chunk by chunk
                    self.decoded_logprobs.extend(update.decoded_logprobs)
        return self._with_delta(update, finish)

    def _with_delta(self, update: ChoiceUpdate, finish: str | None) -> ChoiceUpdate:
        """``update`` with its message delta (a streamed message): its text through the parser, which may also
        resolve the finish reason and withhold ids and logprobs, else its text as content."""
        parser = self.parser
        if parser is not None:
            update.delta, update.finish_reason = parser.step(update.text, update.token_ids, finish)
            if parser.hide_metadata:
                update.hides_metadata = True
                update.decoded_logprobs = update.logprobs_json = None
        elif self._streams_deltas:
            update.delta = TextDelta(content=update.text or None)
        return update

    def resume(self, prior_chunks: Sequence[Sequence[int]]) -> None:
        """Take ``prior_chunks`` as output already sent (a resumed stream): through the detokenizer, stop
        strings and parser chunk by chunk, as the first leg took them, with nothing of them sent again.
        Every one of them counts as released, since the client has their text."""
        for ids in prior_chunks:
            self.add(EngineOutput(request_id="", index=self.index, new_token_ids=list(ids)))
        if self.detok is None or self._released >= len(self.token_ids):
            return
        held = self.detok.release(finished=True)  # held back for a stop string, but the client has it
        ids = self.token_ids[self._released :]
        self._released = len(self.token_ids)
        if self.parser is not None:
            self.parser.step(held.text, ids, None)

    def _add_ids(self, out: EngineOutput) -> ChoiceUpdate:
        """Tokens mode without stop strings: the ids go out as they come, with no text made."""
        finish = out.finish_reason
        stop_reason = out.stop_reason
        if finish is not None:
            stop_reason = self.config.stop.stop_token_end(finish, stop_reason, out.new_token_ids)[1]
        accepted = list(out.new_token_ids)
        self.token_ids.extend(accepted)
        self.finish_reason, self.stop_reason = finish, stop_reason
        new_logprobs = None
        if self.config.want_logprobs:
            new_logprobs = self._extend_logprobs(out, len(accepted))
        self._released = len(self.token_ids)
        return ChoiceUpdate(self.index, accepted, new_logprobs, finish, stop_reason)

    def _extend_logprobs(self, out: EngineOutput, accepted: int) -> list[PositionLogprobs | None]:
        """Keep logprob positions aligned with token_ids; an output without logprobs (a replayed chunk,
        an abort) leaves empty positions, reported with the floor logprob. Returns the new positions."""
        given = list(out.new_logprobs or [])[:accepted]
        new = given + [None] * (accepted - len(given))
        self.logprobs.extend(new)
        return new

    def final_message(self) -> tuple[ChatMessage, str]:
        """Batch derender: parse the whole (stop-truncated) text once, with this choice's parser
        (then :attr:`hides_metadata` answers for it). Returns the message and the resolved finish_reason.
        """
        if self.config.parser_factory is None:
            return ChatMessage(content=self.text), self.finish_reason or "stop"
        self.parser = self.config.parser_factory()
        return self.parser.parse(self.text, self.token_ids, self.finish_reason)


class RequestState:
    """All choices of one request."""

    def __init__(self, request_id: str, n: int, config: OutputConfig):
        self.request_id = request_id
        self.config = config
        self.choices = [ChoiceState(i, config) for i in range(n)]
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        self.kv_transfer_params: dict[str, Any] | None = None
        self.num_cached_tokens = 0  # prompt positions the engine read from its prefix cache
        self.timing = RequestTiming()  # for --enable-per-request-metrics
        live.request_states.add(self)

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices)

    def resume(self, prior_chunks: Sequence[Sequence[int]]) -> None:
        """A resumed stream (``GenerateRequest.prior_output_chunks``, n=1): the output already sent."""
        if prior_chunks:
            self.choices[0].resume(prior_chunks)

    def add(self, out: EngineOutput) -> ChoiceUpdate | None:
        if not 0 <= out.index < len(self.choices):
            raise ValueError(f"engine output for unknown sequence index {out.index}")
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.kv_transfer_params is not None:
            self.kv_transfer_params = out.kv_transfer_params
        if out.num_cached_tokens:
            self.num_cached_tokens = out.num_cached_tokens
        if out.kv_pull_seconds is not None:
            self.timing.kv_pull = (out.kv_pull_seconds, out.kv_pull_bytes or 0)
        timing = self.timing
        timing.tokens(len(out.new_token_ids))
        if out.scheduled_at is not None:
            timing.scheduled_at(out.scheduled_at)
        return self.choices[out.index].add(out)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    def metrics(self) -> dict[str, Any]:
        """The per-request ``metrics`` object (:mod:`pdserve.output.timing`)."""
        return self.timing.metrics(self.completion_tokens)
