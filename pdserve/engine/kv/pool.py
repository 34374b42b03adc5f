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
        for start, block, width in self._spans(num_tokens, blocks):
            self.data[block, :, :, :, :width] = cache.data[:, :, slot, :, start : start + width]

    def load(self, cache: KVCache, slot: int, num_tokens: int, blocks: list[int]) -> None:
        """Copy ``blocks`` into positions ``[0, num_tokens)`` of a cache slot."""
        for start, block, width in self._spans(num_tokens, blocks):
            cache.data[:, :, slot, :, start : start + width] = self.data[block, :, :, :, :width]

    def save_blocks(self, cache: KVCache, slot: int, block_indices: list[int], blocks: list[int]) -> None:
        """Copy a slot's blocks ``block_indices`` (of ``block_size`` positions each) into ``blocks``, in one op."""
        size = self.layout.block_size
        positions = (torch.tensor(block_indices)[:, None] * size + torch.arange(size)).reshape(-1)
        rows = cache.data[:, :, slot].index_select(3, positions)  # [2, layers, heads, n * size, head_dim]
        rows = rows.unflatten(3, (len(blocks), size)).permute(3, 0, 1, 2, 4, 5)
        self.data.index_copy_(0, torch.tensor(blocks), rows)

    def load_blocks(self, cache: KVCache, slot: int, start: int, blocks: list[int]) -> None:
        """Copy ``blocks`` into a slot's positions from ``start`` on: one strided copy per run of consecutive
        block ids (blocks kept together are allocated together), read in place."""
        size = self.layout.block_size
        rows = cache.data[:, :, slot, :, start : start + len(blocks) * size].unflatten(3, (len(blocks), size))
        first = 0
        for i in range(1, len(blocks) + 1):
            if i == len(blocks) or blocks[i] != blocks[i - 1] + 1:
                run = self.data[blocks[first] : blocks[i - 1] + 1]
                rows[:, :, :, first:i].copy_(run.permute(1, 2, 3, 0, 4, 5))
                first = i

    def _spans(self, num_tokens: int, blocks: list[int]) -> list[tuple[int, int, int]]:
        size = self.layout.block_size
        if len(blocks) < self.layout.blocks_for(num_tokens):
            raise ValueError(f"{len(blocks)} blocks cannot hold {num_tokens} positions")
        return [(i * size, block, min(size, num_tokens - i * size)) for i, block in enumerate(blocks) if i * size < num_tokens]
