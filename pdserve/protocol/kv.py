"""KV hand-off on the wire: vLLM 0.33 NixlConnector's ``kv_transfer_params`` and what an engine
needs to pull a prompt's keys/values from another engine.

Routers (llm-d, vllm-router, Dynamo) relay ``kv_transfer_params`` opaquely between the prefill
and the decode leg, so pdserve reads and writes exactly vLLM's keys:

* prefill leg in: ``{"do_remote_decode": true}``;
* prefill leg out (finished by length or stop): ``do_remote_prefill: true, do_remote_decode:
  false, remote_block_ids (one list per KV group), remote_engine_id, remote_request_id,
  remote_host, remote_port, remote_num_tokens, remote_blocks_expiry_time, tp_size: 1``;
* decode leg in: those params sent back unchanged.

:func:`parse_kv_transfer_params` turns the dict into a typed intent (or a 400 naming the key);
keys pdserve does not read (``dcp_size``, ``remote_registration_generation``, ...) pass through.
"""

from __future__ import annotations

import math
from typing import Any, TypeGuard

import msgspec

from pdserve.protocol.errors import RequestError

PARAM = "kv_transfer_params"


class KVLayout(msgspec.Struct, frozen=True, kw_only=True):
    """The shape of a position's keys/values and of a block on the wire; two engines can hand off KV only when
    theirs are equal."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int  # token positions per block
    dtype: str  # "bfloat16" | "float32"
    itemsize: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one position of one (keys or values, layer, head): ``head_dim`` numbers."""
        return self.head_dim * self.itemsize

    @property
    def position_bytes(self) -> int:
        """Bytes of one position: keys and values of every layer and head."""
        return 2 * self.num_layers * self.num_kv_heads * self.row_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: ``block_size`` positions."""
        return self.position_bytes * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)


class KVAgentInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What a decode engine needs to READ straight from this engine's KV cache (``GET /kv/metadata``).

    The registered memory is the cache itself, ``[2, layers, num_slots, kv_heads, slot_positions, head_dim]``:
    a sequence's KV stays in its slot, and a pull READs a prefill's slot into a decode engine's slot. On the wire
    (vLLM's ``remote_block_ids``) a slot's positions are blocks of ``layout.block_size``: slot ``s`` holds blocks
    ``s * blocks_per_slot`` on (:func:`slot_block_ids`, :meth:`slot_of`).
    """

    engine_id: str
    backend: str  # "nixl"
    agent_metadata: bytes  # nixl_agent.get_agent_metadata(): the agent and its registered memory
    base_address: int  # address of the registered KV cache
    num_slots: int
    slot_positions: int  # positions of one slot (the engine's max_model_len)
    layout: KVLayout

    @property
    def blocks_per_slot(self) -> int:
        return self.layout.blocks_for(self.slot_positions)

    def slot_of(self, block_ids: list[int], num_tokens: int) -> int:
        """The slot whose first ``num_tokens`` positions ``block_ids`` name; ValueError when they are not exactly
        those blocks of one slot of this engine."""
        per_slot = self.blocks_per_slot
        slot = block_ids[0] // per_slot if block_ids else -1
        if not 0 <= slot < self.num_slots or num_tokens > self.slot_positions:
            raise ValueError(f"remote block ids must name one of the prefill engine's {self.num_slots} KV slots")
        if block_ids != slot_block_ids(slot, num_tokens, self.slot_positions, self.layout):
            raise ValueError(f"remote block ids must be the first {self.layout.blocks_for(num_tokens)} blocks of "
                             "one KV slot, in order")
        return slot


def slot_block_ids(slot: int, num_tokens: int, slot_positions: int, layout: KVLayout) -> list[int]:
    """The wire's block ids of positions ``[0, num_tokens)`` of ``slot`` in a cache of ``slot_positions`` positions
    per slot (a prefill response's ``remote_block_ids``)."""
    first = slot * layout.blocks_for(slot_positions)
    return list(range(first, first + layout.blocks_for(num_tokens)))


class KVPull(msgspec.Struct, frozen=True, kw_only=True):
    """A decode leg: pull the prompt's KV that ``remote_engine_id`` holds for ``remote_request_id``."""

    remote_engine_id: str
    remote_request_id: str
    block_ids: list[int]
    num_tokens: int
    host: str
    port: int
    expiry_time: float | None  # unix time after which the prefill side may have freed the blocks


class KVIntent(msgspec.Struct, frozen=True):
    """What a request's kv_transfer_params ask of this engine."""

    export: bool = False  # prefill leg: keep the prompt's KV for a remote decode
    # decode leg: the prompt's KV comes from a remote prefill (pdserve's engines pull it themselves,
    # per ``pull``; vLLM's connector reads the params on its own, and ``pull`` is then None).
    remote_prefill: bool = False
    pull: KVPull | None = None

    @property
    def any(self) -> bool:
        return self.export or self.remote_prefill


NO_KV = KVIntent()


