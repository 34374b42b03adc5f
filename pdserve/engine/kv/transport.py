"""NIXL, the transfer library under vLLM's NixlConnector, for one engine's KV cache.

One agent per engine, named by its engine id, with the UCX backend; the KV cache itself is registered
once, as host memory (``"DRAM"``), at start-up, so nothing is copied on either side of a hand-off. A decode
engine adds a prefill engine's agent from the metadata that engine serves (``GET /kv/metadata``) and READs a
prompt's positions from the prefill's slot straight into its own slot: one descriptor per (keys or values,
layer, KV head), each a contiguous run of positions. The READ carries a notification (the prefill's lease id)
that the prefill engine receives when the data has been read: the "pulled, you may free it" signal.

No other transport exists: when NIXL cannot be loaded or fails, the engine says so and the
request fails (or recomputes, as the operator chose); nothing falls back silently.
"""

from __future__ import annotations

import logging
from typing import Any
from unittest import mock

from pdserve.engine.models import KVCache
from pdserve.protocol.kv import KVAgentInfo, KVLayout

log = logging.getLogger(__name__)

# Microseconds the NIXL progress thread sleeps between turns. The Python wrapper hard-codes 0, which
# spins a whole core even when idle (measured: ~50% of a core, 0.5 CPU-s per idle second); at 250 µs
# an idle agent costs ~1% and a transfer waits at most that long for its next turn.
PROGRESS_THREAD_DELAY_US = 250

NIXL_INSTALL_HINT = "pip install --no-deps nixl-cu12==1.5.1 (after the pinned torch; `make install` does it)"


class TransferError(RuntimeError):
    """A transfer could not be set up or failed (the remote is gone, the descriptors are bad)."""


def paced_config_type(api: Any) -> type:
    """NIXL's binding config class, with :data:`PROGRESS_THREAD_DELAY_US` as the least progress-thread pause.

    The wrapper (``nixl_agent``) builds its binding config itself and sets ``pthrDelay = 0``; an agent built
    while this class stands in for ``api.nixlBind.nixlAgentConfig`` gets the pause instead.
    """

    class PacedConfig(api.nixlBind.nixlAgentConfig):  # type: ignore[misc, name-defined]
        paced_by_pdserve = True

        def __setattr__(self, key: str, value: Any) -> None:
            super().__setattr__(key, max(value, PROGRESS_THREAD_DELAY_US) if key == "pthrDelay" else value)

    return PacedConfig


def _paced_agent(api: Any, name: str) -> Any:
    """A NIXL agent (UCX backend, progress thread) whose progress thread sleeps between turns."""
    with mock.patch.object(api.nixlBind, "nixlAgentConfig", paced_config_type(api)):
        return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))


def _nixl() -> Any:
    try:
        from nixl_cu12 import _api  # the PyPI wheel's module; the meta package "nixl" pulls CUDA variants
    except ImportError as e:
        raise RuntimeError(f"--kv-transfer nixl needs the NIXL library, which is not installed: {NIXL_INSTALL_HINT}") from e
    return _api


def slot_descriptors(base: int, num_slots: int, slot_positions: int, layout: KVLayout, slot: int, start: int,
                     end: int) -> list[tuple[int, int, int]]:
    """NIXL descriptors ``(address, bytes, device 0)`` of positions ``[start, end)`` of ``slot`` in a KV cache laid
    out ``[2, layers, num_slots, kv_heads, slot_positions, head_dim]`` at ``base``: one contiguous run per (keys or
    values, layer, KV head), in that order on every engine, so two caches of different slot counts or lengths
    pair up run by run."""
    row, heads = layout.row_bytes, layout.num_kv_heads
    size = (end - start) * row
    return [
        (base + (((kv_layer * num_slots + slot) * heads + head) * slot_positions + start) * row, size, 0)
        for kv_layer in range(2 * layout.num_layers)
        for head in range(heads)
    ]


