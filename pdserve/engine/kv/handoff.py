"""KV hand-off bookkeeping of one engine: leases on the prefill side, pulls on the decode side.

Prefill side: a request with ``do_remote_decode`` reserves pool blocks before it runs (held KV
counts against capacity, so a full pool makes new prefill legs wait, never fail); when it
finishes by length or stop its prompt's keys/values are copied into those blocks and held under a
lease until the decode engine's "pulled" notification arrives or ``lease_s`` passes.

Decode side: a request with ``do_remote_prefill`` waits (outside the scheduler) while the remote
engine's metadata is fetched, local blocks are free and the NIXL READ runs; then the step loop
copies the blocks into the sequence's slot and decodes from the last prompt token. A pull that
cannot work (peer unreachable, lease expired, bad block ids, transfer error or timeout) is
reported to the step loop, which applies ``--kv-load-failure-policy``.

Everything here runs on the step loop's thread; only the metadata fetch runs on a worker thread.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.kv.peers import PeerDirectory
from pdserve.engine.kv.pool import KVBlockPool
from pdserve.engine.kv.prefix_cache import PrefixCache
from pdserve.engine.kv.transport import NixlTransport, TransferError
from pdserve.engine.models import KVCache
from pdserve.engine.spec import KVTransferSpec
from pdserve.protocol.kv import KVPull, KVStats, prefill_params

log = logging.getLogger(__name__)


@dataclass
class _Lease:
    request_id: str  # the engine request that exported the blocks
    blocks: list[int]
    expires: float  # monotonic


@dataclass
class _Pull:
    pull: KVPull
    local_blocks: list[int] | None = None
    handle: Any = None
    read_started: float = 0.0
    abandoned: bool = False  # aborted or timed out: free the blocks once NIXL lets go of them
    # The READ finished: the blocks hold the prompt's KV until load(). The request may wait for an engine
    # slot for many steps; nothing may READ again, as the prefill engine freed (and may reuse) the remote
    # blocks on the first READ's notification.
    landed: bool = False
    # The keys of the prompt's full blocks in this engine's prefix cache: the leading ones it holds are
    # copied from there, and only the rest is READ.
    prefix_keys: list[bytes] = field(default_factory=list)
    local_blocks_reused: int = 0
    seconds: float = 0.0  # the READ's, once it landed


@dataclass(frozen=True)
class LoadedPull:
    """What a decode leg's KV load reports: positions from this engine's prefix cache, the READ's seconds and
    bytes."""

    reused_tokens: int
    seconds: float
    bytes: int


@dataclass
class PullProgress:
    """What :meth:`KVHandoff.advance` has to report: pulls that finished, and those that failed (why)."""

    ready: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)


class KVHandoff:
    def __init__(
        self,
        spec: KVTransferSpec,
        pool: KVBlockPool,
        transport: NixlTransport,
        peers: PeerDirectory,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.spec, self.pool, self.transport, self.peers = spec, pool, transport, peers
        # Pulls read only the blocks this cache lacks (when its blocks are laid out as the pool's).
        self.prefix_cache = prefix_cache if prefix_cache is not None and prefix_cache.pool.layout == pool.layout else None
        self._clock, self._wall = clock, wall
        self._reserved: dict[str, list[int]] = {}  # prefill requests running now -> their blocks
        self._leases: dict[str, _Lease] = {}  # exported lease id -> blocks awaiting their pull
        self._pulls: dict[str, _Pull] = {}  # decode requests -> their pull
        self._lease_ids = itertools.count()
        self._stats = KVStats(pool_blocks=pool.num_blocks)

    # -- prefill side ------------------------------------------------------------------------

    def reserve(self, request_id: str, num_tokens: int) -> bool:
        """Hold blocks for a prefill leg's prompt; False when the pool cannot hold it now."""
        blocks = self.pool.allocate(num_tokens)
        if blocks is None:
            return False
        self._reserved[request_id] = blocks
        return True

    def cancel(self, request_id: str) -> None:
        """The request ended without exporting (aborted, stopped): give its blocks back."""
        blocks = self._reserved.pop(request_id, None)
        if blocks is not None:
            self.pool.free(blocks)

    def export(self, request_id: str, cache: KVCache, slot: int, num_tokens: int) -> dict[str, Any]:
        """Copy a finished prompt's KV into its blocks, lease them, and return the response's params."""
        blocks = self._reserved.pop(request_id)
        self.pool.save(cache, slot, num_tokens, blocks)
        lease_id = f"{request_id}@{next(self._lease_ids)}"  # unique even when a client reuses its id
        self._leases[lease_id] = _Lease(request_id, blocks, self._clock() + self.spec.lease_s)
        self._stats.exported_blocks += len(blocks)
        self._stats.exported_requests += 1
        return prefill_params(
            engine_id=self.spec.engine_id, request_id=lease_id, block_ids=blocks, num_tokens=num_tokens,
            host=self.spec.host, port=self.spec.port, expiry_time=self._wall() + self.spec.lease_s,
        )

    # -- decode side -------------------------------------------------------------------------

    def begin_pull(self, request_id: str, pull: KVPull, prompt_len: int, prefix_keys: Sequence[bytes] = ()
                   ) -> str | None:
        """Start pulling a decode leg's KV (``prefix_keys``: its prompt's block keys in the prefix cache, empty
        when none may be read); returns why it cannot work instead (nothing is held then)."""
        if pull.num_tokens != prompt_len:
            return f"the prefill computed {pull.num_tokens} prompt tokens but this prompt has {prompt_len}"
        if len(pull.block_ids) != self.pool.layout.blocks_for(pull.num_tokens):
            return f"{len(pull.block_ids)} remote blocks cannot hold exactly {pull.num_tokens} tokens"
        if pull.expiry_time is not None and self._wall() >= pull.expiry_time:
            return f"the prefill engine's lease on the KV expired {self._wall() - pull.expiry_time:.1f}s ago"
        self._pulls[request_id] = _Pull(pull, prefix_keys=list(prefix_keys))
        return None

    def advance(self) -> PullProgress:
        """Move every pull on by one non-blocking look."""
        progress = PullProgress()
        for request_id, p in list(self._pulls.items()):
            if p.landed:
                continue
            try:
                if p.handle is None:
                    self._try_start(request_id, p)
                else:
                    self._check(request_id, p, progress)
            except TransferError as e:
                self._fail(request_id, p, str(e), progress)
        return progress

    def load(self, request_id: str, cache: KVCache, slot: int, num_tokens: int) -> LoadedPull:
        """Copy a finished pull's blocks into a slot (positions ``[0, num_tokens)``) and free them."""
        p = self._pulls.pop(request_id)
        assert p.local_blocks is not None
        self.pool.load(cache, slot, num_tokens, p.local_blocks)
        self.pool.free(p.local_blocks)
        read_blocks = len(p.pull.block_ids) - p.local_blocks_reused
        return LoadedPull(p.local_blocks_reused * self.pool.layout.block_size, p.seconds,
                          read_blocks * self.pool.layout.block_bytes)

    def drop(self, request_id: str) -> None:
        """The request is gone (aborted): stop caring about its pull; blocks free once NIXL is done."""
        p = self._pulls.get(request_id)
        if p is None:
            return
        if p.handle is None:
            self._release(request_id, p)
        else:
            p.abandoned = True

    def pending(self) -> bool:
        """Pulls in flight: the step loop keeps turning to watch them (a landed one waits in the scheduler)."""
        return any(not p.landed for p in self._pulls.values())

    def waiting_for(self, request_id: str) -> bool:
        p = self._pulls.get(request_id)
        return p is not None and not p.abandoned

    def count_recompute(self) -> None:
        self._stats.recomputes += 1

    # -- both sides --------------------------------------------------------------------------

    def poll(self) -> None:
        """Free leases whose decode engine pulled them, and those that expired unpulled."""
        for message in self.transport.notifications():
            lease = self._leases.pop(message.decode(errors="replace"), None)
            if lease is not None:
                self.pool.free(lease.blocks)
                self._stats.leases_pulled += 1
        now = self._clock()
        for lease_id in [k for k, lease in self._leases.items() if lease.expires <= now]:
            lease = self._leases.pop(lease_id)
            self.pool.free(lease.blocks)
            self._stats.leases_expired += 1
            log.warning(
                "KV lease %s expired after %.0fs without a pull: %d blocks freed",
                lease_id, self.spec.lease_s, len(lease.blocks),
            )

    def stats(self) -> KVStats:
        s = self._stats
        s.free_blocks = self.pool.num_free
        s.held_blocks = sum(len(lease.blocks) for lease in self._leases.values())
        s.held_requests = len(self._leases)
        return s

    def close(self) -> None:
        self.peers.close()

    # -- internals ---------------------------------------------------------------------------

    def _try_start(self, request_id: str, p: _Pull) -> None:
        info = self.peers.lookup(p.pull)
        if info is None:
            return  # metadata still on its way
        if any(b >= info.num_blocks for b in p.pull.block_ids):
            raise TransferError(f"remote block ids must be below the prefill pool's {info.num_blocks} blocks")
        if p.pull.expiry_time is not None and self._wall() >= p.pull.expiry_time:
            raise TransferError("the prefill engine's lease on the KV expired before the pull could start")
        if p.local_blocks is None:
            p.local_blocks = self.pool.allocate(p.pull.num_tokens)
            if p.local_blocks is None:
                return  # the pool is full: wait for blocks
        reused = self._copy_cached_prefix(p)
        p.read_started = self._clock()
        p.handle = self.transport.start_read(info, p.pull.block_ids[reused:], p.local_blocks[reused:],
                                             p.pull.remote_request_id.encode())

    def _copy_cached_prefix(self, p: _Pull) -> int:
        """Fill the leading local blocks the prefix cache holds (at least the last block is always READ: the
        READ's notification frees the prefill engine's lease); how many."""
        cache = self.prefix_cache
        assert p.local_blocks is not None
        if cache is None or not p.prefix_keys:
            return 0
        reused = min(cache.hit_blocks(p.prefix_keys, p.pull.num_tokens), len(p.pull.block_ids) - 1)
        cache.copy_to(p.prefix_keys[:reused], self.pool, p.local_blocks[:reused])
        p.local_blocks_reused = reused
        return reused

    def _check(self, request_id: str, p: _Pull, progress: PullProgress) -> None:
        state = self.transport.state(p.handle, p.pull.remote_engine_id)
        if state == "PROC":
            # A READ still running after --kv-pull-timeout-s has failed (the peer hangs); its blocks stay
            # reserved until NIXL is done with them, so a late write never lands in another request's blocks.
            if not p.abandoned and self._clock() - p.read_started > self.spec.pull_timeout_s:
                p.abandoned = True
                self._stats.pulls_failed += 1
                progress.failed.append((request_id, f"the KV READ did not finish within {self.spec.pull_timeout_s:g}s (--kv-pull-timeout-s)"))
            return
        self.transport.release(p.handle)
        p.handle = None
        if p.abandoned:
            self._release(request_id, p)
            return
        if state != "DONE":
            self.peers.forget(p.pull.remote_engine_id)
            raise TransferError(f"the NIXL READ from engine {p.pull.remote_engine_id} failed")
        seconds = self._clock() - p.read_started
        blocks = len(p.pull.block_ids) - p.local_blocks_reused
        s = self._stats
        s.local_prefix_blocks += p.local_blocks_reused
        s.pulls_ok += 1
        s.pulled_blocks += blocks
        s.pulled_bytes += blocks * self.pool.layout.block_bytes
        s.pulled_tokens += p.pull.num_tokens - p.local_blocks_reused * self.pool.layout.block_size
        s.observe_pull(seconds)
        p.seconds = seconds
        p.landed = True
        progress.ready.append(request_id)

    def _fail(self, request_id: str, p: _Pull, reason: str, progress: PullProgress) -> None:
        if p.handle is not None:
            self.transport.release(p.handle)
            p.handle = None
        self._release(request_id, p)
        self._stats.pulls_failed += 1
        progress.failed.append((request_id, reason))

    def _release(self, request_id: str, p: _Pull) -> None:
        self._pulls.pop(request_id, None)
        if p.local_blocks is not None:
            self.pool.free(p.local_blocks)
            p.local_blocks = None