def parse_kv_transfer_params(params: dict[str, Any] | None, *, pulls: bool = True) -> KVIntent:
    """The typed intent of a request's ``kv_transfer_params`` (vLLM NixlConnector keys).

    Raises :class:`RequestError` (400, ``param="kv_transfer_params"``) for values of the wrong
    type, both legs at once, a transfer pdserve does not do (``transfer_mode: "push"``, a
    tensor-parallel prefill) or a decode leg missing where to pull from. With ``pulls=False`` (an
    engine whose own connector reads the params: vLLM's NixlConnector) a decode leg's pull keys are
    left to that connector, whose ``remote_port`` is its NIXL side channel.
    """
    if not params:
        return NO_KV
    if not isinstance(params, dict):
        raise RequestError(f"{PARAM} must be an object", param=PARAM)
    remote_decode = _flag(params, "do_remote_decode")
    remote_prefill = _flag(params, "do_remote_prefill")
    if remote_decode and remote_prefill:
        raise RequestError(f"{PARAM}: do_remote_decode and do_remote_prefill cannot both be true", param=PARAM)
    mode = params.get("transfer_mode", "pull")
    if mode != "pull":
        raise RequestError(f"{PARAM}.transfer_mode {mode!r} is not supported; pdserve pulls (\"pull\")", param=PARAM)
    if remote_decode:
        return KVIntent(export=True)
    if not remote_prefill:
        return NO_KV
    if not pulls:
        return KVIntent(remote_prefill=True)
    tp_size = params.get("tp_size", 1)
    if tp_size != 1:
        raise RequestError(f"{PARAM}.tp_size {tp_size!r}: pdserve pulls from tensor-parallel size 1 only", param=PARAM)
    groups = params.get("remote_block_ids")
    if not isinstance(groups, list) or not groups:
        raise RequestError(f"{PARAM}.remote_block_ids must be a non-empty list of lists of block ids", param=PARAM)
    if not all(isinstance(g, list) for g in groups):
        groups = [groups]  # a flat list (older vLLM): one KV group
    if len(groups) != 1:
        raise RequestError(f"{PARAM}.remote_block_ids has {len(groups)} KV groups; pdserve models have one", param=PARAM)
    block_ids = groups[0]
    if not all(_is_int(b) and b >= 0 for b in block_ids):
        raise RequestError(f"{PARAM}.remote_block_ids must hold non-negative integers", param=PARAM)
    expiry = params.get("remote_blocks_expiry_time")
    if expiry is not None and (not isinstance(expiry, int | float) or isinstance(expiry, bool)):
        raise RequestError(f"{PARAM}.remote_blocks_expiry_time must be a number (unix time)", param=PARAM)
    return KVIntent(
        remote_prefill=True,
        pull=KVPull(
            remote_engine_id=_string(params, "remote_engine_id"),
            remote_request_id=_string(params, "remote_request_id"),
            block_ids=list(block_ids),
            num_tokens=_count(params, "remote_num_tokens"),
            host=_string(params, "remote_host"),
            port=_port(params),
            expiry_time=None if expiry is None else float(expiry),
        )
    )


def prefill_params(
    *, engine_id: str, request_id: str, block_ids: list[int], num_tokens: int, host: str, port: int,
    expiry_time: float,
) -> dict[str, Any]:
    """The prefill response's ``kv_transfer_params``: what the decode leg sends back (vLLM's keys)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [list(block_ids)],
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "remote_num_tokens": num_tokens,
        "remote_blocks_expiry_time": expiry_time,
        "tp_size": 1,
    }


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _flag(params: dict[str, Any], key: str) -> bool:
    value = params.get(key, False)
    if not isinstance(value, bool):
        raise RequestError(f"{PARAM}.{key} must be true or false", param=PARAM)
    return value


def _string(params: dict[str, Any], key: str) -> str:
    value = params.get(key)
    if not isinstance(value, str) or not value:
        raise RequestError(f"{PARAM}.{key} must be a non-empty string (the prefill response's value)", param=PARAM)
    return value


def _count(params: dict[str, Any], key: str) -> int:
    value = params.get(key)
    if not _is_int(value) or value < 1:
        raise RequestError(f"{PARAM}.{key} must be a positive integer", param=PARAM)
    return value


def _port(params: dict[str, Any]) -> int:
    value = params.get("remote_port")
    if not _is_int(value) or not 0 < value < 65536:
        raise RequestError(f"{PARAM}.remote_port must be a TCP port (1-65535)", param=PARAM)
    return value


# Upper bounds (seconds) of the pull-latency histogram's buckets; the last bucket is +Inf.
PULL_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class KVStats(msgspec.Struct, kw_only=True):
    """An engine's KV hand-off counters (cumulative unless said otherwise), served in ``/metrics``."""

    slots: int = 0  # KV slots: the running batch's and those hand-offs hold (--max-num-seqs + --kv-handoff-slots)
    free_slots: int = 0  # now
    held_blocks: int = 0  # now: blocks of exported prompts waiting for their remote decode (leases)
    held_requests: int = 0  # now: those prompts (each holds its slot)
    exported_blocks: int = 0
    exported_requests: int = 0
    leases_pulled: int = 0  # freed because the decode engine said it pulled them
    leases_expired: int = 0  # freed because nobody pulled them in time
    pulls_ok: int = 0
    pulls_failed: int = 0
    recomputes: int = 0  # failed pulls answered by prefilling here (--kv-load-failure-policy recompute)
    pulled_blocks: int = 0
    pulled_bytes: int = 0
    pulled_tokens: int = 0
    # Blocks of a decode leg's prompt found in its own prefix cache, so not pulled (copied locally instead).
    local_prefix_blocks: int = 0
    # Pull latency (start of the READ to its end): a count per bucket of PULL_SECONDS_BUCKETS + one for +Inf.
    pull_seconds_counts: list[int] = msgspec.field(default_factory=lambda: [0] * (len(PULL_SECONDS_BUCKETS) + 1))
    pull_seconds_sum: float = 0.0

    def observe_pull(self, seconds: float) -> None:
        bucket = next((i for i, bound in enumerate(PULL_SECONDS_BUCKETS) if seconds <= bound), len(PULL_SECONDS_BUCKETS))
        self.pull_seconds_counts[bucket] += 1
        self.pull_seconds_sum += seconds
