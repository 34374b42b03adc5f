"""``stream_interval``: one stream chunk per N tokens of a sequence instead of one per engine step.

vLLM's ``--stream-interval`` and ``SamplingParams.stream_interval`` (the request's value raised to the
server's). A sequence's outputs are held and folded into one until N tokens have gathered; its outputs
up to and including the first that carries a token, and the one that finishes it, are released at once
(so time to first token and the end are never delayed).

It runs in one place, the engine: a request's outputs are held before they leave the engine's loop
(:class:`StreamIntervals`, in the one engine loop, :mod:`pdserve.engine.core_server`, whether the core
process or an in-process engine's thread runs it; the vLLM engine passes
the interval to vLLM, whose output processor holds the steps in between). The API process is then
woken once per chunk, not once per step, and the frontend's driver (:mod:`pdserve.serve.driver`)
forwards what it gets: the detokenizer, the parsers and the chunk builders run once per chunk with
the whole delta (as they do for any multi-token step).

The price: a stop string is found when its chunk reaches the frontend, so the engine may run up to
N - 1 tokens past it before it is told to stop; those are cut from the answer like any text after a
stop string.
"""

from __future__ import annotations

import msgspec

from pdserve.engine.messages import StepOutputs
from pdserve.protocol.engine import EngineOutput, EngineRequest, PositionLogprobs


class OutputCoalescer:
    """Holds each sequence's outputs until its chunk is due; :meth:`push` says what to release."""

    def __init__(self, interval: int) -> None:
        if interval < 1:
            raise ValueError(f"stream interval must be at least 1, got {interval}")
        self.interval = interval
        self._held: dict[int, list[EngineOutput]] = {}
        self._held_tokens: dict[int, int] = {}
        # Sequences that have released a token: from then on their outputs wait for a full chunk.
        self._started: set[int] = set()

    def push(self, out: EngineOutput) -> list[EngineOutput]:
        """Take one engine output; returns the outputs to apply now, in order (often none)."""
        index = out.index
        if index not in self._started:
            if out.new_token_ids:
                self._started.add(index)
            return [out]
        released: list[EngineOutput] = []
        held = self._held.get(index)
        if held and not _aligned(held, out):
            # Logprobs on one side only: folding would misalign them with the ids; send what is held.
            released.append(self._release(index))
            held = None
        if held is None:
            held = self._held[index] = []
            self._held_tokens[index] = 0
        held.append(out)
        self._held_tokens[index] += len(out.new_token_ids)
        if out.finish_reason is not None or self._held_tokens[index] >= self.interval:
            released.append(self._release(index))
        return released

    def _release(self, index: int) -> EngineOutput:
        held = self._held.pop(index)
        del self._held_tokens[index]
        return held[0] if len(held) == 1 else folded(held)


class StreamIntervals:
    """The held outputs of every request streamed with an interval above 1, over a loop's step batches."""

    def __init__(self) -> None:
        self._held: dict[str, OutputCoalescer] = {}

    def add(self, request: EngineRequest) -> None:
        """A request entered the loop: hold its outputs when it asks for chunks of more than one token."""
        if request.stream_interval > 1:
            self._held[request.request_id] = OutputCoalescer(request.stream_interval)

    def release(self, batch: StepOutputs) -> StepOutputs:
        """What of one step's batch goes out now: every output of a request without an interval, and a
        held request's outputs once its chunk is due. A request that ended is forgotten: each sequence's
        end is released at once, and what a sequence the frontend stopped itself still held is past its
        stop string."""
        held = self._held
        if not held:
            return batch
        outputs: list[EngineOutput] = []
        for output in batch.outputs:
            coalescer = held.get(output.request_id)
            if coalescer is None:
                outputs.append(output)
            else:
                outputs.extend(coalescer.push(output))
        for rid in batch.finished:
            held.pop(rid, None)
        for failure in batch.failed:
            held.pop(failure.request_id, None)
        batch.outputs = outputs
        return batch


def _has_logprobs(out: EngineOutput) -> bool | None:
    """Whether an output's ids come with logprobs (None: it has no ids, so either way folds)."""
    if not out.new_token_ids:
        return None
    return out.new_logprobs is not None


def _aligned(held: list[EngineOutput], out: EngineOutput) -> bool:
    """Whether ``out`` folds into ``held`` with logprobs still aligned: the held ids (all alike, by
    construction) and the new ones either both come with logprobs or both without."""
    has_new = _has_logprobs(out)
    has_held = next((has for has in map(_has_logprobs, held) if has is not None), None)
    return has_new is None or has_held is None or has_new == has_held


def folded(outputs: list[EngineOutput]) -> EngineOutput:
    """Consecutive outputs of one sequence as one: ids and logprobs joined in order, the end (finish and
    stop reasons, abort cause) from the last, what arrives once (prompt logprobs, the first scheduling
    stamp, KV hand-off params, a pull's figures) kept from whichever carried it."""
    last = outputs[-1]
    ids: list[int] = []
    logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs = scheduled_at = kv_params = pull_seconds = pull_bytes = None
    cached = 0
    for out in outputs:
        ids.extend(out.new_token_ids)
        if out.new_logprobs is not None and out.new_token_ids:  # an output without ids adds no positions
            logprobs = [] if logprobs is None else logprobs
            logprobs.extend(out.new_logprobs)
        prompt_logprobs = prompt_logprobs if prompt_logprobs is not None else out.prompt_logprobs
        scheduled_at = scheduled_at if scheduled_at is not None else out.scheduled_at
        kv_params = out.kv_transfer_params if out.kv_transfer_params is not None else kv_params
        cached = out.num_cached_tokens or cached
        if out.kv_pull_seconds is not None:
            pull_seconds, pull_bytes = out.kv_pull_seconds, out.kv_pull_bytes
    return msgspec.structs.replace(
        last, new_token_ids=ids, new_logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        scheduled_at=scheduled_at, kv_transfer_params=kv_params, num_cached_tokens=cached,
        kv_pull_seconds=pull_seconds, kv_pull_bytes=pull_bytes,
    )
