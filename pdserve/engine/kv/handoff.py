"""KV hand-off bookkeeping of one engine: leases on the prefill side, pulls on the decode side.

Nothing is copied on either side: the NIXL-registered memory is the KV cache itself (``transport.py``).

Prefill side: a request with ``do_remote_decode`` runs like any other; when it finishes by length or stop its
slot leaves the running batch but stays held (the scheduler's :meth:`~pdserve.engine.scheduler.Scheduler.hold`)
under a lease, until the decode engine's "pulled" notification arrives or ``lease_s`` passes. Held KV counts
against the slots, so when every slot is held new requests wait, never fail.

Decode side: a request with ``do_remote_prefill`` waits (outside the scheduler) while the remote engine's
metadata is fetched and a free slot is taken; the leading blocks its own prefix cache holds are copied into
that slot and the NIXL READ brings the rest straight from the prefill's slot. Then the request enters the
scheduler with that slot, runs there, and decodes from the last prompt token. A pull that cannot work (peer
unreachable, lease expired, bad block ids, transfer error or timeout) is reported to the step loop, which
applies ``--kv-load-failure-policy``.

Everything here runs on the step loop's thread; only the metadata fetch runs on a worker thread.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdserve.engine.kv.peers import PeerDirectory
from pdserve.engine.kv.prefix_cache import PrefixCache
from pdserve.engine.kv.transport import NixlTransport, TransferError
from pdserve.engine.spec import KVTransferSpec
from pdserve.protocol.kv import KVPull, KVStats, prefill_params, slot_block_ids

log = logging.getLogger(__name__)


class Slots(Protocol):
    """The scheduler's held slots (:class:`~pdserve.engine.scheduler.Scheduler`)."""

    @property
    def free_slots(self) -> int: ...

    def take_slot(self) -> int | None: ...

    def free_slot(self, slot: int) -> None: ...


@dataclass
class _Lease:
    request_id: str  # the engine request that exported its KV
    slot: int
    num_tokens: int
    expires: float  # monotonic


