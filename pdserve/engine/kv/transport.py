"""NIXL, the transfer library under vLLM's NixlConnector, for one engine's block pool.

One agent per engine, named by its engine id, with the UCX backend; the pool is registered
once, as host memory (``"DRAM"``), at start-up. A decode engine adds a prefill engine's agent
from the metadata that engine serves (``GET /kv/metadata``) and READs blocks from it; the READ
carries a notification (the prefill's request id) that the prefill engine receives when the
data has been read: the "pulled, you may free it" signal.

No other transport exists: when NIXL cannot be loaded or fails, the engine says so and the
request fails (or recomputes, as the operator chose); nothing falls back silently.
"""

from __future__ import annotations

import logging
from typing import Any
from unittest import mock

from pdserve.engine.kv.pool import KVBlockPool
from pdserve.protocol.kv import KVAgentInfo

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


class NixlTransport:
    """The engine's NIXL agent: its registered pool, the remote agents it knows, its READs."""

    backend = "nixl"

    def __init__(self, engine_id: str, pool: KVBlockPool) -> None:
        api = _nixl()
        self.engine_id, self.pool = engine_id, pool
        self._agent = _paced_agent(api, engine_id)
        if "UCX" not in self._agent.backends:
            raise RuntimeError(f"NIXL loaded but its UCX backend did not start (plugins: {self._agent.plugin_list})")
        self._agent.register_memory([(pool.base_address, pool.nbytes, 0, "")], "DRAM")
        self._remotes: dict[str, str] = {}  # remote engine id -> agent name NIXL knows it by
        log.info("NIXL agent %s: %d KV blocks (%.1f MiB) registered", engine_id, pool.num_blocks, pool.nbytes / 2**20)

    def agent_info(self) -> KVAgentInfo:
        return KVAgentInfo(
            engine_id=self.engine_id,
            backend=self.backend,
            agent_metadata=self._agent.get_agent_metadata(),
            base_address=self.pool.base_address,
            num_blocks=self.pool.num_blocks,
            layout=self.pool.layout,
        )

    def start_read(self, remote: KVAgentInfo, remote_blocks: list[int], local_blocks: list[int], notify: bytes) -> Any:
        """Start READing ``remote_blocks`` into ``local_blocks``; ``notify`` reaches the remote when done."""
        size = self.pool.layout.block_bytes
        try:
            name = self._remotes.get(remote.engine_id)
            if name is None:
                name = self._remotes[remote.engine_id] = self._agent.add_remote_agent(remote.agent_metadata)
            local = self._agent.get_xfer_descs([(self.pool.block_address(b), size, 0) for b in local_blocks], "DRAM")
            far = self._agent.get_xfer_descs([(remote.base_address + b * size, size, 0) for b in remote_blocks], "DRAM")
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
