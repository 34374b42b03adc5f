"""Multi-turn conversations with a shared system prompt: TTFT per turn, for servers side by side.

Chat and agent traffic resends the whole conversation every turn: a long system prompt shared by every
conversation, then a history that grows by a question and an answer per turn. A server with prefix
caching computes only what it has not seen (the new question, and the last answer where it did not keep
it); one without recomputes the whole prompt every turn. ``conversations`` conversations run at once,
each turn after the previous answer (the answer, as the server gave it, joins the history), over
``/v1/completions`` streams (any server with a completions endpoint: pdserve, vLLM). The arms (base URLs)
run one after another with the same conversations; each starts with one unmeasured request of another
system prompt, so no arm finds the shared prompt cached before its first turn.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from pdserve.bench.report import machine, percentile, publish_section

SECTION_HEADING = "## Multi-turn chat with a shared system prompt (pdserve bench multiturn)"
DEFAULT_DOCS = Path("docs/benchmarks.md")
_WORDS = ("platform", "timetable", "junction", "express", "ticket", "carriage", "signal", "station", "freight",
          "connection", "delay", "route", "terminus", "sleeper", "coach", "depot")


def system_prompt(words: int, seed: int) -> str:
    """About ``words`` words of rules (roughly 1.3 tokens each with a BPE tokenizer)."""
    rng = random.Random(seed)
    rules = []
    while sum(len(r.split()) for r in rules) < words:
        rules.append(f"Rule {len(rules) + 1}: when asked about the {rng.choice(_WORDS)} or the {rng.choice(_WORDS)}, "
                     f"answer with the {rng.choice(_WORDS)} first and keep it short.")
    return "You are the assistant of a railway timetable office.\n" + "\n".join(rules)


def question(rng: random.Random) -> str:
    return f"Which {rng.choice(_WORDS)} serves the {rng.choice(_WORDS)} to {rng.choice(_WORDS)} {rng.randrange(100)}?"


@dataclass
class Turn:
    conversation: int
    turn: int
    prompt_tokens: int
    ttft_s: float
    cached_tokens: int | None


@dataclass
class Arm:
    url: str
    label: str
    turns: list[Turn] = field(default_factory=list)
    wall_s: float = 0.0


async def _complete(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int
                    ) -> tuple[float, str, dict[str, Any]]:
    """One streamed completion: TTFT, its text, its usage."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, text, usage = None, [], {}
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                if choice.get("text"):
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    text.append(choice["text"])
    if ttft is None:
        raise RuntimeError(f"{url}: a completion without text")
    return ttft, "".join(text), usage


async def _run_arm(arm: Arm, model: str, system: str, conversations: int, turns: int, max_tokens: int,
                   seed: int) -> None:
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        await _complete(client, arm.url, model, system_prompt(200, seed + 1) + "\nUser: hello\nAssistant:", 4)

        async def converse(c: int) -> None:
            rng, history = random.Random(seed * 1000 + c), system
            for t in range(turns):
                history += f"\n\nUser: {question(rng)}\nAssistant:"
                ttft, answer, usage = await _complete(client, arm.url, model, history, max_tokens)
                details = usage.get("prompt_tokens_details") or {}
                arm.turns.append(Turn(c, t, int(usage.get("prompt_tokens", 0)), ttft, details.get("cached_tokens")))
                history += answer

        start = time.perf_counter()
        await asyncio.gather(*(converse(c) for c in range(conversations)))
        arm.wall_s = time.perf_counter() - start


def run_multiturn_bench(urls: list[str], labels: list[str], *, model: str | None, conversations: int, turns: int,
                        system_words: int, max_tokens: int, seed: int) -> dict[str, Any]:
    if not model:
        model = httpx.get(urls[0] + "/v1/models", timeout=30).json()["data"][0]["id"]
    system = system_prompt(system_words, seed)
    arms = [Arm(url, label) for url, label in zip(urls, labels, strict=True)]
    for arm in arms:
        print(f"{arm.label} ({arm.url}): {conversations} conversations × {turns} turns ...", flush=True)
        asyncio.run(_run_arm(arm, model, system, conversations, turns, max_tokens, seed))
        print(f"  {_summary(arm)}", flush=True)
    return {
        "model": model, "conversations": conversations, "turns": turns, "max_tokens": max_tokens,
        "system_tokens": min(t.prompt_tokens for a in arms for t in a.turns if t.turn == 0),
        "arms": [{"label": a.label, "url": a.url, "wall_s": a.wall_s, "turns": [vars(t) for t in a.turns]} for a in arms],
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": machine(),
    }


