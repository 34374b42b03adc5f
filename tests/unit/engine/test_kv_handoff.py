"""The KV hand-off pieces on their own: slot-to-slot descriptors (and a real NIXL READ between two caches in this
process), lease and pull bookkeeping over a real scheduler's slots (NIXL and the peer fetch replaced by fakes;
the real servers run in tests/e2e/test_kv_handoff.py), the prefix cache's block copies, the wire params."""

from __future__ import annotations

import uuid
from typing import Any

import msgspec
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pdserve.engine.kv.handoff import KVHandoff, PullProgress
from pdserve.engine.kv.peers import PeerDirectory
from pdserve.engine.kv.pool import KVBlockPool
from pdserve.engine.kv.prefix_cache import PrefixCache, block_hashes
from pdserve.engine.kv.transport import NixlTransport, TransferError, slot_descriptors
from pdserve.engine.models import KVCache, ModelConfig
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.spec import KVTransferSpec
from pdserve.protocol.errors import RequestError
from pdserve.protocol.kv import KVAgentInfo, KVLayout, KVPull, parse_kv_transfer_params, prefill_params, slot_block_ids
from tests.waiting import wait_until

CFG = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling=None,
    max_position_embeddings=128, tie_word_embeddings=True,
)
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32", itemsize=4)
SPEC = KVTransferSpec(engine_id="engine-a", host="127.0.0.1", port=8000, lease_s=10.0)


def filled_cache(slots: int = 3, max_len: int = 40, seed: int = 0) -> KVCache:
    cache = KVCache(CFG, slots, max_len, torch.float32)
    cache.data.copy_(torch.randn(cache.data.shape, generator=torch.Generator().manual_seed(seed)))
    return cache


