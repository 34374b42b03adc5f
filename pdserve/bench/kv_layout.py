"""What paged KV would cost the torch engine's decode step on this CPU, against the copies its contiguous rows pay.

The engine keeps one contiguous cache row of ``max_model_len`` positions per running sequence, so a decode step's
attention is one SDPA call over strided views of the cache, read in place. Paged KV (blocks of 16 positions
anywhere in one NIXL-registered pool, a block table per sequence) would make the hand-off and prefix-cache hits
zero-copy, but SDPA takes no block table: a decode step must either gather every layer's pages into a
contiguous tensor, or run one SDPA call per sequence over its pages (a view only while its blocks are one
consecutive run). This bench measures, on the real model's shapes, one thread:

* a whole decode step of the model as it runs today (the reference the others are a share of);
* a step's attention three ways: today's slot views; pages gathered (``index_select``) then one SDPA call;
  one SDPA call per sequence over a view of its pages;
* the copies the contiguous rows pay once per request instead: a prompt's KV saved into blocks (a prefill leg's
  export, a prefix-cache store) and loaded back (a pulled leg, a prefix-cache hit).

A paged layout pays its attention cost on every decode step of every sequence; the copies are paid once.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pdserve.bench.report import machine, publish_section

SECTION_HEADING = "## Paged KV on this CPU (pdserve bench kv-layout)"
DEFAULT_DOCS = Path("docs/benchmarks.md")
BLOCK = 16


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs, after one warm-up run."""
    fn()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def run_kv_layout_bench(model: str = "smollm2-135m", *, dtype: str = "auto", batch_sizes: Sequence[int] = (1, 8),
                        spans: Sequence[int] = (256, 1024), repeats: int = 15) -> dict[str, Any]:
    import torch

    from pdserve.checkpoints.resolve import resolve_model
    from pdserve.engine.dtype_choice import choose_dtype
    from pdserve.engine.kv.pool import KVBlockPool
    from pdserve.engine.models import KVCache, load_model
    from pdserve.protocol.kv import KVLayout

    torch.set_num_threads(1)
    torch_dtype = getattr(torch, choose_dtype(dtype).dtype)
    max_len = max(spans)
    lm = load_model(resolve_model(model), torch_dtype, max_len)
    cfg = lm.cfg
    kv_heads, hd, layers = cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
    batch_max = max(batch_sizes)
    cache = KVCache(cfg, batch_max, max_len, torch_dtype)
    cache.data.copy_(torch.randn(cache.data.shape).to(torch_dtype))  # every page committed, finite values
    blocks_per_seq = max_len // BLOCK
    # The paged layout whose pages an SDPA call can view: [2, layers, kv_heads, blocks, 16, head_dim].
    paged = torch.randn(2, layers, kv_heads, batch_max * blocks_per_seq * 2, BLOCK, hd).to(torch_dtype)
    rows = [_one_shape(lm, cache, paged, batch, span, repeats) for batch in batch_sizes for span in spans]
    mixed = _mixed_lengths(lm, cache, max(spans), repeats) if batch_max >= 8 else []
    layout = KVLayout(num_layers=layers, num_kv_heads=kv_heads, head_dim=hd, block_size=BLOCK,
                      dtype=str(torch_dtype).removeprefix("torch."), itemsize=torch.empty((), dtype=torch_dtype).element_size())
    pool = KVBlockPool(layout, max_len // BLOCK, torch_dtype)
    blocks = list(range(max_len // BLOCK))
    copies = {
        "save": median_seconds(lambda: pool.save_blocks(cache, 0, blocks, blocks), repeats),
        "load": median_seconds(lambda: pool.load_blocks(cache, 0, 0, blocks), repeats),
    }
    return {"date": datetime.now(UTC).strftime("%Y-%m-%d"), "machine": machine(), "model": model,
            "dtype": str(torch_dtype).removeprefix("torch."), "torch": torch.__version__, "rows": rows,
            "copy_positions": max_len, "copies_s": copies, "mixed": mixed}


def _one_shape(lm: Any, cache: Any, paged: Any, batch: int, span: int, repeats: int) -> dict[str, Any]:
    """A decode step of ``batch`` sequences at ``span`` positions, and its attention the three ways."""
    import torch
    import torch.nn.functional as F

    cfg, dtype = lm.cfg, lm.dtype
    layers, kv_heads, hd = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    positions = torch.full((batch,), span - 1, dtype=torch.long)
    tokens = torch.zeros(batch, dtype=torch.long)
    step_s = median_seconds(lambda: lm.decode(tokens, positions, cache), repeats)
    query = torch.randn(batch, cfg.num_heads, 1, hd).to(dtype)
    mask = torch.zeros(batch, 1, 1, span)
    n = span // BLOCK
    scattered = torch.randperm(paged.shape[3])[: batch * n]  # pages anywhere in the pool
    gathered = torch.empty(2, kv_heads, batch * n, BLOCK, hd, dtype=dtype)

    def slot_views() -> None:
        for layer in range(layers):
            F.scaled_dot_product_attention(query, cache.keys[layer, :batch, :, :span],
                                           cache.values[layer, :batch, :, :span], attn_mask=mask, enable_gqa=True)

    def pages_gathered() -> None:
        for layer in range(layers):
            torch.index_select(paged[:, layer], 2, scattered, out=gathered)
            kv = gathered.view(2, kv_heads, batch, span, hd).transpose(1, 2)
            F.scaled_dot_product_attention(query, kv[0], kv[1], attn_mask=mask, enable_gqa=True)

    def pages_per_sequence() -> None:  # each sequence's pages one consecutive run: a view
        for layer in range(layers):
            pool = paged[:, layer].flatten(2, 3)
            for seq in range(batch):
                start = seq * n * BLOCK
                F.scaled_dot_product_attention(query[seq : seq + 1], pool[0, None, :, start : start + span],
                                               pool[1, None, :, start : start + span], enable_gqa=True)

    attention = {name: median_seconds(fn, repeats) for name, fn in
                 (("slot views", slot_views), ("pages gathered", pages_gathered),
                  ("pages per sequence", pages_per_sequence))}
    return {"batch": batch, "span": span, "step_s": step_s, "attention_s": attention}


def _mixed_lengths(lm: Any, cache: Any, longest: int, repeats: int) -> list[dict[str, Any]]:
    """Decode steps of 8 sequences of unequal lengths: attention in runs of similar lengths (the engine's) against
    one call padded to the longest (the runs' threshold set out of reach)."""
    from unittest import mock

    import torch

    from pdserve.engine.models import llama

    short = longest // 4
    batches = {f"one of {longest}, seven of {short}": [longest] + [short] * 7,
               f"{longest} down to {longest // 8}": [longest * (8 - i) // 8 for i in range(8)],
               f"eight of {longest // 2}": [longest // 2] * 8}
    rows = []
    for name, lengths in batches.items():
        step = functools.partial(lm.decode, torch.zeros(len(lengths), dtype=torch.long), torch.tensor(lengths) - 1,
                                 cache)
        samples: dict[str, list[float]] = {"runs_s": [], "one_call_s": []}
        for _ in range(repeats):  # interleaved, so that drift on a shared machine hits both alike
            samples["runs_s"].append(median_seconds(step, 1))
            with mock.patch.object(llama, "SPLIT_KEY_ROWS", 1 << 40):
                samples["one_call_s"].append(median_seconds(step, 1))
        rows.append({"batch": name, **{key: statistics.median(values) for key, values in samples.items()}})
    return rows


def docs_section(results: dict[str, Any]) -> str:
    ms = 1000.0
    lines = [
        f"{results['date']}, {results['machine']}, torch {results['torch']}, {results['model']} "
        f"{results['dtype']}, one thread; medians. A decode step as the engine runs it, and its attention "
        "(every layer) three ways: today's slot views; pages gathered into one tensor per layer, then one SDPA "
        "call; one SDPA call per sequence over a view of its pages (each sequence's blocks one consecutive run). "
        "The share is of today's whole step.",
        "",
        "| batch | key span | decode step | attention: slot views | pages gathered | pages per sequence |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in results["rows"]:
        step, att = row["step_s"], row["attention_s"]
        base = att["slot views"]

        def extra(name: str, step: float = step, att: dict[str, float] = att, base: float = base) -> str:
            delta = att[name] - base
            return f"{att[name] * ms:.2f} ms ({delta / step:+.0%} of the step)"

        lines.append(f"| {row['batch']} | {row['span']} | {step * ms:.1f} ms | {base * ms:.2f} ms | "
                     f"{extra('pages gathered')} | {extra('pages per sequence')} |")
    if results["mixed"]:
        lines += ["", "Decode steps of sequences of unequal lengths: attention in runs of similar lengths, as the engine "
                  "runs it, against one SDPA call padded to the longest.", "",
                  "| batch | decode step: runs | one padded call |", "| --- | --- | --- |"]
        lines += [f"| {row['batch']} | {row['runs_s'] * ms:.1f} ms | {row['one_call_s'] * ms:.1f} ms |"
                  for row in results["mixed"]]
    copies, positions = results["copies_s"], results["copy_positions"]
    lines += [
        "",
        f"The copies the contiguous rows pay instead, once per request: a {positions}-position prompt's KV saved "
        f"into blocks (a prefill leg's export, a prefix-cache store) {copies['save'] * ms:.1f} ms, loaded back into "
        f"a slot (a pulled decode leg, a prefix-cache hit) {copies['load'] * ms:.1f} ms.",
    ]
    return "\n".join(lines) + "\n"


def add_kv_layout_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--docs", type=Path, default=DEFAULT_DOCS, help="markdown file whose section is replaced")
    parser.add_argument("--no-docs", action="store_true")


def run_kv_layout_cli(args: argparse.Namespace) -> int:
    results = run_kv_layout_bench(args.model, dtype=args.dtype, repeats=args.repeats)
    publish_section(SECTION_HEADING, docs_section(results), None if args.no_docs else args.docs)
    return 0
