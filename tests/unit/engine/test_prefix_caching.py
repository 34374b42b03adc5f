"""Automatic prefix caching in the torch step loop: the same answers with the cache on and off (whole, in
chunks, and with a pool so small that blocks are evicted all the time), exactly the cached positions an
independent model of the cache predicts, salts that never share a block, and the requests that must not
read it.

qwen3-tiny in float32 and the batch-invariant mode: a row computed past a cached prefix gets the bits it gets
in a whole prefill, and a decode row writes the keys/values a prefill writes for its position, so "the same
answers" means equal ids and logprobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.kv.pool import KVBlockPool
from pdserve.engine.kv.prefix_cache import PrefixCache, block_hashes
from pdserve.engine.models import KVCache
from pdserve.engine.runners.torch_runner import TorchSetup
from pdserve.engine.step_loop import StepLoop
from pdserve.protocol.engine import EngineOutput, EngineRequest, SequenceSampling

BLOCK = 16
WHOLE = 4096  # a step budget above any prompt here: nothing prefilled in chunks


@dataclass(frozen=True)
class Tiny:
    steps: StepLoop  # built by TorchSetup with the cache on: its model, info and the cache's block layout


@pytest.fixture(scope="module")
def tiny() -> Tiny:
    setup = TorchSetup.create("qwen3-tiny", dtype="float32", max_model_len=512, max_num_seqs=4, batch_invariant=True)
    steps = setup.load()
    assert steps.prefix_cache is not None and setup.info.prefix_cache_block_size == BLOCK
    return Tiny(steps)


def loop(tiny: Tiny, *, cache_blocks: int | None, budget: int = WHOLE) -> StepLoop:
    """A fresh step loop on the loaded model; ``cache_blocks`` None: prefix caching off."""
    base = tiny.steps
    assert base.prefix_cache is not None
    cache = None
    if cache_blocks is not None:
        cache = PrefixCache(KVBlockPool(base.prefix_cache.pool.layout, cache_blocks, base.model.dtype))
    info = msgspec.structs.replace(base.info, max_num_batched_tokens=budget)
    return StepLoop(base.model, info, seed=0, prefix_cache=cache)


def request(rid: str, prompt: Sequence[int], salt: str | None = None, skip: bool = False,
            **sampling: object) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=list(prompt), sampling=SequenceSampling(**sampling),  # type: ignore[arg-type]
                         cache_salt=salt, skip_reading_prefix_cache=skip)


def run(steps: StepLoop, r: EngineRequest) -> list[EngineOutput]:
    """One request to its end, alone: its outputs without timestamps."""
    steps.validate(r)
    steps.add(r)
    outputs = []
    while steps.has_work():
        steps.step()
        outputs += [msgspec.structs.replace(o, scheduled_at=None) for o in steps.take_outputs().outputs]
    return outputs


def cached_tokens(outputs: list[EngineOutput]) -> int:
    return max(o.num_cached_tokens for o in outputs)


def without_cached(outputs: list[EngineOutput]) -> list[EngineOutput]:
    return [msgspec.structs.replace(o, num_cached_tokens=0) for o in outputs]


def sequences_of(outputs: list[EngineOutput]) -> list[list[int]]:
    by_index: dict[int, list[int]] = {}
    for o in outputs:
        by_index.setdefault(o.index, []).extend(o.new_token_ids)
    return list(by_index.values())


class CacheModel:
    """What the cache holds, from the requests alone (never from the code under test): every whole-block
    prefix of each sequence's positions that have keys/values (the prompt, and the output but its last
    token, which was never fed back), per salt. With room for everything, a request reads the longest held
    one that leaves its last prompt position to compute."""

    def __init__(self) -> None:
        self.held: set[tuple[str | None, tuple[int, ...]]] = set()

    def hit(self, r: EngineRequest) -> int:
        if r.skip_reading_prefix_cache or r.sampling.prompt_logprobs is not None:
            return 0
        prompt = r.prompt_token_ids
        blocks = (len(prompt) - 1) // BLOCK
        while blocks and (r.cache_salt, tuple(prompt[: blocks * BLOCK])) not in self.held:
            blocks -= 1
        return blocks * BLOCK

    def keep(self, r: EngineRequest, outputs: list[EngineOutput]) -> None:
        for output in sequences_of(outputs):
            positions = r.prompt_token_ids + output[:-1]
            for end in range(BLOCK, len(positions) + 1, BLOCK):
                self.held.add((r.cache_salt, tuple(positions[:end])))


# A system prompt shared by many requests; a request either starts a conversation (a piece of it, then
# its own ids) or continues an earlier one (its prompt, its first answer, then new ids), as chat turns do.
_SYSTEM = list(range(1000, 1200))


@st.composite
def conversations(draw: st.DrawFn) -> list[tuple[int | None, list[int], dict[str, object]]]:
    turns: list[tuple[int | None, list[int], dict[str, object]]] = []
    for i in range(draw(st.integers(2, 7))):
        earlier = draw(st.one_of(st.none(), st.integers(0, i - 1))) if i else None
        shared = draw(st.integers(0, len(_SYSTEM))) if earlier is None else 0
        own = draw(st.lists(st.integers(100, 50000), min_size=1, max_size=40))
        sampling: dict[str, object] = {"max_tokens": draw(st.integers(1, 24)), "ignore_eos": True,
                                       "n": draw(st.sampled_from([1, 1, 2])),
                                       "salt": draw(st.sampled_from([None, None, "tenant-a"]))}
        if draw(st.booleans()):
            sampling |= {"temperature": 0.9, "seed": i}
        if draw(st.booleans()):
            sampling |= {"logprobs": 2}
        if draw(st.integers(0, 4)) == 0:
            sampling |= {"prompt_logprobs": 1}
        if draw(st.integers(0, 4)) == 0:
            sampling |= {"skip": True}
        turns.append((earlier, _SYSTEM[:shared] + own, sampling))
    return turns


def converse(steps: StepLoop, turns: list[tuple[int | None, list[int], dict[str, object]]]
             ) -> list[tuple[EngineRequest, list[EngineOutput]]]:
    """The turns one after another; a continuing turn's prompt is built from the answer it continues."""
    done: list[tuple[EngineRequest, list[EngineOutput]]] = []
    for i, (earlier, own, sampling) in enumerate(turns):
        prefix: list[int] = []
        if earlier is not None:
            before, outputs = done[earlier]
            prefix = before.prompt_token_ids + sequences_of(outputs)[0]
        r = request(f"t{i}", (prefix + own)[:400], **sampling)  # type: ignore[arg-type]
        done.append((r, run(steps, r)))
    return done


