"""The KV hand-off pieces on their own: the block pool's copies, lease and pull bookkeeping (NIXL and the
peer fetch replaced by fakes; the real ones run in tests/e2e/test_kv_handoff.py), the wire params."""

from __future__ import annotations

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
from pdserve.engine.kv.transport import TransferError
from pdserve.engine.models import KVCache, ModelConfig
from pdserve.engine.spec import KVTransferSpec
from pdserve.protocol.errors import RequestError
from pdserve.protocol.kv import KVAgentInfo, KVLayout, KVPull, parse_kv_transfer_params, prefill_params
from tests.waiting import wait_until

CFG = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling=None,
    max_position_embeddings=128, tie_word_embeddings=True,
)
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32", itemsize=4)
SPEC = KVTransferSpec(engine_id="engine-a", host="127.0.0.1", port=8000, lease_s=10.0)


def filled_cache(slots: int = 3, max_len: int = 40) -> KVCache:
    cache = KVCache(CFG, slots, max_len, torch.float32)
    cache.data.copy_(torch.randn(cache.data.shape, generator=torch.Generator().manual_seed(0)))
    return cache


@given(num_tokens=st.integers(0, 40), src=st.integers(0, 2), dst=st.integers(0, 2), scramble=st.randoms(),
       runs=st.booleans())
def test_save_then_load_moves_exactly_the_prompt_positions(num_tokens, src, dst, scramble, runs) -> None:  # type: ignore[no-untyped-def]
    cache, other = filled_cache(), KVCache(CFG, 3, 40, torch.float32)
    pool = KVBlockPool(LAYOUT, 12, torch.float32)
    order = list(range(12))
    if runs:  # consecutive stretches (copied as one strided run each) in scrambled order
        cut = sorted(scramble.sample(range(1, 12), 3))
        stretches = [order[a:b] for a, b in zip([0, *cut], [*cut, 12], strict=True)]
        scramble.shuffle(stretches)
        order = [block for stretch in stretches for block in stretch]
    else:
        scramble.shuffle(order)  # blocks need not be contiguous or ordered
    blocks = order[: LAYOUT.blocks_for(num_tokens)]
    pool.save(cache, src, num_tokens, blocks)
    pool.load(other, dst, num_tokens, blocks)
    assert torch.equal(other.data[:, :, dst, :, :num_tokens], cache.data[:, :, src, :, :num_tokens])
    assert not other.data[:, :, dst, :, num_tokens:].any()  # nothing past the prompt was written


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


def test_pool_allocates_whole_blocks_until_full_and_frees() -> None:
    pool = KVBlockPool(LAYOUT, 5, torch.float32)
    a = pool.allocate(9)  # 3 blocks of 4
    assert a is not None and len(a) == 3 and pool.num_free == 2
    assert pool.allocate(9) is None and pool.num_free == 2
    pool.free(a)
    assert pool.num_free == 5
    assert LAYOUT.block_bytes == 2 * 2 * 2 * 4 * 8 * 4
    assert pool.block_address(2) - pool.block_address(0) == 2 * LAYOUT.block_bytes


class FakeTransport:
    """The NIXL calls, scripted: states to report per READ, notifications to deliver."""

    def __init__(self) -> None:
        self.states: list[str] = []
        self.notes: list[bytes] = []
        self.reads: list[tuple[list[int], list[int], bytes]] = []
        self.released = 0

    def start_read(self, remote: KVAgentInfo, remote_blocks: list[int], local_blocks: list[int], notify: bytes) -> Any:
        self.reads.append((remote_blocks, local_blocks, notify))
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


REMOTE = KVAgentInfo(engine_id="engine-b", backend="nixl", agent_metadata=b"md", base_address=1 << 20,
                     num_blocks=64, layout=LAYOUT)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def handoff(blocks: int = 8, peers: FakePeers | None = None) -> tuple[KVHandoff, FakeTransport, Clock]:
    transport, clock = FakeTransport(), Clock()
    kv = KVHandoff(SPEC, KVBlockPool(LAYOUT, blocks, torch.float32), transport,  # type: ignore[arg-type]
                   peers or FakePeers(REMOTE), clock=clock, wall=clock)  # type: ignore[arg-type]
    return kv, transport, clock


def pull(num_tokens: int = 10, blocks: list[int] | None = None, expiry: float | None = 2000.0) -> KVPull:
    return KVPull(remote_engine_id="engine-b", remote_request_id="r@0", block_ids=blocks or [7, 8, 9],
                  num_tokens=num_tokens, host="h", port=1, expiry_time=expiry)