class NixlTransport:
    """The engine's NIXL agent: its registered KV cache, the remote agents it knows, its READs."""

    backend = "nixl"

    def __init__(self, engine_id: str, cache: KVCache, layout: KVLayout) -> None:
        api = _nixl()
        self.engine_id, self.cache, self.layout = engine_id, cache, layout
        self._agent = _paced_agent(api, engine_id)
        if "UCX" not in self._agent.backends:
            raise RuntimeError(f"NIXL loaded but its UCX backend did not start (plugins: {self._agent.plugin_list})")
        self._agent.register_memory([(cache.data.data_ptr(), cache.nbytes, 0, "")], "DRAM")
        self._remotes: dict[str, str] = {}  # remote engine id -> agent name NIXL knows it by
        log.info("NIXL agent %s: the KV cache registered (%d slots, %.1f MiB of address space)",
                 engine_id, cache.num_slots, cache.nbytes / 2**20)

    def agent_info(self) -> KVAgentInfo:
        return KVAgentInfo(
            engine_id=self.engine_id,
            backend=self.backend,
            agent_metadata=self._agent.get_agent_metadata(),
            base_address=self.cache.data.data_ptr(),
            num_slots=self.cache.num_slots,
            slot_positions=self.cache.max_len,
            layout=self.layout,
        )

    def start_read(self, remote: KVAgentInfo, remote_slot: int, local_slot: int, start: int, end: int,
                   notify: bytes) -> Any:
        """Start READing positions ``[start, end)`` of the remote's ``remote_slot`` into this cache's
        ``local_slot``; ``notify`` reaches the remote when done."""
        cache = self.cache
        try:
            name = self._remotes.get(remote.engine_id)
            if name is None:
                name = self._remotes[remote.engine_id] = self._agent.add_remote_agent(remote.agent_metadata)
            local = self._agent.get_xfer_descs(slot_descriptors(
                cache.data.data_ptr(), cache.num_slots, cache.max_len, self.layout, local_slot, start, end), "DRAM")
            far = self._agent.get_xfer_descs(slot_descriptors(
                remote.base_address, remote.num_slots, remote.slot_positions, remote.layout, remote_slot, start, end),
                "DRAM")
            handle = self._agent.initialize_xfer("READ", local, far, name, notify)
            if self._agent.transfer(handle) == "ERR":
                handle.release()
                raise TransferError("NIXL refused to post the READ")
        except TransferError:
            raise
        except Exception as e:  # nixl raises its own error types (e.g. nixlRemoteDisconnectError)
            self._forget(remote.engine_id)
            raise TransferError(f"NIXL READ from {remote.engine_id} failed to start: {e!r}") from e
        return handle

    def state(self, handle: Any, remote_engine_id: str) -> str:
        """"DONE", "PROC" (still running) or "ERR"."""
        try:
            state = self._agent.check_xfer_state(handle)
        except Exception as e:  # noqa: BLE001 - a dead peer surfaces as an exception here
            log.warning("NIXL transfer from %s failed: %r", remote_engine_id, e)
            state = "ERR"
        if state == "ERR":
            self._forget(remote_engine_id)
        return state

    def release(self, handle: Any) -> None:
        try:
            handle.release()
        except Exception as e:  # noqa: BLE001 - a failed transfer may refuse release; nothing to do but log
            log.debug("releasing a NIXL transfer handle failed: %r", e)

    def notifications(self) -> list[bytes]:
        """Notifications remote agents sent since the last call (pulled request ids)."""
        return [msg for messages in self._agent.get_new_notifs().values() for msg in messages]

    def _forget(self, remote_engine_id: str) -> None:
        """Drop a remote agent after a failure, so a restarted peer is added afresh next time."""
        name = self._remotes.pop(remote_engine_id, None)
        if name is not None:
            try:
                self._agent.remove_remote_agent(name)
            except Exception as e:  # noqa: BLE001
                log.debug("removing NIXL remote agent %s failed: %r", name, e)