@settings(max_examples=10, deadline=None)
@given(turns=conversations(), budget=st.sampled_from([WHOLE, WHOLE, 24]))
def test_answers_are_the_same_with_the_cache_on_and_off_and_it_reads_what_it_holds(tiny: Tiny, turns, budget) -> None:  # type: ignore[no-untyped-def]
    steps = loop(tiny, cache_blocks=1024, budget=budget)
    on, off = converse(steps, turns), converse(loop(tiny, cache_blocks=None, budget=budget), turns)
    assert [without_cached(o) for _, o in on] == [o for _, o in off]
    model, hits, queries = CacheModel(), 0, 0
    for r, outputs in on:
        expected = model.hit(r)
        assert cached_tokens(outputs) == expected, r.request_id
        model.keep(r, outputs)
        hits += expected
        if not r.skip_reading_prefix_cache and r.sampling.prompt_logprobs is None:
            queries += len(r.prompt_token_ids)
    stats = steps.stats()
    assert (stats.prefix_cache_hits, stats.prefix_cache_queries) == (hits, queries)
    assert stats.prompt_tokens_computed == sum(len(r.prompt_token_ids) for r, _ in on) - hits


@settings(max_examples=6, deadline=None)
@given(turns=conversations(), blocks=st.integers(1, 12))
def test_a_cache_that_evicts_all_the_time_never_serves_a_stale_block(tiny: Tiny, turns, blocks) -> None:  # type: ignore[no-untyped-def]
    """A pool of a few blocks, far less than the prompts: whatever it still holds when a request reads it,
    the answer is the one computed without it."""
    steps = loop(tiny, cache_blocks=blocks)
    on, off = converse(steps, turns), converse(loop(tiny, cache_blocks=None), turns)
    assert [without_cached(o) for _, o in on] == [o for _, o in off]
    assert steps.prefix_cache is not None and steps.prefix_cache.num_cached_blocks <= blocks


