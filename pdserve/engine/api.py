"""The engine contract: token ids in, token ids (and logprob ids) out, per step.

The engine never sees text. Stop *strings* are matched by the frontend, which
then calls :meth:`Engine.stop_sequence`. Everything here is a msgspec Struct so
the same values cross the ZMQ boundary to the engine-core process unchanged.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

import msgspec


class SequenceSampling(msgspec.Struct, frozen=True, kw_only=True):
    """What the engine needs to sample one request (all of its ``n`` sequences)."""

    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    # Number of top candidates per sampled position (None = no logprobs, -1 = whole vocab).
    logprobs: int | None = None
    prompt_logprobs: int | None = None


class EngineRequest(msgspec.Struct, kw_only=True):
    """One generate request as the engine sees it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SequenceSampling
    kv_transfer_params: dict[str, Any] | None = None
    priority: int = 0
    # sampling_params.extra_args from the client (engine-specific knobs).
    extra_args: dict[str, Any] | None = None


class PositionLogprobs(msgspec.Struct, array_like=True):
    """Logprobs of one position: the sampled token first, then the top-k candidates by rank.

    ``ranks`` are 1-based vocab ranks (the sampled token's true rank, then 1..k).
    """

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


class EngineOutput(msgspec.Struct, kw_only=True):
    """One step's worth of output for one sequence (``index``) of a request."""

    request_id: str
    index: int = 0
    new_token_ids: list[int] = []
    # One entry per new token, aligned with new_token_ids (None when not requested).
    new_logprobs: list[PositionLogprobs] | None = None
    # Prompt logprobs arrive once, on the first output of index 0: first entry None.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # "stop" (EOS or stop token id), "length", "abort"; None while running.
    finish_reason: str | None = None
    # int stop token id for stop_token_ids / non-primary EOS; None for primary EOS.
    stop_reason: int | str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineInfo(msgspec.Struct, kw_only=True):
    """Static facts the frontend needs for validation and defaults."""

    model_name: str
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    eos_token_ids: list[int]


class EngineStats(msgspec.Struct, kw_only=True):
    running_requests: int = 0
    waiting_requests: int = 0
    running_sequences: int = 0


class EngineError(RuntimeError):
    """The engine failed: requests in flight end with this error, never with a hang."""


class EngineDeadError(EngineError):
    """The engine (or its core process) is gone; the server is unhealthy."""


@runtime_checkable
class Engine(Protocol):
    """What every engine (scripted, torch in-process, engine-core client) offers the frontend."""

    info: EngineInfo

    async def start(self) -> None:
        """Bring the engine up (load weights, start loops)."""

    async def shutdown(self) -> None:
        """Stop all loops and free resources; in-flight requests end with EngineDeadError."""

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        """Run a request; yields outputs until every sequence has a finish_reason.

        An aborted request still ends with one ``finish_reason="abort"`` output per
        unfinished sequence. Raises EngineError / EngineDeadError on failure.
        Closing the iterator early aborts the request.
        """

    async def abort(self, request_ids: list[str]) -> None:
        """Abort whole requests by id; unknown ids are ignored."""

    async def stop_sequence(self, request_id: str, index: int) -> None:
        """The frontend finished one sequence itself (stop string): free it, emit nothing more for it."""

    def is_healthy(self) -> bool: ...

    def stats(self) -> EngineStats: ...