def described(cache: KVCache, descriptors: list[tuple[int, int, int]]) -> torch.Tensor:
    """The numbers ``descriptors`` name in ``cache``, read through their addresses, in descriptor order."""
    base, flat = cache.data.data_ptr(), cache.data.view(-1)
    parts = []
    for address, size, device in descriptors:
        assert device == 0 and (address - base) % 4 == 0 and size % 4 == 0
        start = (address - base) // 4
        parts.append(flat[start : start + size // 4])
    return torch.cat(parts)


@given(slots=st.integers(1, 4), max_len=st.integers(1, 40), data=st.data())
def test_slot_descriptors_name_exactly_a_slots_positions_run_by_run(slots, max_len, data) -> None:  # type: ignore[no-untyped-def]
    """Each descriptor is one (keys or values, layer, KV head)'s positions [start, end) of the slot, so two caches
    of different slot counts and lengths pair up run by run (what a READ between engines relies on)."""
    cache = filled_cache(slots, max_len)
    slot = data.draw(st.integers(0, slots - 1))
    end = data.draw(st.integers(1, max_len))
    start = data.draw(st.integers(0, end - 1))
    descriptors = slot_descriptors(cache.data.data_ptr(), slots, max_len, LAYOUT, slot, start, end)
    assert len(descriptors) == 2 * LAYOUT.num_layers * LAYOUT.num_kv_heads
    assert {size for _, size, _ in descriptors} == {(end - start) * LAYOUT.row_bytes}
    assert torch.equal(described(cache, descriptors), cache.data[:, :, slot, :, start:end].reshape(-1))


def test_wire_blocks_name_the_first_positions_of_one_slot() -> None:
    info = KVAgentInfo(engine_id="e", backend="nixl", agent_metadata=b"", base_address=0, num_slots=3,
                       slot_positions=40, layout=LAYOUT)  # 10 blocks of 4 per slot
    assert slot_block_ids(2, 9, 40, LAYOUT) == [20, 21, 22] and info.slot_of([20, 21, 22], 9) == 2
    assert info.slot_of([0], 1) == 0
    for blocks, tokens in (([30, 31, 32], 9), ([21, 22, 23], 9), ([20, 22, 21], 9), ([], 1), ([0] * 11, 41)):
        with pytest.raises(ValueError, match="remote block ids"):
            info.slot_of(blocks, tokens)


def test_a_real_nixl_read_brings_a_slots_positions_into_another_cache() -> None:
    """Two NIXL agents in this process, each with its own cache registered as it is (other slot counts and
    lengths): a READ of positions [5, 23) of slot 2 lands in those positions of slot 0, nothing else is written,
    and the source engine gets the notification."""
    source, target = filled_cache(slots=3, max_len=40, seed=1), KVCache(CFG, 2, 32, torch.float32)
    prefill = NixlTransport(f"prefill-{uuid.uuid4().hex[:8]}", source, LAYOUT)
    decode = NixlTransport(f"decode-{uuid.uuid4().hex[:8]}", target, LAYOUT)
    handle = decode.start_read(prefill.agent_info(), 2, 0, 5, 23, b"lease-1")
    wait_until(lambda: decode.state(handle, prefill.engine_id) != "PROC", "the READ finished")
    assert decode.state(handle, prefill.engine_id) == "DONE"
    decode.release(handle)
    assert torch.equal(target.data[:, :, 0, :, 5:23], source.data[:, :, 2, :, 5:23])
    target.data[:, :, 0, :, 5:23] = 0
    assert not target.data.any()
    notes: list[bytes] = []
    wait_until(lambda: notes.extend(prefill.notifications()) or notes, "the prefill agent was notified")
    assert notes == [b"lease-1"]


@given(indices=st.lists(st.integers(0, 9), unique=True, min_size=1, max_size=9).map(sorted), first=st.integers(0, 2),
       slot=st.integers(0, 2))
def test_blocks_of_a_slot_go_to_the_pool_blocks_paired_with_them_and_back(indices, first, slot) -> None:  # type: ignore[no-untyped-def]
    """save_blocks / load_blocks (the prefix cache's): each slot block lands in its pool block, runs or not."""
    cache, other = filled_cache(), KVCache(CFG, 3, 40, torch.float32)
    pool = KVBlockPool(LAYOUT, 16, torch.float32)
    blocks = [first + i + (i >= 3) for i in range(len(indices))]  # a run with one gap
    pool.save_blocks(cache, slot, indices, blocks)
    size = LAYOUT.block_size
    for index, block in zip(indices, blocks, strict=True):
        assert torch.equal(pool.data[block],
                           cache.data[:, :, slot, :, index * size : (index + 1) * size])
    untouched = sorted(set(range(16)) - set(blocks))
    assert not pool.data[untouched].any()
    pool.load_blocks(other, 1, size, blocks)  # back, from block 1 of another slot on
    end = size * (1 + len(blocks))
    expected = torch.cat([cache.data[:, :, slot, :, i * size : (i + 1) * size] for i in indices], 3)
    assert torch.equal(other.data[:, :, 1, :, size:end], expected)
    assert not other.data[:, :, 1, :, :size].any() and not other.data[:, :, 1, :, end:].any()


class FakeTransport:
    """The NIXL calls over a real cache, scripted: states to report per READ, notifications to deliver."""

    def __init__(self, cache: KVCache) -> None:
        self.cache, self.layout = cache, LAYOUT
        self.states: list[str] = []
        self.notes: list[bytes] = []
        self.reads: list[tuple[int, int, int, int, bytes]] = []  # remote slot, local slot, start, end, notify
        self.released = 0

    def start_read(self, remote: KVAgentInfo, remote_slot: int, local_slot: int, start: int, end: int,
                   notify: bytes) -> Any:
        self.reads.append((remote_slot, local_slot, start, end, notify))
        return object()

    def state(self, handle: Any, remote_engine_id: str) -> str:
        return self.states.pop(0) if self.states else "PROC"

    def release(self, handle: Any) -> None:
        self.released += 1

    def notifications(self) -> list[bytes]:
        out, self.notes = self.notes, []
        return out


class FakePeers:
    def __init__(self, info: KVAgentInfo | None | Exception) -> None:
        self.info = info
        self.forgotten: list[str] = []

    def lookup(self, pull: KVPull) -> KVAgentInfo | None:
        if isinstance(self.info, Exception):
            raise self.info
        return self.info

    def forget(self, engine_id: str) -> None:
        self.forgotten.append(engine_id)

    def close(self) -> None:
        pass


# A prefill engine of 8 slots of 40 positions: 10 blocks of 4 per slot, so slot 1 holds blocks 10-19.
REMOTE = KVAgentInfo(engine_id="engine-b", backend="nixl", agent_metadata=b"md", base_address=1 << 20, num_slots=8,
                     slot_positions=40, layout=LAYOUT)
SLOTS = 4  # this engine's: 2 for the running batch, 2 for hand-offs


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Parts:
    """A hand-off over a real scheduler's slots and a real cache."""

    def __init__(self, peers: FakePeers | None = None, prefix: PrefixCache | None = None) -> None:
        self.cache = filled_cache(SLOTS)
        self.scheduler: Scheduler[Any, Any] = Scheduler(2, SLOTS)
        self.transport, self.clock = FakeTransport(self.cache), Clock()
        self.kv = KVHandoff(SPEC, self.transport, peers or FakePeers(REMOTE), self.scheduler,  # type: ignore[arg-type]
                            clock=self.clock, wall=self.clock, prefix_cache=prefix)


def pull(num_tokens: int = 10, blocks: list[int] | None = None, expiry: float | None = 2000.0) -> KVPull:
    return KVPull(remote_engine_id="engine-b", remote_request_id="r@0", block_ids=blocks or [10, 11, 12],
                  num_tokens=num_tokens, host="h", port=1, expiry_time=expiry)


def test_export_leases_the_slot_until_the_pulled_notification() -> None:
    parts = Parts()
    kv, sched = parts.kv, parts.scheduler
    slot = sched.take_slot()  # as the finished prefill leg's slot, held by Scheduler.hold
    assert slot == 0
    params = kv.export("req", slot, 10)
    assert params["remote_block_ids"] == [[0, 1, 2]] and params["remote_num_tokens"] == 10
    assert params["remote_engine_id"] == "engine-a" and params["remote_blocks_expiry_time"] == 1010.0
    s = kv.stats()
    assert (s.held_blocks, s.held_requests, s.slots, s.free_slots) == (3, 1, SLOTS, SLOTS - 1)
    parts.transport.notes = [b"someone-else@9", params["remote_request_id"].encode()]
    kv.poll()
    s = kv.stats()
    assert (s.held_blocks, s.free_slots, s.leases_pulled, s.leases_expired) == (0, SLOTS, 1, 0)
    assert sched.held == set()


def test_a_reused_request_id_gets_a_lease_of_its_own() -> None:
    parts = Parts()
    ids = [parts.kv.export("same", parts.scheduler.take_slot() or 0, 4)["remote_request_id"] for _ in range(2)]
    assert ids[0] != ids[1] and parts.kv.stats().held_requests == 2


def test_unpulled_leases_expire_and_free_their_slots() -> None:
    parts = Parts()
    kv = parts.kv
    slot = parts.scheduler.take_slot()
    assert slot is not None
    kv.export("req", slot, 10)
    parts.clock.now += 9.9
    kv.poll()
    assert kv.stats().held_blocks == 3
    parts.clock.now += 0.2
    kv.poll()
    s = kv.stats()
    assert (s.held_blocks, s.free_slots, s.leases_expired) == (0, SLOTS, 1)


def test_a_pull_reads_the_remote_slot_into_a_slot_it_holds_and_hands_it_over() -> None:
    parts = Parts()
    kv, transport, sched = parts.kv, parts.transport, parts.scheduler
    assert kv.begin_pull("dec", pull(), prompt_len=10) is None
    assert kv.pending() and kv.advance().ready == []  # READ started, still running
    assert transport.reads == [(1, 0, 0, 10, b"r@0")]  # remote slot 1, positions [0, 10), into local slot 0
    assert sched.held == {0} and sched.free_slots == SLOTS - 1
    transport.states = ["DONE"]
    assert kv.advance().ready == ["dec"]
    assert kv.landed_slot("dec") == 0
    loaded = kv.load("dec")
    assert (loaded.reused_tokens, loaded.bytes) == (0, 10 * LAYOUT.position_bytes) and not kv.pending()
    assert sched.held == {0}  # the request's now: the step loop places it there
    s = kv.stats()
    assert (s.pulls_ok, s.pulled_blocks, s.pulled_tokens, s.pulled_bytes) == (1, 3, 10, 10 * LAYOUT.position_bytes)
    assert sum(s.pull_seconds_counts) == 1


def test_a_pull_reads_only_the_positions_the_prefix_cache_lacks() -> None:
    """A decode leg whose prompt starts with blocks this engine cached READs the rest only; the cached ones
    are copied from the cache into its slot. Its last position is always READ (the READ's notification frees the
    lease)."""
    prefix = PrefixCache(KVBlockPool(LAYOUT, 16, torch.float32))
    parts = Parts(prefix=prefix)
    kv, transport = parts.kv, parts.transport
    prompt = list(range(20, 32))  # 12 tokens: 3 blocks of 4
    keys = block_hashes(prompt, LAYOUT.block_size, None)
    source = filled_cache(seed=3)
    prefix.store(keys[:2], source, 1, 8)  # the first two blocks, from an earlier request
    kv.begin_pull("dec", pull(num_tokens=12, blocks=[10, 11, 12]), 12, keys)
    kv.advance()
    assert transport.reads == [(1, 0, 8, 12, b"r@0")]
    assert torch.equal(parts.cache.data[:, :, 0, :, :8], source.data[:, :, 1, :, :8])
    transport.states = ["DONE"]
    assert kv.advance().ready == ["dec"]
    loaded = kv.load("dec")
    assert (loaded.reused_tokens, loaded.bytes) == (8, 4 * LAYOUT.position_bytes)  # one block READ, two reused
    s = kv.stats()
    assert (s.pulled_blocks, s.local_prefix_blocks, s.pulled_tokens) == (1, 2, 4)
    kv.begin_pull("whole", pull(num_tokens=8, blocks=[10, 11]), 8, keys[:2])  # all cached: the last block READ
    kv.advance()
    assert transport.reads[-1][2:4] == (4, 8)


def test_a_landed_pull_that_waits_for_room_is_never_read_again() -> None:
    """The fleet soak's wrong answers (issue 29): a pulled decode leg waiting for room in the running batch had
    its READ started again every step, from remote KV the prefill engine had freed on the first READ's
    notification and refilled with another prompt's."""
    parts = Parts()
    kv, transport = parts.kv, parts.transport
    kv.begin_pull("dec", pull(), prompt_len=10)
    kv.advance()
    transport.states = ["DONE"]
    assert kv.advance().ready == ["dec"]
    for _ in range(3):  # steps while the running batch is full
        assert kv.advance() == PullProgress()
    assert len(transport.reads) == 1 and not kv.pending() and kv.waiting_for("dec")
    kv.load("dec")
    assert parts.scheduler.held == {0}


def test_a_pull_waits_for_a_free_slot() -> None:
    parts = Parts()
    taken = [parts.scheduler.take_slot() for _ in range(SLOTS)]
    assert None not in taken
    parts.kv.begin_pull("dec", pull(), 10)
    assert parts.kv.advance() == PullProgress() and parts.transport.reads == [] and parts.kv.pending()
    parts.scheduler.free_slot(2)
    parts.kv.advance()
    assert parts.transport.reads == [(1, 2, 0, 10, b"r@0")]


def test_an_aborted_landed_pull_frees_its_slot() -> None:
    parts = Parts()
    kv, transport = parts.kv, parts.transport
    kv.begin_pull("dec", pull(), prompt_len=10)
    kv.advance()
    transport.states = ["DONE"]
    kv.advance()
    kv.drop("dec")
    assert kv.stats().free_slots == SLOTS and not kv.waiting_for("dec") and kv.advance() == PullProgress()


@pytest.mark.parametrize(
    ("the_pull", "prompt_len", "why"),
    [
        (pull(num_tokens=10), 11, "this prompt has 11"),
        (pull(num_tokens=10, blocks=[1, 2]), 10, "cannot hold exactly 10"),
        (pull(expiry=999.0), 10, "expired"),
    ],
)
def test_pulls_that_cannot_work_are_refused_before_anything_is_held(the_pull, prompt_len, why) -> None:  # type: ignore[no-untyped-def]
    parts = Parts()
    problem = parts.kv.begin_pull("dec", the_pull, prompt_len)
    assert problem is not None and why in problem
    assert not parts.kv.pending() and parts.transport.reads == [] and parts.kv.stats().free_slots == SLOTS


def test_failed_reads_and_unreachable_peers_fail_the_pull_and_free_the_slot() -> None:
    parts = Parts()
    kv, transport = parts.kv, parts.transport
    kv.begin_pull("dec", pull(), 10)
    kv.advance()
    transport.states = ["ERR"]
    progress = kv.advance()
    assert progress.failed and "failed" in progress.failed[0][1]
    assert kv.stats().free_slots == SLOTS and kv.stats().pulls_failed == 1 and not kv.pending()
    gone = Parts(peers=FakePeers(TransferError("fetching the prefill engine's KV metadata failed")))
    gone.kv.begin_pull("dec", pull(), 10)
    assert gone.kv.advance().failed == [("dec", "fetching the prefill engine's KV metadata failed")]
    assert gone.transport.reads == []


@pytest.mark.parametrize("blocks", [[80, 81, 82], [11, 12, 13], [10, 12, 11]])
def test_remote_blocks_that_are_not_one_slots_first_fail_without_a_read(blocks) -> None:  # type: ignore[no-untyped-def]
    parts = Parts()
    parts.kv.begin_pull("dec", pull(blocks=blocks), 10)
    assert "remote block ids" in parts.kv.advance().failed[0][1]
    assert parts.transport.reads == [] and parts.kv.stats().free_slots == SLOTS


def test_a_hung_read_fails_but_keeps_its_slot_until_nixl_lets_go() -> None:
    parts = Parts()
    kv, transport = parts.kv, parts.transport
    kv.begin_pull("dec", pull(), 10)
    kv.advance()
    parts.clock.now += SPEC.pull_timeout_s + 1
    assert kv.advance().failed[0][0] == "dec"
    assert kv.stats().free_slots == SLOTS - 1  # a late write must not land in a slot given to someone else
    assert kv.advance().failed == []  # reported once
    transport.states = ["DONE"]
    kv.advance()
    assert kv.stats().free_slots == SLOTS and not kv.pending()


def test_an_aborted_pull_frees_its_slot() -> None:
    parts = Parts()
    kv, transport = parts.kv, parts.transport
    kv.begin_pull("dec", pull(), 10)
    kv.advance()
    kv.drop("dec")
    assert not kv.waiting_for("dec")
    transport.states = ["DONE"]
    assert kv.advance().ready == []
    assert kv.stats().free_slots == SLOTS and not kv.pending()


def test_the_prefill_response_params_parse_back_into_the_decode_leg_pull() -> None:
    params = prefill_params(engine_id="e", request_id="r@1", block_ids=[3, 4], num_tokens=20, host="10.0.0.2",
                            port=8100, expiry_time=123.5)
    intent = parse_kv_transfer_params({**params, "dcp_size": 1, "remote_registration_generation": 0})
    assert not intent.export and intent.pull == KVPull(
        remote_engine_id="e", remote_request_id="r@1", block_ids=[3, 4], num_tokens=20, host="10.0.0.2", port=8100,
        expiry_time=123.5,
    )
    flat = parse_kv_transfer_params({**params, "remote_block_ids": [3, 4]})
    assert flat.pull is not None and flat.pull.block_ids == [3, 4]
    assert parse_kv_transfer_params({"do_remote_decode": True}).export
    assert not parse_kv_transfer_params({"do_remote_decode": False}).any
    assert not parse_kv_transfer_params(None).any


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ({"do_remote_prefill": True, "remote_block_ids": [[1], [2]]}, "KV groups"),
        ({"do_remote_prefill": True, "remote_block_ids": [[1]], "remote_engine_id": "", "remote_request_id": "r",
          "remote_host": "h", "remote_port": 1, "remote_num_tokens": 1}, "remote_engine_id"),
        ({"do_remote_prefill": True, "remote_block_ids": [[1]], "remote_engine_id": "e", "remote_request_id": "r",
          "remote_host": "h", "remote_port": 70000, "remote_num_tokens": 1}, "remote_port"),
        ({"do_remote_prefill": True, "remote_block_ids": [[1]], "remote_engine_id": "e", "remote_request_id": "r",
          "remote_host": "h", "remote_port": 1, "remote_num_tokens": True}, "remote_num_tokens"),
        ({"do_remote_prefill": True, "remote_block_ids": [[1]], "remote_engine_id": "e", "remote_request_id": "r",
          "remote_host": "h", "remote_port": 1, "remote_num_tokens": 1, "remote_blocks_expiry_time": "soon"},
         "expiry_time"),
    ],
)
def test_bad_params_name_the_key(params, needle) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RequestError) as err:
        parse_kv_transfer_params(params)
    assert needle in err.value.message and err.value.param == "kv_transfer_params"


