"""A mixed generate load whose every answer is checked against its script: the reliability suite's load
test (tests/e2e/test_reliability.py) and the soak (tests/soak, ``make soak``) run the same requests.

The server is pdserve's scripted engine with the real Qwen3 tokenizer and the qwen3 reasoning parser, so an
answer is known before it is asked for: its ids (the script's, then EOS), its text, and for ``derender``
the reasoning/content split, written here by hand rather than computed by pdserve.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.sse import parse_sse

PROMPT = [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]

# Each script with what a reader of it must see: its text, and for derender the message the qwen3
# reasoning parser makes of it. Qwen3's chat template opens the think block in the prompt, so an output
# without </think> is all reasoning (as in vLLM).
SCRIPTS = [
    {"text": "Plain answer number one, with punctuation: commas, periods and (parentheses).",
     "reasoning": "Plain answer number one, with punctuation: commas, periods and (parentheses).", "content": ""},
    {"text": "<think>\nFirst add 2 and 2.\n</think>\n\nThe sum is 4.", "reasoning": "First add 2 and 2.",
     "content": "The sum is 4."},
    {"text": "多字节文本：你好，世界！🎉 and café.", "reasoning": "多字节文本：你好，世界！🎉 and café.", "content": ""},
    {"text": "<think>\nShort.\n</think>\n\nDone ✅", "reasoning": "Short.", "content": "Done ✅"},
]

MODES = ("tokens", "text", "derender")


def write_scripts(path: Path) -> Path:
    """The scripts as the scripted engine's ``--script`` JSONL."""
    path.write_text("".join(json.dumps({"text": s["text"]}) + "\n" for s in SCRIPTS), encoding="utf-8")
    return path


def generate_body(mode: str, script: int, stream: bool, **sampling: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "token_ids": PROMPT, "output_mode": mode, "stream": stream,
        "sampling_params": {"extra_args": {"script_index": script}, **sampling},
    }
    if mode == "derender":
        body["chat_request"] = {"messages": [{"role": "user", "content": "hi"}]}
    return body


def check_answer(mode: str, stream: bool, answer: dict[str, Any] | list[dict[str, Any]], script: dict[str, Any],
                 ids: list[int]) -> None:
    if stream:
        events = answer
        choices = [ev["choices"][0] for ev in events if ev.get("choices")]
        assert choices[-1]["finish_reason"] == "stop"
        got_ids = [i for c in choices for i in c["token_ids"] or []]
        if mode == "tokens":
            got: Any = got_ids
        elif mode == "text":
            got = "".join(c["text"] for c in choices)
        else:
            reasoning = "".join(c["delta"].get("reasoning") or c["delta"].get("reasoning_content") or ""
                                for c in choices)
            content = "".join(c["delta"].get("content") or "" for c in choices)
            got = (reasoning.strip() or None, content.strip())
    else:
        choice = answer["choices"][0]  # type: ignore[index]
        assert choice["finish_reason"] == "stop"
        got_ids = choice["token_ids"]
        if mode == "tokens":
            got = got_ids
        elif mode == "text":
            got = choice["text"]
        else:
            message = choice["message"]
            reasoning = message.get("reasoning") or message.get("reasoning_content")
            got = (reasoning.strip() if reasoning else None, (message["content"] or "").strip())
    assert got_ids[:-1] == ids, "the engine's ids are the script's, then EOS"
    if mode == "tokens":
        got = got[:-1]
    want = ids if mode == "tokens" else script["text"] if mode == "text" else (script["reasoning"], script["content"])
    assert got == want, (mode, stream, got, want)


@dataclass
class LoadResult:
    total: int
    concurrency: int
    elapsed_s: float = 0.0
    done: int = 0
    failures: list[str] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)  # of the answers that passed, request to last byte

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")

    def summary(self) -> str:
        return (f"{self.total} requests at concurrency {self.concurrency} in {self.elapsed_s:.1f} s, "
                f"{len(self.failures)} failed; latency p50 {self.percentile(0.5) * 1e3:.0f} ms, "
                f"p99 {self.percentile(0.99) * 1e3:.0f} ms, max {max(self.latencies_s, default=0) * 1e3:.0f} ms")


def run_mixed_load(url: str, total: int, concurrency: int, script_ids: list[list[int]],
                   progress: Callable[[int], None] | None = None) -> LoadResult:
    """``total`` requests at ``concurrency`` against ``url`` (a server's base URL), request ``k`` being
    mode ``k % 3``, streamed when ``(k // 3)`` is odd, script ``k % 4``; every answer checked. A failure
    is collected, never raised, so one does not hide the count of the others."""
    generate = url + "/inference/v1/generate"
    result = LoadResult(total, concurrency)

    async def one(client: httpx.AsyncClient, k: int) -> None:
        mode = MODES[k % 3]
        stream = (k // 3) % 2 == 1
        script = k % len(SCRIPTS)
        body = generate_body(mode, script, stream, max_tokens=200)
        started = time.monotonic()
        try:
            if stream:
                async with client.stream("POST", generate, json=body) as r:
                    assert r.status_code == 200, await r.aread()
                    events, finished = parse_sse([line async for line in r.aiter_lines()])
                assert finished
                check_answer(mode, True, events, SCRIPTS[script], script_ids[script])
            else:
                r = await client.post(generate, json=body)
                assert r.status_code == 200, r.text
                check_answer(mode, False, r.json(), SCRIPTS[script], script_ids[script])
            result.latencies_s.append(time.monotonic() - started)
        except Exception as e:  # noqa: BLE001 - collected: one failure must not hide the count of the others
            result.failures.append(f"request {k} ({mode}, stream={stream}): {e!r}"[:500])

    async def run() -> None:
        queue: asyncio.Queue[int] = asyncio.Queue()
        for k in range(total):
            queue.put_nowait(k)
        # httpx's defaults otherwise, keep-alive expiry (5 s) included: the clients a server meets.
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            async def worker() -> None:
                while not queue.empty():
                    await one(client, queue.get_nowait())
                    result.done += 1
                    if progress is not None:
                        progress(result.done)

            await asyncio.gather(*(worker() for _ in range(concurrency)))

    started = time.monotonic()
    asyncio.run(run())
    result.elapsed_s = time.monotonic() - started
    return result