def test_two_salts_never_share_a_block_and_skipping_reads_nothing(tiny: Tiny) -> None:
    steps = loop(tiny, cache_blocks=256)
    prompt = _SYSTEM[:100]
    assert cached_tokens(run(steps, request("a1", prompt, "a", max_tokens=2))) == 0
    assert cached_tokens(run(steps, request("b1", prompt, "b", max_tokens=2))) == 0
    assert cached_tokens(run(steps, request("none", prompt, max_tokens=2))) == 0
    assert cached_tokens(run(steps, request("a2", prompt, "a", max_tokens=2))) == 96
    assert cached_tokens(run(steps, request("skip", prompt, "a", True, max_tokens=2))) == 0
    assert cached_tokens(run(steps, request("plp", prompt, "a", max_tokens=2, prompt_logprobs=0))) == 0
    assert cached_tokens(run(steps, request("b2", prompt + [7] * 40, "b", max_tokens=2))) == 96


def test_a_prompt_of_whole_cached_blocks_still_computes_its_last_position(tiny: Tiny) -> None:
    steps = loop(tiny, cache_blocks=256)
    prompt = _SYSTEM[:64]
    first = run(steps, request("first", prompt, max_tokens=3, temperature=0))
    again = run(steps, request("again", prompt, max_tokens=3, temperature=0))
    assert cached_tokens(again) == 48  # the 4th block holds the last position: computed for the logits
    assert without_cached(again) == [msgspec.structs.replace(o, request_id="again") for o in first]


def test_keys_chain_over_every_earlier_block_and_the_salt() -> None:
    keys = block_hashes(list(range(64)), BLOCK, None)
    assert len(keys) == 4 and len(set(keys)) == 4
    assert block_hashes(list(range(63)), BLOCK, None) == keys[:3]  # a partial block has no key
    assert block_hashes([99, *range(1, 64)], BLOCK, None)[3] != keys[3]  # block 3's key carries block 0's ids
    assert not set(block_hashes(list(range(64)), BLOCK, "s")) & set(keys)


def test_the_least_recently_used_blocks_go_first_and_a_hit_copies_what_was_stored(tiny: Tiny) -> None:
    base = tiny.steps
    assert base.prefix_cache is not None
    cache = PrefixCache(KVBlockPool(base.prefix_cache.pool.layout, 4, base.model.dtype))
    slots = KVCache(base.model.cfg, 3, 128, base.model.dtype)
    slots.data.copy_(torch.randn(slots.data.shape))
    a, b = block_hashes(list(range(64)), BLOCK, None), block_hashes(list(range(500, 564)), BLOCK, None)
    cache.store(a, slots, 0, 64)  # all four blocks: a0 (least recent) .. a3
    assert cache.load(a[:2], slots, 2) == 32  # a0, a1 read: now the most recent
    assert torch.equal(slots.data[:, :, 2, :, :32], slots.data[:, :, 0, :, :32])
    cache.store(b, slots, 1, 32)  # two new blocks evict a2 and a3
    assert cache.hit_blocks(a, 1000) == 2 and cache.hit_blocks(b, 1000) == 2
    assert cache.stats.evicted_blocks == 2
    cache.load(b[:2], slots, 2)
    assert torch.equal(slots.data[:, :, 2, :, :32], slots.data[:, :, 1, :, :32])
