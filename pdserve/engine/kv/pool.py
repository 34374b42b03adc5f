"""The block pool: the part of an engine's KV memory that other engines read (NIXL-registered).

The running batch keeps its keys/values in :class:`~pdserve.engine.models.KVCache` slots, one
contiguous row per sequence, so that a decode step reads them as one view. A prompt prefilled
for a remote decode leaves its slot as soon as it finishes: its keys/values are copied here, into
fixed-size blocks (``[2, layers, kv_heads, block_size, head_dim]``, contiguous, so one block is
one transfer descriptor), and wait for the decode engine to READ them. A decode engine READs the
remote blocks into its own pool, then copies them into the slot its sequence runs in. The prefix
cache (:mod:`~pdserve.engine.kv.prefix_cache`) keeps its blocks in a pool of its own.

The memory is one anonymous mapping, like the KV cache: pages are committed only when written,
so a pool sized for every slot's full context costs address space, not RAM.
"""

from __future__ import annotations

import math
import mmap

import torch

from pdserve.engine.models import KVCache
from pdserve.protocol.kv import KVLayout


class KVBlockPool:
    def __init__(self, layout: KVLayout, num_blocks: int, dtype: torch.dtype) -> None:
        if num_blocks < 1:
            raise ValueError("the KV block pool needs at least one block")
        self.layout = layout
        self.num_blocks = num_blocks
        shape = (num_blocks, 2, layout.num_layers, layout.num_kv_heads, layout.block_size, layout.head_dim)
        self._memory = mmap.mmap(-1, math.prod(shape) * layout.itemsize)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            self._memory.madvise(mmap.MADV_NOHUGEPAGE)
        self.data = torch.frombuffer(self._memory, dtype=dtype).view(shape)
        self._free = list(range(num_blocks - 1, -1, -1))  # popped from the end: block 0 first

    @property
    def base_address(self) -> int:
        return self.data.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.layout.block_bytes

    @property
    def num_free(self) -> int:
        return len(self._free)

    def block_address(self, block: int) -> int:
        return self.base_address + block * self.layout.block_bytes

    def allocate(self, num_tokens: int) -> list[int] | None:
        """Blocks for ``num_tokens`` positions, or None when the pool cannot hold them now."""
        count = self.layout.blocks_for(num_tokens)
        if count > len(self._free):
            return None
        return [self._free.pop() for _ in range(count)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))

    def save(self, cache: KVCache, slot: int, num_tokens: int, blocks: list[int]) -> None:
        """Copy positions ``[0, num_tokens)`` of a cache slot into ``blocks``."""
        self._copy(cache, slot, list(enumerate(self._needed(num_tokens, blocks))), num_tokens, to_pool=True)

    def load(self, cache: KVCache, slot: int, num_tokens: int, blocks: list[int]) -> None:
        """Copy ``blocks`` into positions ``[0, num_tokens)`` of a cache slot."""
        self._copy(cache, slot, list(enumerate(self._needed(num_tokens, blocks))), num_tokens, to_pool=False)

    def save_blocks(self, cache: KVCache, slot: int, block_indices: list[int], blocks: list[int]) -> None:
        """Copy a slot's blocks ``block_indices`` (of ``block_size`` positions each) into ``blocks``."""
        end = (max(block_indices) + 1) * self.layout.block_size if block_indices else 0
        self._copy(cache, slot, list(zip(block_indices, blocks, strict=True)), end, to_pool=True)

    def load_blocks(self, cache: KVCache, slot: int, start: int, blocks: list[int]) -> None:
        """Copy ``blocks`` into a slot's positions from ``start`` (a block boundary) on."""
        first = start // self.layout.block_size
        pairs = [(first + i, block) for i, block in enumerate(blocks)]
        self._copy(cache, slot, pairs, start + len(blocks) * self.layout.block_size, to_pool=False)

    def _copy(self, cache: KVCache, slot: int, pairs: list[tuple[int, int]], num_tokens: int, *, to_pool: bool) -> None:
        """Copy between a slot's blocks and pool blocks, ``pairs`` of (block index in the slot, pool block), the
        slot's positions below ``num_tokens`` only. A run of pairs consecutive on both sides (blocks allocated
        together) is one strided copy, read and written in place: a per-block loop, or a gather into a staging
        tensor, took ~9x as long for a 1,024-position prompt (``pdserve bench kv-layout``)."""
        size = self.layout.block_size
        first = 0
        for i in range(1, len(pairs) + 1):
            if i < len(pairs) and pairs[i] == (pairs[i - 1][0] + 1, pairs[i - 1][1] + 1):
                continue
            (index, block), count = pairs[first], i - first
            first = i
            begin, end = index * size, min((index + count) * size, num_tokens)
            full, rest = divmod(end - begin, size)
            spans = []
            if full:
                rows = cache.data[:, :, slot, :, begin : begin + full * size]
                blocked = rows.view(*rows.shape[:3], full, size, rows.shape[-1])
                spans.append((self.data[block : block + full].permute(1, 2, 3, 0, 4, 5), blocked))
            if rest:
                spans.append((self.data[block + full, :, :, :, :rest],
                              cache.data[:, :, slot, :, begin + full * size : end]))
            for pool_rows, slot_rows in spans:
                (pool_rows if to_pool else slot_rows).copy_(slot_rows if to_pool else pool_rows)

    def _needed(self, num_tokens: int, blocks: list[int]) -> list[int]:
        """The blocks that hold positions ``[0, num_tokens)``; fails when there are too few."""
        if len(blocks) < self.layout.blocks_for(num_tokens):
            raise ValueError(f"{len(blocks)} blocks cannot hold {num_tokens} positions")
        return blocks[: self.layout.blocks_for(num_tokens)]