def _ttfts(arm: Arm | dict[str, Any], later_turns: bool | None = None) -> list[float]:
    turns = arm.turns if isinstance(arm, Arm) else [Turn(**t) for t in arm["turns"]]
    return sorted(t.ttft_s for t in turns if later_turns is None or (t.turn > 0) == later_turns)


def _summary(arm: Arm) -> str:
    ttfts = _ttfts(arm)
    return f"TTFT p50 {statistics.median(ttfts) * 1000:,.0f} ms, p90 {percentile(ttfts, 90) * 1000:,.0f} ms"


def docs_section(results: dict[str, Any]) -> str:
    """The body of this benchmark's section in docs/benchmarks.md (the heading is added on write)."""
    arms = results["arms"]
    first = arms[0]
    rows = ["| arm | TTFT p50 / p90, every turn | TTFT p50, first turns | TTFT p50, later turns | "
            "cached prompt positions | p50 ÷ first arm's | wall |", "| --- | --- | --- | --- | --- | --- | --- |"]
    base = statistics.median(_ttfts(first))
    for arm in arms:
        every, firsts, later = _ttfts(arm), _ttfts(arm, False), _ttfts(arm, True)
        cached = [t["cached_tokens"] for t in arm["turns"]]
        prompts = sum(t["prompt_tokens"] for t in arm["turns"])
        hit = (f"{sum(cached):,} of {prompts:,} ({sum(cached) / prompts:.0%})" if all(c is not None for c in cached)
               else "not reported")
        rows.append(f"| {arm['label']} | {statistics.median(every) * 1000:,.0f} / {percentile(every, 90) * 1000:,.0f} ms "
                    f"| {statistics.median(firsts) * 1000:,.0f} ms | {statistics.median(later) * 1000:,.0f} ms | {hit} | "
                    f"{statistics.median(every) / base:.2f}× | {arm['wall_s']:.0f} s |")
    labels = ",".join(a["label"] for a in arms)
    return "\n".join([
        f"{results['model']}: {results['conversations']} conversations at once, {results['turns']} turns each, "
        f"over `/v1/completions` streams; a shared system prompt of {results['system_tokens']:,} tokens, a question "
        f"per turn and answers of {results['max_tokens']} tokens (greedy, ignore_eos) that join the history. TTFT "
        "of every turn; the arms ran one after another with the same conversations.",
        "",
        *rows,
        "",
        "* \"first turns\": the shared system prompt is new to the server only for the very first of them; "
        "\"later turns\" resend the whole history. Cached positions come from `usage.prompt_tokens_details` "
        "(pdserve with `--enable-prompt-tokens-details`).",
        "",
        "```",
        f"pdserve bench multiturn --base-url URL ... --label {labels} --conversations {results['conversations']} "
        f"--turns {results['turns']} --max-tokens {results['max_tokens']}",
        "```",
        "",
        f"Run on {results['date'][:10]} (UTC), {results['machine']}.",
    ])


def add_multiturn_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", action="append", required=True, help="server URL; repeat for side-by-side arms")
    parser.add_argument("--label", default=None, help="the arms' names, comma-separated (default: their URLs)")
    parser.add_argument("--model", default=None, help="served model name (default: the first server's /v1/models)")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-words", type=int, default=760, help="about 1k tokens with a BPE tokenizer")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per answer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-json", type=Path, default=None, help="also write the raw per-turn results here")
    parser.add_argument("--docs", type=Path, default=DEFAULT_DOCS, help="markdown file whose section is replaced")
    parser.add_argument("--no-docs", action="store_true")


def run_multiturn_cli(args: argparse.Namespace) -> int:
    labels = args.label.split(",") if args.label else list(args.base_url)
    if len(labels) != len(args.base_url):
        raise SystemExit("--label needs one name per --base-url")
    results = run_multiturn_bench(list(args.base_url), labels, model=args.model, conversations=args.conversations,
                                  turns=args.turns, system_words=args.system_words, max_tokens=args.max_tokens,
                                  seed=args.seed)
    if args.result_json is not None:
        args.result_json.write_text(json.dumps(results, indent=1))
    publish_section(SECTION_HEADING, docs_section(results), None if args.no_docs else args.docs)
    return 0
