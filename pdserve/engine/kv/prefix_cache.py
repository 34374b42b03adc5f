"""Automatic prefix caching: the keys/values of full blocks of prompts (and outputs) kept for reuse.

A block is ``block_size`` positions. Its key is a hash chained over the token ids of every block up
to and including it, the first one salted with the request's ``cache_salt``, as vLLM's prefix cache
keys its blocks: equal keys mean equal tokens at equal positions after an equal prefix (and an
equal salt), so the block's keys/values are the same. A new request's longest run of leading blocks
found here is copied into its slot, and the model computes only the rest of its prompt.

The running batch keeps one contiguous cache row per sequence (:class:`~pdserve.engine.models.KVCache`),
so a hit is a copy into that row, not a shared page: blocks here are never in use across steps, and
each is either free or cached. When every block is cached, storing a new one evicts the least
recently used (a hit or a store touches a block). A block's key is dropped before its memory is
rewritten, so an evicted block is never served with another prompt's keys/values.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.engine.kv.pool import KVBlockPool
from pdserve.engine.models import KVCache


@dataclass
class PrefixCacheStats:
    """Counted in prompt positions, as vLLM's ``prefix_cache_queries`` and ``prefix_cache_hits``."""

    queries: int = 0  # prompt positions looked up (requests that may read the cache)
    hits: int = 0  # of those, positions served from the cache
    evicted_blocks: int = 0


def block_hashes(token_ids: Sequence[int], block_size: int, salt: str | None,
                 known: Sequence[bytes] = ()) -> list[bytes]:
    """The chained keys of the full blocks of ``token_ids`` (a partial last block has none); ``known``: the keys
    of its leading blocks, already computed (a prompt's, when its sequence's output is keyed)."""
    parent = known[-1] if known else hashlib.sha256(
        b"pdserve-prefix" + (salt.encode() if salt is not None else b"\0")).digest()
    keys = list(known)
    for start in range(len(known) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hashlib.sha256(parent + array("q", token_ids[start : start + block_size]).tobytes()).digest()
        keys.append(parent)
    return keys


class PrefixCache:
    """Full blocks by key in a :class:`KVBlockPool` (not NIXL-registered), evicted least recently used."""

    def __init__(self, pool: KVBlockPool) -> None:
        self.pool = pool
        self.block_size = pool.layout.block_size
        self._free = list(range(pool.num_blocks - 1, -1, -1))  # never used yet: popped before any eviction
        self._cached: OrderedDict[bytes, int] = OrderedDict()  # key -> block, least recently used first
        self.stats = PrefixCacheStats()

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def hit_blocks(self, keys: Sequence[bytes], prompt_len: int) -> int:
        """How many leading blocks of a prompt are cached: at most those before its last position,
        which the model must compute for the first token's logits."""
        limit = min(len(keys), (prompt_len - 1) // self.block_size)
        found = 0
        while found < limit and keys[found] in self._cached:
            found += 1
        return found

    def load(self, keys: Sequence[bytes], cache: KVCache, slot: int) -> int:
        """Copy the cached blocks of ``keys`` (all of them must be cached: :meth:`hit_blocks`) into
        positions ``[0, len(keys) * block_size)`` of ``slot``; returns that many positions."""
        blocks = self._touch(keys)
        if blocks:
            self.pool.load_blocks(cache, slot, 0, blocks)
        return len(blocks) * self.block_size

    def count_lookup(self, prompt_len: int, hit_tokens: int) -> None:
        self.stats.queries += prompt_len
        self.stats.hits += hit_tokens

    def store(self, keys: Sequence[bytes], cache: KVCache, slot: int, num_cached: int) -> None:
        """Keep the full blocks of ``slot`` whose keys are not cached yet (those below ``num_cached``,
        the positions whose keys/values the slot holds); cached ones are touched."""
        usable = min(len(keys), num_cached // self.block_size)
        new: list[int] = []
        blocks: list[int] = []
        for index in range(usable):
            key = keys[index]
            if key in self._cached:
                self._cached.move_to_end(key)
                continue
            if not self._free and not self._cached:
                break  # a pool smaller than this sequence: keep what it holds
            block = self._take_block()
            new.append(index)
            blocks.append(block)
        if not blocks:
            return
        self.pool.save_blocks(cache, slot, new, blocks)
        for index, block in zip(new, blocks, strict=True):
            self._cached[keys[index]] = block

    def _touch(self, keys: Sequence[bytes]) -> list[int]:
        """The blocks of ``keys`` (all cached), now the most recently used."""
        for key in keys:
            self._cached.move_to_end(key)
        return [self._cached[key] for key in keys]

    def _take_block(self) -> int:
        """A never-used block, else the least recently used cached one (its key dropped first)."""
        if self._free:
            return self._free.pop()
        _, block = self._cached.popitem(last=False)
        self.stats.evicted_blocks += 1
        return block