def settle(peers: PeerDirectory, the_pull: KVPull) -> KVAgentInfo:
    """Look up until the fetch (on the directory's worker thread) has answered."""
    return wait_until(lambda: peers.lookup(the_pull), "the peer fetch answered")


def test_peer_facts_are_fetched_once_and_checked() -> None:
    calls: list[tuple[str, int]] = []

    def fetch(host: str, port: int, api_key: str | None) -> KVAgentInfo:
        calls.append((host, port))
        return REMOTE

    peers = PeerDirectory(LAYOUT, None, fetch)
    assert peers.lookup(pull()) is None  # fetching
    assert settle(peers, pull()) == REMOTE
    assert peers.lookup(pull()) == REMOTE and calls == [("h", 1)]
    peers.forget("engine-b")
    settle(peers, pull())
    assert len(calls) == 2
    peers.close()


@pytest.mark.parametrize(
    ("served", "needle"),
    [
        (msgspec.structs.replace(REMOTE, engine_id="engine-c"), "restarted"),
        (msgspec.structs.replace(REMOTE, layout=msgspec.structs.replace(LAYOUT, head_dim=16)), "KV layout"),
    ],
)
def test_a_peer_that_is_not_the_prefill_engine_fails_the_pull(served, needle) -> None:  # type: ignore[no-untyped-def]
    peers = PeerDirectory(LAYOUT, None, lambda host, port, key: served)
    with pytest.raises(TransferError, match=needle):
        settle(peers, pull())
    peers.close()


def test_an_unreachable_peer_names_its_url() -> None:
    def refuse(host: str, port: int, api_key: str | None) -> KVAgentInfo:
        raise ConnectionRefusedError("refused")

    peers = PeerDirectory(LAYOUT, None, refuse)
    with pytest.raises(TransferError, match=r"http://h:1/kv/metadata failed: refused"):
        settle(peers, pull())
    peers.close()