def test_export_leases_the_blocks_until_the_pulled_notification() -> None:
    kv, transport, _ = handoff()
    assert kv.reserve("req", 10)
    params = kv.export("req", filled_cache(), 0, 10)
    assert params["remote_block_ids"] == [[0, 1, 2]] and params["remote_num_tokens"] == 10
    assert params["remote_engine_id"] == "engine-a" and params["remote_blocks_expiry_time"] == 1010.0
    assert kv.stats().held_blocks == 3 and kv.stats().held_requests == 1
    transport.notes = [b"someone-else@9", params["remote_request_id"].encode()]
    kv.poll()
    s = kv.stats()
    assert (s.held_blocks, s.free_blocks, s.leases_pulled, s.leases_expired) == (0, 8, 1, 0)


def test_a_reused_request_id_gets_a_lease_of_its_own() -> None:
    kv, _, _ = handoff()
    ids = []
    for _ in range(2):
        assert kv.reserve("same", 4)
        ids.append(kv.export("same", filled_cache(), 0, 4)["remote_request_id"])
    assert ids[0] != ids[1] and kv.stats().held_requests == 2


def test_unpulled_leases_expire_and_free_their_blocks() -> None:
    kv, _, clock = handoff()
    assert kv.reserve("req", 10)
    kv.export("req", filled_cache(), 0, 10)
    clock.now += 9.9
    kv.poll()
    assert kv.stats().held_blocks == 3
    clock.now += 0.2
    kv.poll()
    s = kv.stats()
    assert (s.held_blocks, s.free_blocks, s.leases_expired) == (0, 8, 1)


def test_held_kv_counts_against_capacity() -> None:
    kv, _, _ = handoff(blocks=4)
    assert kv.reserve("a", 12)  # 3 of 4 blocks
    assert not kv.reserve("b", 8)
    kv.cancel("a")
    assert kv.reserve("b", 8)


def test_a_pull_reads_into_local_blocks_notifies_and_loads() -> None:
    kv, transport, _ = handoff()
    assert kv.begin_pull("dec", pull(), prompt_len=10) is None
    assert kv.pending() and kv.advance().ready == []  # READ started, still running
    (remote_blocks, local_blocks, note), = transport.reads
    assert remote_blocks == [7, 8, 9] and len(local_blocks) == 3 and note == b"r@0"
    transport.states = ["DONE"]
    assert kv.advance().ready == ["dec"]
    target = KVCache(CFG, 1, 40, torch.float32)
    kv.pool.data[local_blocks[0]] = 1.0
    kv.load("dec", target, 0, 10)
    assert target.data[:, :, 0, :, :4].eq(1.0).all() and not kv.pending()
    s = kv.stats()
    assert (s.pulls_ok, s.pulled_blocks, s.pulled_tokens, s.pulled_bytes) == (1, 3, 10, 3 * LAYOUT.block_bytes)
    assert s.free_blocks == 8 and sum(s.pull_seconds_counts) == 1


def test_a_pull_reads_only_the_blocks_the_prefix_cache_lacks() -> None:
    """A decode leg whose prompt starts with blocks this engine cached READs the rest only; the cached ones
    are copied from the cache. Its last block is always READ (the READ's notification frees the lease)."""
    transport, clock = FakeTransport(), Clock()
    prefix = PrefixCache(KVBlockPool(LAYOUT, 16, torch.float32))
    kv = KVHandoff(SPEC, KVBlockPool(LAYOUT, 8, torch.float32), transport,  # type: ignore[arg-type]
                   FakePeers(REMOTE), clock=clock, wall=clock, prefix_cache=prefix)  # type: ignore[arg-type]
    prompt = list(range(20, 32))  # 12 tokens: 3 blocks of 4
    keys = block_hashes(prompt, LAYOUT.block_size, None)
    source = filled_cache()
    prefix.store(keys[:2], source, 1, 8)  # the first two blocks, from an earlier request
    kv.begin_pull("dec", pull(num_tokens=12, blocks=[7, 8, 9]), 12, keys)
    kv.advance()
    (remote_blocks, local_blocks, _), = transport.reads
    assert remote_blocks == [9] and len(local_blocks) == 1
    kv.pool.data[local_blocks[0]] = 5.0  # what the READ brought
    transport.states = ["DONE"]
    assert kv.advance().ready == ["dec"]
    target = KVCache(CFG, 1, 40, torch.float32)
    loaded = kv.load("dec", target, 0, 12)
    assert (loaded.reused_tokens, loaded.bytes) == (8, LAYOUT.block_bytes)  # one block READ, two reused
    assert torch.equal(target.data[:, :, 0, :, :8], source.data[:, :, 1, :, :8])
    assert target.data[:, :, 0, :, 8:12].eq(5.0).all()
    s = kv.stats()
    assert (s.pulled_blocks, s.local_prefix_blocks, s.pulled_tokens) == (1, 2, 4)
    kv.begin_pull("whole", pull(num_tokens=8, blocks=[3, 4]), 8, keys[:2])  # all cached: the last block still READ
    kv.advance()
    assert transport.reads[-1][0] == [4]