@dataclass
class _Pull:
    pull: KVPull
    slot: int | None = None  # the held slot the READ lands in
    handle: Any = None
    read_started: float = 0.0
    abandoned: bool = False  # aborted or timed out: free the slot once NIXL lets go of it
    # The READ finished: the slot holds the prompt's KV until the request runs there. It may wait for room in
    # the running batch for many steps; nothing may READ again, as the prefill engine freed (and may reuse) its
    # slot on the first READ's notification.
    landed: bool = False
    # The keys of the prompt's full blocks in this engine's prefix cache: the leading ones it holds are
    # copied from there, and only the rest is READ.
    prefix_keys: list[bytes] = field(default_factory=list)
    reused_tokens: int = 0
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
        transport: NixlTransport,
        peers: PeerDirectory,
        slots: Slots,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.spec, self.transport, self.peers, self.slots = spec, transport, peers, slots
        self.layout = transport.layout
        self.prefix_cache = prefix_cache  # a pull READs only the positions this cache lacks
        self._clock, self._wall = clock, wall
        self._leases: dict[str, _Lease] = {}  # exported lease id -> the slot awaiting its pull
        self._pulls: dict[str, _Pull] = {}  # decode requests -> their pull
        self._lease_ids = itertools.count()
        self._stats = KVStats(slots=transport.cache.num_slots)

    # -- prefill side ------------------------------------------------------------------------

    def export(self, request_id: str, slot: int, num_tokens: int) -> dict[str, Any]:
        """Lease a finished prompt's slot (the caller holds it, :meth:`Scheduler.hold`) and return the response's
        params: its first ``num_tokens`` positions, as the wire's blocks."""
        lease_id = f"{request_id}@{next(self._lease_ids)}"  # unique even when a client reuses its id
        self._leases[lease_id] = _Lease(request_id, slot, num_tokens, self._clock() + self.spec.lease_s)
        blocks = slot_block_ids(slot, num_tokens, self.transport.cache.max_len, self.layout)
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
        if len(pull.block_ids) != self.layout.blocks_for(pull.num_tokens):
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

    def landed_slot(self, request_id: str) -> int:
        """The held slot a finished pull's KV is in (the request runs there)."""
        slot = self._pulls[request_id].slot
        assert slot is not None
        return slot

    def load(self, request_id: str) -> LoadedPull:
        """A finished pull's request is placed in its slot: the slot is the scheduler's now; what the pull did."""
        p = self._pulls.pop(request_id)
        read = p.pull.num_tokens - p.reused_tokens
        return LoadedPull(p.reused_tokens, p.seconds, read * self.layout.position_bytes)

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
        """Free the slots of leases whose decode engine pulled them, and of those that expired unpulled."""
        for message in self.transport.notifications():
            lease = self._leases.pop(message.decode(errors="replace"), None)
            if lease is not None:
                self.slots.free_slot(lease.slot)
                self._stats.leases_pulled += 1
        now = self._clock()
        for lease_id in [k for k, lease in self._leases.items() if lease.expires <= now]:
            lease = self._leases.pop(lease_id)
            self.slots.free_slot(lease.slot)
            self._stats.leases_expired += 1
            log.warning("KV lease %s expired after %.0fs without a pull: its slot is free", lease_id, self.spec.lease_s)

    def stats(self) -> KVStats:
        s = self._stats
        s.free_slots = self.slots.free_slots
        s.held_blocks = sum(self.layout.blocks_for(lease.num_tokens) for lease in self._leases.values())
        s.held_requests = len(self._leases)
        return s

    def close(self) -> None:
        self.peers.close()

    # -- internals ---------------------------------------------------------------------------

    def _try_start(self, request_id: str, p: _Pull) -> None:
        info = self.peers.lookup(p.pull)
        if info is None:
            return  # metadata still on its way
        try:
            remote_slot = info.slot_of(p.pull.block_ids, p.pull.num_tokens)
        except ValueError as e:
            raise TransferError(str(e)) from e
        if p.pull.expiry_time is not None and self._wall() >= p.pull.expiry_time:
            raise TransferError("the prefill engine's lease on the KV expired before the pull could start")
        if p.slot is None:
            p.slot = self.slots.take_slot()
            if p.slot is None:
                return  # every slot is taken: wait for one
        p.reused_tokens = self._copy_cached_prefix(p, p.slot)
        p.read_started = self._clock()
        p.handle = self.transport.start_read(info, remote_slot, p.slot, p.reused_tokens, p.pull.num_tokens,
                                             p.pull.remote_request_id.encode())

    def _copy_cached_prefix(self, p: _Pull, slot: int) -> int:
        """Fill the slot's leading positions the prefix cache holds (never the last prompt position: something is
        always READ, and the READ's notification frees the prefill engine's lease); how many."""
        cache = self.prefix_cache
        if cache is None or not p.prefix_keys:
            return 0
        hit = cache.hit_blocks(p.prefix_keys, p.pull.num_tokens)
        return cache.load(p.prefix_keys[:hit], self.transport.cache, slot)

    def _check(self, request_id: str, p: _Pull, progress: PullProgress) -> None:
        state = self.transport.state(p.handle, p.pull.remote_engine_id)
        if state == "PROC":
            # A READ still running after --kv-pull-timeout-s has failed (the peer hangs); its slot stays held
            # until NIXL is done with it, so a late write never lands in another request's KV.
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
        read = p.pull.num_tokens - p.reused_tokens
        s = self._stats
        if self.prefix_cache is not None:
            s.local_prefix_blocks += p.reused_tokens // self.prefix_cache.block_size
        s.pulls_ok += 1
        s.pulled_blocks += len(p.pull.block_ids) - p.reused_tokens // self.layout.block_size
        s.pulled_bytes += read * self.layout.position_bytes
        s.pulled_tokens += read
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
        if p.slot is not None:
            self.slots.free_slot(p.slot)
            p.slot = None
