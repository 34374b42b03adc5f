"""What engine to run and how: a serialisable spec.

A msgspec Struct, so the serve CLI can hand it to the engine-core process unchanged;
both sides build the same engine from it (:mod:`pdserve.engine.factory`). It holds token ids
only: the serve layer encodes the scripted engine's text scripts before the engine sees them.
"""

from __future__ import annotations

import msgspec


class TokenScript(msgspec.Struct, frozen=True):
    """One script the scripted engine replays; ``fail_after`` makes it raise after that many tokens."""

    token_ids: list[int]
    fail_after: int | None = None


class EngineSpec(msgspec.Struct, kw_only=True):
    """Engine kind, model and limits (the fields the runners' ``from_spec`` read)."""

    kind: str  # "scripted" | "torch"
    model: str | None = None
    scripts: list[TokenScript] = msgspec.field(default_factory=list)  # scripted: what to replay
    vocab_size: int | None = None  # scripted: the vocabulary its ids come from
    eos_token_ids: list[int] = msgspec.field(default_factory=list)  # scripted: primary first
    tokens_per_step: int = 1
    step_ms: float = 0.0
    max_model_len: int | None = None
    max_num_seqs: int = 16
    dtype: str = "bfloat16"
    seed: int = 0
    batch_invariant: bool = False  # torch: fixed-shape matmuls (see docs/engine.md)