def test_a_landed_pull_that_waits_for_a_slot_is_never_read_again() -> None:
    """The fleet soak's wrong answers (issue 29): a pulled decode leg waiting for an engine slot had its READ
    started again every step, from remote blocks the prefill engine had freed on the first READ's
    notification and refilled with another prompt's KV."""
    kv, transport, _ = handoff()
    kv.begin_pull("dec", pull(), prompt_len=10)
    kv.advance()
    transport.states = ["DONE"]
    assert kv.advance().ready == ["dec"]
    (_, local_blocks, _), = transport.reads
    kv.pool.data[local_blocks] = 2.0  # what the READ brought
    for _ in range(3):  # steps while every slot is taken
        assert kv.advance() == PullProgress()
    assert len(transport.reads) == 1 and not kv.pending() and kv.waiting_for("dec")
    target = KVCache(CFG, 1, 40, torch.float32)
    kv.load("dec", target, 0, 10)
    assert target.data[:, :, 0, :, :10].eq(2.0).all() and kv.stats().free_blocks == 8


def test_an_aborted_landed_pull_frees_its_blocks() -> None:
    kv, transport, _ = handoff()
    kv.begin_pull("dec", pull(), prompt_len=10)
    kv.advance()
    transport.states = ["DONE"]
    kv.advance()
    kv.drop("dec")
    assert kv.stats().free_blocks == 8 and not kv.waiting_for("dec") and kv.advance() == PullProgress()


@pytest.mark.parametrize(
    ("the_pull", "prompt_len", "why"),
    [
        (pull(num_tokens=10), 11, "this prompt has 11"),
        (pull(num_tokens=10, blocks=[1, 2]), 10, "cannot hold exactly 10"),
        (pull(expiry=999.0), 10, "expired"),
    ],
)
def test_pulls_that_cannot_work_are_refused_before_anything_is_held(the_pull, prompt_len, why) -> None:  # type: ignore[no-untyped-def]
    kv, transport, _ = handoff()
    problem = kv.begin_pull("dec", the_pull, prompt_len)
    assert problem is not None and why in problem
    assert not kv.pending() and transport.reads == [] and kv.stats().free_blocks == 8


def test_failed_reads_and_unreachable_peers_fail_the_pull_and_free_the_blocks() -> None:
    kv, transport, _ = handoff()
    kv.begin_pull("dec", pull(), 10)
    kv.advance()
    transport.states = ["ERR"]
    progress = kv.advance()
    assert progress.failed and "failed" in progress.failed[0][1]
    assert kv.stats().free_blocks == 8 and kv.stats().pulls_failed == 1 and not kv.pending()
    gone = FakePeers(TransferError("fetching the prefill engine's KV metadata failed"))
    kv2, transport2, _ = handoff(peers=gone)
    kv2.begin_pull("dec", pull(), 10)
    assert kv2.advance().failed == [("dec", "fetching the prefill engine's KV metadata failed")]
    assert transport2.reads == []


def test_out_of_range_remote_blocks_fail_without_a_read() -> None:
    kv, transport, _ = handoff()
    kv.begin_pull("dec", pull(blocks=[1, 2, 64]), 10)
    assert "below the prefill pool's 64 blocks" in kv.advance().failed[0][1]
    assert transport.reads == []


def test_a_hung_read_fails_but_keeps_its_blocks_until_nixl_lets_go() -> None:
    kv, transport, clock = handoff()
    kv.begin_pull("dec", pull(), 10)
    kv.advance()
    clock.now += SPEC.pull_timeout_s + 1
    assert kv.advance().failed[0][0] == "dec"
    assert kv.stats().free_blocks == 5  # a late write must not land in blocks given to someone else
    assert kv.advance().failed == []  # reported once
    transport.states = ["DONE"]
    kv.advance()
    assert kv.stats().free_blocks == 8 and not kv.pending()


def test_an_aborted_pull_frees_its_blocks() -> None:
    kv, transport, _ = handoff()
    kv.begin_pull("dec", pull(), 10)
    kv.advance()
    kv.drop("dec")
    assert not kv.waiting_for("dec")
    transport.states = ["DONE"]
    assert kv.advance().ready == []
    assert kv.stats().free_blocks == 8 and not kv.pending()


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
