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


KV_FAILURE_POLICIES = ("fail", "recompute")
# Which legs one server takes: both (one pool serves prefill and decode), or one of them.
KV_ROLES = ("both", "prefill", "decode")


class KVTransferSpec(msgspec.Struct, frozen=True, kw_only=True):
    """KV hand-off between engines (``--kv-transfer nixl``): this engine's identity and policies."""

    engine_id: str  # unique per engine start: names its NIXL agent and its leases
    host: str  # where decode engines fetch this engine's /kv/metadata (its server's HTTP address)
    port: int
    lease_s: float = 30.0  # how long exported KV waits for its pull
    pull_timeout_s: float = 30.0  # bound on one pull's READ (--kv-pull-timeout-s)
    failure_policy: str = "fail"  # a failed pull: "fail" the request, or "recompute" the prompt here
    # KV slots beside the running batch's that hand-offs hold: a finished prefill leg's KV until its pull, a decode
    # leg's pull before it runs (None: as many as max_num_seqs).
    handoff_slots: int | None = None
    block_size: int = 16
    api_key: str | None = None  # sent to peers' /kv/metadata (pools of one fleet share a key)
    role: str = "both"  # KV_ROLES: the legs this server takes (a leg of the other pool is a 400)
    # --engine vllm: the NIXL side channel vLLM's connector listens on (VLLM_NIXL_SIDE_CHANNEL_PORT;
    # None: vLLM's default). It is what vLLM's prefill params name as remote_port.
    side_channel_port: int | None = None


class EngineSpec(msgspec.Struct, kw_only=True):
    """Engine kind, model and limits (the fields the runners' ``from_spec`` read)."""

    kind: str  # "scripted" | "torch" | "vllm" (vLLM's AsyncLLM, in the server process)
    model: str | None = None
    scripts: list[TokenScript] = msgspec.field(default_factory=list)  # scripted: what to replay
    vocab_size: int | None = None  # scripted: the vocabulary its ids come from
    eos_token_ids: list[int] = msgspec.field(default_factory=list)  # scripted: primary first
    tokens_per_step: int = 1
    step_ms: float = 0.0
    max_model_len: int | None = None
    max_num_seqs: int = 16
    max_num_batched_tokens: int | None = None  # torch, vllm: tokens per step (None: the engine's default)
    enable_prefix_caching: bool | None = None  # torch, vllm: None: the engine's default (on for both)
    dtype: str = "bfloat16"
    dtype_reason: str = "--dtype"  # why this dtype (--dtype auto names the CPU's flags), for the banner
    seed: int = 0
    batch_invariant: bool = False  # torch: fixed-shape matmuls (see docs/engine.md)
    kv_transfer: KVTransferSpec | None = None  # torch: hand prompts' KV to / from other engines
