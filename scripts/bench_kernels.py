"""pdserve's float32 CPU kernels against what they replace, on this machine (docs/benchmarks.md, "pdserve's own
kernels"): the linear layers against oneDNN's prepacked matmul, decode attention and a small prompt chunk's
attention against torch's SDPA, with SmolLM2-135M's shapes and random values. Medians of repeated calls; the
attention reads a 30-layer cache laid out as the engine's (an anonymous mapping without huge pages), so keys and
values come from memory, as in a step.

    .venv/bin/python scripts/bench_kernels.py [--threads 1,2]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pdserve.bench.kv_layout import median_seconds
from pdserve.engine.kernels import load_native_kernels
from pdserve.engine.models.llama import KVCache, ModelConfig

# SmolLM2-135M: per layer qkv (960 x 576), o (576 x 576), gate+up (3072 x 576), down (576 x 1536); the tied lm_head.
LAYERS = 30
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LM_HEAD = (49152, 576)
SMOLLM2 = ModelConfig(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_layers=LAYERS, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                      rope_theta=1e5, rope_scaling=None, max_position_embeddings=2048, tie_word_embeddings=True)


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    return median_seconds(fn, repeats) * 1e3


def linears(threads: int, rows: list[int]) -> list[str]:
    torch.set_num_threads(threads)
    native = load_native_kernels()
    shapes = LAYER_SHAPES * LAYERS + [LM_HEAD]
    weights = [torch.randn(shape) for shape in shapes]
    packed = [native.pack(w) for w in weights]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights]
    out = []
    for m in rows:
        x = {k: torch.randn(m, k) for k in (576, 1536)}
        x2 = {k: torch.randn(max(m, 2), k) for k in (576, 1536)}  # oneDNN's one-row path runs as two rows
        ours = median_ms(lambda x=x: [native.linear(x[w.shape[1]], p, w.shape[0]) for w, p in zip(weights, packed)], 7)
        theirs = median_ms(lambda x2=x2: [torch.ops.mkldnn._linear_pointwise(x2[w.shape[1]], o, None, "none", [], "")
                                          for w, o in zip(weights, onednn)], 7)
        out.append(f"| linears (every weight once) | {threads} | {m} | {ours:.1f} ms | {theirs:.1f} ms | "
                   f"{theirs / ours:.2f}× |")
    return out


def attention(threads: int, rows: int, length: int) -> str:
    torch.set_num_threads(threads)
    native = load_native_kernels()
    cache = KVCache(SMOLLM2, 16, 2048, torch.float32)
    cache.data.normal_()
    cfg = SMOLLM2
    heads = torch.randn(rows, cfg.num_heads + 2 * cfg.num_kv_heads, cfg.head_dim)
    slots, positions = torch.arange(rows), torch.full((rows,), length - 1)
    span = -(-length // 16) * 16
    mask = torch.zeros(rows, 1, 1, span).masked_fill_(
        (torch.arange(span)[None, :] > positions[:, None])[:, None, None, :], float("-inf"))

    def ours() -> None:  # as the engine calls it: the rows checked once per step, then every layer
        plan = native.decode_rows(slots, positions + 1, cache.num_slots, cache.max_len)
        for layer in range(LAYERS):
            native.decode_attention(heads, cfg.num_heads, cache.keys[layer], cache.values[layer], plan)

    def sdpa() -> None:  # as the engine calls it: one call over the run of slots, the cache read in place
        for layer in range(LAYERS):
            F.scaled_dot_product_attention(heads[:, : cfg.num_heads, None], cache.keys[layer, :rows, :, :span],
                                           cache.values[layer, :rows, :, :span], attn_mask=mask, enable_gqa=True)

    a, b = median_ms(ours, 9), median_ms(sdpa, 9)
    return f"| decode attention, {LAYERS} layers, {length} positions | {threads} | {rows} | {a:.1f} ms | {b:.1f} ms | {b / a:.2f}× |"


def chunk_attention(threads: int, rows: int, cached: int) -> str:
    """A prompt chunk's rows after ``cached`` positions of its own slot, each up to its own position: the kernel's
    grouped rows against the masked SDPA call the engine makes for a larger chunk (as ``_cached_attention``)."""
    torch.set_num_threads(threads)
    native = load_native_kernels()
    cfg = SMOLLM2
    cache = KVCache(cfg, 2, cached + 512, torch.float32)
    cache.data.normal_()
    heads = torch.randn(rows, cfg.num_heads + 2 * cfg.num_kv_heads, cfg.head_dim)
    positions = torch.arange(cached, cached + rows)
    span = -(-(cached + rows) // 16) * 16
    mask = (torch.arange(span)[None, :] <= positions[:, None])[None, None]

    def ours() -> None:
        plan = native.decode_rows(torch.zeros(rows, dtype=torch.long), positions + 1, cache.num_slots, cache.max_len)
        for layer in range(LAYERS):
            native.decode_attention(heads, cfg.num_heads, cache.keys[layer], cache.values[layer], plan)

    def sdpa() -> None:
        for layer in range(LAYERS):
            F.scaled_dot_product_attention(heads[:, : cfg.num_heads].transpose(0, 1)[None],
                                           cache.keys[layer, 0, :, :span][None], cache.values[layer, 0, :, :span][None],
                                           attn_mask=mask, enable_gqa=True)

    a, b = median_ms(ours, 7), median_ms(sdpa, 7)
    return (f"| chunk attention, {LAYERS} layers, after {cached} positions | {threads} | {rows} | {a:.1f} ms | "
            f"{b:.1f} ms | {b / a:.2f}× |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rows", default="1,2,8,16,128,512")
    args = parser.parse_args()
    print("| what | threads | rows | pdserve's kernel | oneDNN / SDPA | ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    for threads in (int(t) for t in args.threads.split(",")):
        for line in linears(threads, [int(r) for r in args.rows.split(",")]):
            print(line, flush=True)
        for rows, length in ((1, 1050), (8, 256), (8, 1050)):
            print(attention(threads, rows, length), flush=True)
        for rows, cached in ((8, 1024), (24, 1024), (120, 1024), (8, 4000), (24, 4000), (120, 4000)):
            print(chunk_attention(threads, rows, cached), flush=True)


if __name__ == "__main__":
    main()
