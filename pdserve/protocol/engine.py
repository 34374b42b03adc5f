"""The engine's wire types: what crosses the engine boundary, per request and per step.

Token ids in, token ids (and logprob ids) out; never text. They sit at the bottom of the
package so that the engine, the output layer (ids -> text) and the text layer (logprob
decoding) all import them downwards. Everything is a msgspec Struct so the same values
cross the ZMQ boundary to the engine-core process unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from pdserve.protocol.kv import NO_KV, KVAgentInfo, KVIntent, KVStats


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
    # Logits processing (vLLM semantics): penalties over the output (presence, frequency) and over
    # prompt + output (repetition), additive per-id bias, an allow-list, and banned id sequences
    # (bad_words tokenized by the frontend; the last id of a sequence is banned when the output
    # ends with the ones before it).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    # Number of top candidates per sampled position (None = no logprobs, -1 = whole vocab).
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def logits_problems(self, vocab_size: int) -> list[str]:
        """What is wrong with the logits-processing params (vLLM's rules); every engine's validation
        calls it, so the rules are written once."""
        problems = []
        for name, value in (("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)):
            if not -2.0 <= value <= 2.0:
                problems.append(f"{name} must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty < float("inf"):
            problems.append("repetition_penalty must be greater than zero")

        def outside(ids: Iterable[int]) -> bool:
            return any(not 0 <= t < vocab_size for t in ids)

        if self.logit_bias and outside(self.logit_bias):
            problems.append(f"logit_bias token ids must be in [0, {vocab_size})")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                problems.append("allowed_token_ids must not be empty")
            elif outside(self.allowed_token_ids):
                problems.append(f"allowed_token_ids must be in [0, {vocab_size})")
        words = self.bad_words_token_ids or []
        if any(not word for word in words):
            problems.append("bad_words_token_ids must not contain an empty sequence")
        elif any(outside(word) for word in words):
            problems.append(f"bad_words_token_ids must be in [0, {vocab_size})")
        elif self.allowed_token_ids and set(self.allowed_token_ids) <= {w[0] for w in words if len(w) == 1}:
            problems.append("bad_words_token_ids ban every id in allowed_token_ids")
        return problems


# The engine's sampling fields, in declaration order: the one list every mapping into or out of
# SequenceSampling is written from (the client's params -> the engine request, the engine request ->
# vLLM's SamplingParams, an OpenAI request -> the rendered params), so a field added here reaches all.
SAMPLING_FIELDS: tuple[str, ...] = SequenceSampling.__struct_fields__


def sampling_values(source: object, *, skip: Iterable[str] = ()) -> dict[str, Any]:
    """``source``'s value of each engine sampling field (read by name), less the ones in ``skip``."""
    skipped = frozenset(skip)
    return {name: getattr(source, name) for name in SAMPLING_FIELDS if name not in skipped}


class EngineRequest(msgspec.Struct, kw_only=True):
    """One generate request as the engine sees it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SequenceSampling
    kv_transfer_params: dict[str, Any] | None = None
    # What kv_transfer_params ask of this engine (parsed and checked by the frontend).
    kv: KVIntent = NO_KV
    priority: int = 0
    # sampling_params.extra_args from the client (engine-specific knobs).
    extra_args: dict[str, Any] | None = None
    # Tokens per stream chunk: an engine core holds each sequence's outputs until that many have gathered
    # (the first token and the end go at once; pdserve.engine.coalesce). 1: every step's outputs.
    stream_interval: int = 1
    # The last N prompt ids are output a previous leg produced (GenerateRequest.prior_output_tokens):
    # the engine continues after them and counts them as output where that matters (penalties, a
    # script's position); max_tokens and min_tokens count new tokens only.
    prior_output_tokens: int = 0
    # Prefix caching (vLLM's fields): cached blocks are shared only between requests of one salt, and a
    # request that skips reading the cache computes its whole prompt (prompt_logprobs need it computed).
    cache_salt: str | None = None
    skip_reading_prefix_cache: bool = False


class PositionLogprobs(msgspec.Struct, array_like=True):
    """Logprobs of one position: the sampled token first, then the top-k candidates by rank.

    ``ranks`` are 1-based vocab ranks (the sampled token's true rank, then 1..k).
    """

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


# The abort cause of a client's own abort (/abort_requests, or a client that left): the only abort that
# ends a stream with finish_reason "abort" rather than an error.
ABORT_BY_CLIENT = "client"
# The server's own aborts: SIGTERM's --shutdown-timeout passed; a client read nothing for --stream-idle-timeout.
ABORT_FOR_SHUTDOWN = "shutdown"
ABORT_IDLE_STREAM = "idle stream"


class EngineOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One step's worth of output for one sequence (``index``) of a request.

    Fields at their defaults are left out of the encoding (the decoder fills them in): a typical
    output carries a request id and one token, and a step's message shrinks to about 40% of its
    size, with less to encode in the core and to decode in the frontend, per token."""

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
    # A decode leg's KV pull (its first outputs only): the READ's seconds and the bytes it brought.
    kv_pull_seconds: float | None = None
    kv_pull_bytes: int | None = None
    # time.monotonic() (one clock for every process of a host) when the request first ran in a step;
    # set on a request's first outputs only, so the frontend can tell queueing from generation.
    scheduled_at: float | None = None
    # With finish_reason "abort": why, as the frontend said when it aborted (ABORT_BY_CLIENT, or the
    # server's own reason: shutdown, an idle stream). None: the engine aborted on its own (it shut down,
    # vLLM dropped the request), which the frontend reports as a failure, never as a normal end.
    abort_cause: str | None = None

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
    # Tokens one engine step computes, decode rows and prompt chunks (--max-num-batched-tokens); None: the
    # engine has no such budget (scripted) or its own default.
    max_num_batched_tokens: int | None = None
    # Automatic prefix caching (--enable-prefix-caching): the blocks it keeps and their size; None: off, or
    # the engine's own (vLLM).
    prefix_cache_blocks: int | None = None
    prefix_cache_block_size: int | None = None
    prefix_cache_block_bytes: int | None = None
    # Threads the model's ops run on (sized from the engine process's CPU affinity); None: no model.
    intra_op_threads: int | None = None
    # The kernels the model runs and why (pdserve.engine.kernels); None: no model.
    kernels: str | None = None
    # Where other engines pull this engine's KV from (``--kv-transfer`` on the torch engine).
    kv: KVAgentInfo | None = None
    # A KV connector of the engine's own that reads kv_transfer_params itself (vLLM's "NixlConnector").
    kv_connector: str | None = None
    # The legs this engine takes with a KV hand-off (engine.spec.KV_ROLES).
    kv_role: str = "both"


class EngineStats(msgspec.Struct, kw_only=True):
    running_requests: int = 0
    waiting_requests: int = 0
    running_sequences: int = 0
    # Prompt positions the model computed (prefill); a decode leg whose KV was pulled adds none.
    prompt_tokens_computed: int = 0
    # Prefix caching, in prompt positions (vLLM's prefix_cache_queries / prefix_cache_hits): looked up by
    # requests that read the cache, and found there. None: the engine caches no prefix.
    prefix_cache_queries: int | None = None
    prefix_cache_hits: int | None = None
    kv: KVStats | None = None
