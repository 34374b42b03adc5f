"""A long prompt arriving while streams decode: how much it stalls them, per step token budget.

Without chunked prefill, the step that prefills a 4k-token prompt is as long as the whole prefill, and
every running stream waits that long for its next token. With ``--max-num-batched-tokens`` the prompt is
prefilled a chunk per step beside the running streams' decode rows, so their inter-token latency stays
near a decode step's. This measures it on the in-process torch engine: ``streams`` requests decode, then
the long prompt arrives; the streams' ITL from its arrival until its first token (median, p99, max) and
the long prompt's TTFT, for each budget. The budgets run one after the other on fresh engines.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pdserve.bench.engine import chat_and_long_prompts, torch_threads, torch_version
from pdserve.bench.report import machine, percentile, publish_section
from pdserve.engine.api import Engine
from pdserve.engine.dtype_choice import DTYPE_CHOICES, choose_dtype
from pdserve.engine.factory import build_engine
from pdserve.engine.spec import EngineSpec
from pdserve.protocol.engine import EngineRequest, SequenceSampling

SECTION_HEADING = "## A long prompt among running streams (pdserve bench interference)"
DEFAULT_DOCS = Path("docs/benchmarks.md")
# --max-num-seqs of every engine the bench builds: the streams and the long prompt run at once, none waits.
SLOTS = 16


class BadBenchArguments(ValueError):
    """An argument a run would fail on or measure wrongly with, refused before any engine is built."""


def check_arguments(prompt_tokens: int, streams: int, budgets: Sequence[int]) -> None:
    """Refuse, before any engine is built, what a run would fail on budgets in (an engine refuses a budget below
    its slots) or measure wrongly (a prompt that waits for a slot)."""
    if prompt_tokens < 1:
        raise BadBenchArguments("--prompt-tokens must be at least 1")
    if not 1 <= streams < SLOTS:
        raise BadBenchArguments(f"--streams must be 1 to {SLOTS - 1}: the engine has {SLOTS} slots, one for the "
                                "long prompt")
    if not budgets:
        raise BadBenchArguments("--budgets needs at least one --max-num-batched-tokens value")
    small = [budget for budget in budgets if budget < SLOTS]
    if small:
        raise BadBenchArguments(f"--budgets {','.join(map(str, small))}: a step's token budget must be at least the "
                                f"engine's {SLOTS} slots (--max-num-seqs), as every running sequence decodes a token "
                                "each step")


async def _interference(engine: Engine, chats: list[list[int]], long_prompt: list[int], streams: int,
                        warmup_tokens: int) -> dict[str, float]:
    """Start ``streams`` decodes; after ``warmup_tokens`` each, send the long prompt; the streams' gaps
    between tokens while it is prefilled, and its TTFT."""
    arrivals: dict[int, list[float]] = {i: [] for i in range(streams)}
    warmed = asyncio.Event()
    done = asyncio.Event()
    window: list[float] = []  # [long prompt sent, its first token]

    async def stream(i: int) -> None:
        sampling = SequenceSampling(max_tokens=100_000, temperature=0.0, ignore_eos=True)
        request = EngineRequest(request_id=f"stream-{i}", prompt_token_ids=chats[i % len(chats)], sampling=sampling)
        async for output in engine.generate(request):
            arrivals[i].extend([time.perf_counter()] * len(output.new_token_ids))
            if all(len(a) >= warmup_tokens for a in arrivals.values()):
                warmed.set()
            if done.is_set() and len(arrivals[i]) > warmup_tokens + 2:
                break
        await engine.abort([request.request_id])

    async def long_request() -> None:
        await warmed.wait()
        request = EngineRequest(request_id="long", prompt_token_ids=long_prompt,
                                sampling=SequenceSampling(max_tokens=1))
        window.append(time.perf_counter())
        async for _ in engine.generate(request):
            window.append(time.perf_counter())
        done.set()

    await asyncio.gather(*(stream(i) for i in range(streams)), long_request())
    sent, first = window[0], window[1]
    pairs = [(a, b) for times in arrivals.values() for a, b in zip(times, times[1:], strict=False)]
    gaps = [b - a for a, b in pairs if b > sent and a < first]
    steady = [b - a for a, b in pairs if b <= sent][-streams * 8 :]
    return {
        "ttft_s": first - sent,
        "itl_p50_s": statistics.median(gaps),
        "itl_p99_s": percentile(gaps, 99),
        "itl_max_s": max(gaps),
        "steady_itl_p50_s": statistics.median(steady),
        "gaps": len(gaps),
    }


def run_interference_bench(
    model: str = "smollm2-135m", *, dtype: str = "auto", prompt_tokens: int = 4096, streams: int = 8,
    budgets: Sequence[int] = (8192, 2048, 256, 64), warmup_tokens: int = 16,
) -> dict[str, Any]:
    check_arguments(prompt_tokens, streams, budgets)
    chats, long_prompt = chat_and_long_prompts(model, prompt_tokens)
    chosen = choose_dtype(dtype)
    rows = {}
    for budget in budgets:
        spec = EngineSpec(kind="torch", model=model, dtype=chosen.dtype, dtype_reason=chosen.reason,
                          max_num_seqs=SLOTS, max_num_batched_tokens=budget, max_model_len=prompt_tokens + 512)

        async def run(spec: EngineSpec = spec) -> dict[str, float]:
            engine = build_engine(spec)
            await engine.start()
            try:
                return await _interference(engine, chats, long_prompt, streams, warmup_tokens)
            finally:
                await engine.shutdown()

        rows[budget] = asyncio.run(run())
        print(f"--max-num-batched-tokens {budget}: {rows[budget]}", flush=True)
    return {
        "model": model, "dtype": chosen.dtype, "prompt_tokens": prompt_tokens, "streams": streams, "rows": rows,
        "torch_threads": torch_threads(), "torch_version": torch_version(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": machine(),
    }


def docs_section(results: dict[str, Any]) -> str:
    """The body of this benchmark's section in docs/benchmarks.md (the heading is added on write)."""
    n, streams = results["prompt_tokens"], results["streams"]
    rows = ["| `--max-num-batched-tokens` | streams' ITL p50 / p99 / max while it prefills | ITL p50 before it "
            "arrived | p99 while ÷ p50 before | p99 ÷ p50, both while | its TTFT |",
            "| --- | --- | --- | --- | --- | --- |"]
    for budget, r in results["rows"].items():
        chunked = f"{budget} (one step: no chunking)" if int(budget) >= n + streams else f"{budget}"
        rows.append(f"| {chunked} | {r['itl_p50_s'] * 1000:.0f} / {r['itl_p99_s'] * 1000:.0f} / "
                    f"{r['itl_max_s'] * 1000:.0f} ms | {r['steady_itl_p50_s'] * 1000:.0f} ms | "
                    f"{r['itl_p99_s'] / r['steady_itl_p50_s']:.1f}× | {r['itl_p99_s'] / r['itl_p50_s']:.1f}× | "
                    f"{r['ttft_s'] * 1000:,.0f} ms |")
    budgets = ",".join(str(b) for b in results["rows"])
    return "\n".join([
        f"{results['model']} ({results['dtype']}), in-process torch engine: {streams} greedy streams decode, then "
        f"a {n}-token prompt arrives. The streams' inter-token gaps from its arrival to its first token, and its "
        "TTFT, per step token budget (each budget on a fresh engine, one after the other).",
        "",
        *rows,
        "",
        "* A step with a chunk runs the decode rows and the chunk's rows through the weights in one pass; the "
        "chunk's attention reads every cached key of the prompt so far, so while streams decode a chunk gets no "
        "more rows than keep that under the budget times 1,024 key rows (`CHUNK_ATTENTION_SPAN`), down to 128 "
        "rows where SDPA attends the chunk and 8 where pdserve's kernel does (the model's `chunk_min_rows`): late "
        "chunks of a long prompt are smaller than early ones at large budgets, and a smaller budget trades the "
        "prompt's TTFT for the streams' pace (docs/engine.md, chunked prefill).",
        "* Two readings of issue 30's target (a p99 at most twice the median): against the streams' pace before "
        "the prompt came (how much slower they got), and against their own median while it prefills (how uneven "
        "their gaps are). The second says little alone: a prefill in one step, a single long stall, can read as "
        "even gaps.",
        f"* {results['torch_threads']} torch threads; the machine is shared and noisy: compare rows of one run.",
        "",
        "```",
        f"pdserve bench interference --model {results['model']} --dtype {results['dtype']} --prompt-tokens {n} "
        f"--streams {streams} --budgets {budgets}",
        "```",
        "",
        f"Run on {results['date'][:10]} (UTC), {results['machine']}, torch {results['torch_version']}.",
    ])


def add_interference_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--budgets", default="8192,2048,256,64",
                        help="--max-num-batched-tokens values, comma-separated (one at least the prompt: no chunking)")
    parser.add_argument("--docs", type=Path, default=DEFAULT_DOCS, help="markdown file whose section is replaced")
    parser.add_argument("--no-docs", action="store_true")


def run_interference_cli(args: argparse.Namespace) -> int:
    try:
        budgets = [int(budget) for budget in args.budgets.split(",")]
    except ValueError:
        print(f"pdserve: --budgets takes whole numbers, comma-separated (got {args.budgets!r})", file=sys.stderr)
        return 2
    try:
        results = run_interference_bench(args.model, dtype=args.dtype, prompt_tokens=args.prompt_tokens,
                                         streams=args.streams, budgets=budgets)
    except BadBenchArguments as e:  # only check_arguments' refusals: a run's own failures keep their traceback
        print(f"pdserve: {e}", file=sys.stderr)
        return 2
    publish_section(SECTION_HEADING, docs_section(results), None if args.no_docs else args.docs)
    return 0
