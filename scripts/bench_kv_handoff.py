"""What one P/D hand-off of SmolLM2's KV costs the two engines, now against before, in this process.

Now: the whole KV cache is NIXL-registered and a decode engine READs the prompt's positions from the prefill's
slot straight into its own (one descriptor per keys or values, layer and KV head: 180). Before (until
2026-12-06): the prefill engine copied the prompt's KV into a separate NIXL-registered block pool, the decode
engine READ the blocks (one descriptor per 16 positions) into its own pool and copied them into its slot; the
copies are :class:`KVBlockPool`'s, the same strided copies the pool made. Two NIXL agents (UCX) on loopback,
medians of 7.

    .venv/bin/python scripts/bench_kv_handoff.py
"""

from __future__ import annotations

import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.engine.kv.pool import KVBlockPool  # noqa: E402
from pdserve.engine.kv.transport import _nixl, _paced_agent, slot_descriptors  # noqa: E402
from pdserve.engine.models import KVCache, ModelConfig  # noqa: E402
from pdserve.protocol.kv import KVLayout  # noqa: E402

SMOLLM2 = ModelConfig(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e4,
                      rope_scaling=None, max_position_embeddings=8192, tie_word_embeddings=True)
SLOTS, SLOT_POSITIONS, REPEATS = 4, 8192, 7


def agent(api: Any, regions: list[tuple[int, int]]) -> Any:
    a = _paced_agent(api, f"bench-{uuid.uuid4().hex[:8]}")
    a.register_memory([(address, size, 0, "") for address, size in regions], "DRAM")
    return a


def read(reader: Any, remote: str, local: list[tuple[int, int, int]], far: list[tuple[int, int, int]]) -> float:
    handle = reader.initialize_xfer("READ", reader.get_xfer_descs(local, "DRAM"), reader.get_xfer_descs(far, "DRAM"),
                                    remote, b"pulled")
    start = time.perf_counter()
    reader.transfer(handle)
    while reader.check_xfer_state(handle) == "PROC":
        pass
    seconds = time.perf_counter() - start
    handle.release()
    return seconds


def timed_copy(pool: KVBlockPool, cache: KVCache, slot: int, blocks: list[int], *, to_pool: bool) -> float:
    """One of the pool's copies: a slot's first blocks into the pool (as an export did), or back (as a load did)."""
    start = time.perf_counter()
    if to_pool:
        pool.save_blocks(cache, slot, blocks, blocks)
    else:
        pool.load_blocks(cache, slot, 0, blocks)
    return time.perf_counter() - start


def ms(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1e3


def main() -> int:
    api = _nixl()
    print("| dtype | prompt | now: READ slot to slot | before: copy out + READ blocks + copy in |")
    print("| --- | --- | --- | --- |")
    for dtype, name in ((torch.bfloat16, "bfloat16"), (torch.float32, "float32")):
        itemsize = torch.empty((), dtype=dtype).element_size()
        layout = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=name, itemsize=itemsize)
        prefill, decode = KVCache(SMOLLM2, SLOTS, SLOT_POSITIONS, dtype), KVCache(SMOLLM2, SLOTS, SLOT_POSITIONS, dtype)
        prefill.data[:, :, 1, :, :4096] = 1.0
        pools = [KVBlockPool(layout, 4096 // 16, dtype) for _ in range(2)]
        sides = [agent(api, [(cache.data.data_ptr(), cache.nbytes), (pool.data.data_ptr(), pool.num_blocks * layout.block_bytes)])
                 for cache, pool in ((prefill, pools[0]), (decode, pools[1]))]
        remote = sides[1].add_remote_agent(sides[0].get_agent_metadata())
        for n in (1024, 4096):
            blocks, size = list(range(n // 16)), layout.block_bytes
            now, before = [], []
            for _ in range(REPEATS):
                now.append(read(sides[1], remote, slot_descriptors(decode.data.data_ptr(), SLOTS, SLOT_POSITIONS, layout, 2, 0, n),
                                slot_descriptors(prefill.data.data_ptr(), SLOTS, SLOT_POSITIONS, layout, 1, 0, n)))
                save = timed_copy(pools[0], prefill, 1, blocks, to_pool=True)
                pulled = read(sides[1], remote, [(pools[1].data.data_ptr() + b * size, size, 0) for b in blocks],
                              [(pools[0].data.data_ptr() + b * size, size, 0) for b in blocks])
                load = timed_copy(pools[1], decode, 3, blocks, to_pool=False)
                before.append((save, pulled, load))
            parts = [ms([b[i] for b in before]) for i in range(3)]
            print(f"| {name} | {n} | {ms(now):.1f} ms ({2 * 30 * 3} descriptors) | {parts[0]:.1f} + {parts[1]:.1f} "
                  f"({len(blocks)} descriptors) + {parts[2]:.1f} = {ms([sum(b) for b in before]):.1f} ms |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
