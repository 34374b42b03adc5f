"""Per-request and per-sequence state of the torch step loop (touched by its thread only)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.sampler import SequenceState
from pdserve.protocol.engine import SequenceSampling


@dataclass(eq=False)
class ScheduledSequence:
    """One of a request's ``n`` sequences: its KV slot, cache fill and sampler state."""

    request: ScheduledRequest
    index: int
    state: SequenceState  # what the sampler keeps per sequence: output ids, generator, penalty counts
    slot: int = -1
    num_cached: int = 0  # positions with keys/values in the cache
    live: bool = True
    prefilled_in_step: int = -1  # the step whose prefill sampled its first token (it decodes from the next)

    @property
    def output(self) -> list[int]:
        return self.state.output


@dataclass(eq=False)
class ScheduledRequest:
    """A request as the scheduler sees it (it admits whole requests: all ``n`` sequences at once)."""

    request_id: str
    prompt: list[int]
    sampling: SequenceSampling
    stop_ids: frozenset[int]
    sequences: list[ScheduledSequence] = field(default_factory=list)
    scheduled_at: float | None = None  # time.monotonic() of its admission into the running batch
    # Prefix caching: the salt its blocks are keyed with, the keys of its prompt's full blocks (empty when
    # the engine caches nothing), whether it may read cached blocks, and how many positions it read.
    cache_salt: str | None = None
    prefix_keys: list[bytes] = field(default_factory=list)
    reads_prefix_cache: bool = False
    cached_tokens: int = 0
    kv_pull: tuple[float, int] | None = None  # a pulled decode leg's READ: seconds, bytes
    held_slot: int | None = None  # a pulled decode leg: the held slot its KV landed in, until it is placed there

    @property
    def num_seqs(self) -> int:
        return self.sampling.n

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)
