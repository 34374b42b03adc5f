"""The benchmark workload: synthetic outputs shaped like Qwen3 agent traffic.

Thinking, then a markdown answer or a hermes tool call, built to a target token count with the real
tokenizer, so parsers and detokenizer do the work they do in production.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.text.tokenizer import Tokenizer

EOS = "<|im_end|>"  # Qwen3's end of turn: every script ends with it, as a real generation does


TOPICS = ("merging overlapping intervals", "the weekly sales report", "a flaky integration test",
          "the cache eviction policy", "compound interest on a loan", "parsing ISO 8601 dates",
          "deduplicating customer records", "the Paris weather tomorrow")
THINKING = (
    "Okay, so the user is asking about {topic}.",
    "Let me think through this carefully before answering.",
    "First, I should pin down what the input looks like and what they expect back.",
    "Hmm, {a} times {b} is {ab}, and adding {c} gives {abc}.",
    "Wait, let me double-check that: {a} * {b} = {ab}. Yes, that's right.",
    "Another angle is the edge cases: an empty list, a single element, or duplicates.",
    "If I sort first, each pass is O(n log n), which is fine for {a} thousand rows.",
    "Alternatively, a hash map would count occurrences in a single pass.",
    "The user might also care about {topic2}, but that's secondary.",
    "So the answer should be short, correct, and come with a small example.",
    "Actually, I need to be careful with time zones here; UTC avoids surprises.",
    "Let me re-read the question to make sure I'm not missing a constraint.",
)
ANSWER = (
    "## Summary\n\nThe short answer for {topic} is **{abc}**.\n\n",
    "Here's how to get there:\n\n- Multiply {a} by {b} to get {ab}.\n- Add {c}, which gives {abc}.\n\n",
    ("```python\ndef solve(rows: list[dict]) -> int:\n    seen = set()\n    for row in rows:\n"
     "        seen.add(row[\"id\"])\n    return len(seen)\n```\n\n"),
    "> Note: results are in UTC; convert before showing them to users.\n\n",
    "| step | value |\n| --- | --- |\n| product | {ab} |\n| total | {abc} |\n\n",
    "总结：答案是 {abc}。希望这对你有帮助！🚀\n\n",
    "If you want, I can also walk through {topic2} next. 😊\n\n",
)
CODE = (
    "import json\n", "from datetime import datetime, timezone\n\n",
    "def load(path: str) -> list[dict]:\n    with open(path, encoding=\"utf-8\") as f:\n        return json.load(f)\n\n",
    "rows = load(\"data/{name}.json\")\n",
    "total = sum(r[\"amount\"] * {a} for r in rows if r.get(\"status\") == \"ok\")\n",
    "print(f\"total={{total:.2f}} at {{datetime.now(timezone.utc).isoformat()}}\")\n",
    "by_day: dict[str, int] = {{}}\nfor r in rows:\n    by_day[r[\"day\"]] = by_day.get(r[\"day\"], 0) + {b}\n",
    "assert len(rows) >= {c}, 'expected at least {c} rows'\n",
)
SYSTEM_PROMPT = (
    "You are a careful assistant for an engineering team. Think step by step before you answer. Prefer "
    "short, correct answers with one small example. Use the tools when you need fresh data or to run code; "
    "never invent tool results. Format answers in Markdown and state units and time zones explicitly."
)


def _tool(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


TOOLS = [
    _tool("get_weather", "Current weather for a city", {"city": {"type": "string"},
          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city"]),
    _tool("run_python", "Run Python code in a sandbox and return stdout", {"code": {"type": "string"}}, ["code"]),
    _tool("search_docs", "Search the team wiki", {"query": {"type": "string"}, "limit": {"type": "integer"}},
          ["query"]),
]


@dataclass(frozen=True)
class Script:
    """One scripted model output and what a correct client must reconstruct from it."""

    length: int  # the target output length this script belongs to
    kind: str  # "answer" (reasoning + markdown answer) or "tool_call" (reasoning + hermes call)
    output: str  # model output in Qwen3 markup, ending with <|im_end|>
    tokens: int  # len(tokenizer.encode(output)), EOS included
    reasoning: str
    content: str
    tool_call: tuple[str, dict[str, Any]] | None
    question: str


def _fill(template: str, rng: random.Random) -> str:
    a, b, c = rng.randint(3, 99), rng.randint(3, 99), rng.randint(1, 999)
    topic, topic2 = rng.sample(TOPICS, 2)
    return template.format(topic=topic, topic2=topic2, a=a, b=b, c=c, ab=a * b, abc=a * b + c,
                           name=topic.split()[-1])


def _grow(tokenizer: Tokenizer, pieces: Iterator[str], budget: int, sep: str) -> str:
    """Join pieces until the text is at least ``budget`` tokens long (always at least one piece)."""
    text = next(pieces)
    while len(tokenizer.encode(text)) < budget:
        text += sep + next(pieces)
    return text


def build_script(tokenizer: Tokenizer, length: int, kind: str, rng: random.Random) -> Script:
    """A Qwen3 reasoning output of about ``length`` tokens: ~60% thinking, the rest answer or tool call."""
    shuffled = (_fill(rng.choice(THINKING), rng) for _ in itertools.count())
    reasoning = _grow(tokenizer, shuffled, int(length * 0.6), " ")
    rest = max(length - len(tokenizer.encode(reasoning)) - 12, 8)
    question = f"Can you help me with {rng.choice(TOPICS)}?"
    if kind == "answer":
        answer = _grow(tokenizer, (_fill(t, rng) for t in itertools.cycle(ANSWER)), rest, "").strip()
        output = f"<think>\n{reasoning}\n</think>\n\n{answer}{EOS}"
        return Script(length, kind, output, len(tokenizer.encode(output)), reasoning, answer, None, question)
    arguments = {"code": _grow(tokenizer, (_fill(t, rng) for t in itertools.cycle(CODE)), rest - 20, "")}
    call = json.dumps({"name": "run_python", "arguments": arguments}, ensure_ascii=False)
    output = f"<think>\n{reasoning}\n</think>\n\n<tool_call>\n{call}\n</tool_call>{EOS}"
    return Script(length, kind, output, len(tokenizer.encode(output)), reasoning, "", ("run_python", arguments),
                  question)


def build_scripts(tokenizer: Tokenizer, lengths: Sequence[int], per_length: int, seed: int) -> list[Script]:
    rng = random.Random(seed)
    kinds = ("answer", "tool_call")
    return [build_script(tokenizer, n, kinds[i % 2], rng) for n in lengths for i in range(per_length)]


def chat_request(script: Script, index: int) -> dict[str, Any]:
    """The OpenAI request a client would send; ``vllm_xargs.script_index`` makes the engine replay ``script``."""
    return {
        "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": script.question}],
        "tools": TOOLS,
        "tool_choice": "auto",
        "vllm_xargs": {"script_index": index},
    }


# ---------------------------------------------------------------- bench serve datasets

DATASETS = ("random", "scripted", "file")


def output_lengths(count: int, mean: int, range_ratio: float, rng: random.Random) -> list[int]:
    """vLLM's ``--random-output-len``/``--random-range-ratio``: uniform in [mean(1-r), mean(1+r)], at least 1."""
    if not 0 <= range_ratio < 1:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    low, high = max(1, round(mean * (1 - range_ratio))), max(1, round(mean * (1 + range_ratio)))
    return [rng.randint(low, high) for _ in range(count)]


def random_chats(count: int, input_len: int, rng: random.Random) -> list[dict[str, Any]]:
    """Chat requests whose user turn is about ``input_len`` tokens of varied English (10 per sentence,
    roughly; the rendered prompt length is what the results report)."""
    chats = []
    for i in range(count):
        sentences = [_fill(rng.choice(THINKING), rng) for _ in range(max(1, input_len // 12))]
        chats.append({"messages": [{"role": "user", "content": f"Request {i}. " + " ".join(sentences)}]})
    return chats


def scripted_chats(scripts: Sequence[Script]) -> list[dict[str, Any]]:
    """One chat request per script (``vllm_xargs.script_index`` replays it on the scripted engine)."""
    return [chat_request(s, i) for i, s in enumerate(scripts)]


def file_chats(path: str) -> list[tuple[dict[str, Any], int | None]]:
    """A JSONL file of ``{"messages": [...], "max_tokens"?: N, ...}`` chat requests (or
    ``{"prompt": "..."}``, a single user turn): (chat request, its max_tokens if it sets one)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            entry = json.loads(line)
            if "prompt" in entry and "messages" not in entry:
                entry = {"messages": [{"role": "user", "content": entry.pop("prompt")}], **entry}
            if not isinstance(entry.get("messages"), list):
                raise ValueError(f"{path}:{line_no}: a line needs 'messages' (a list) or 'prompt'")  # noqa: TRY004
            max_tokens = entry.pop("max_tokens", None)
            out.append((entry, None if max_tokens is None else int(max_tokens)))
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def write_script_file(path: str, scripts: Sequence[Script]) -> None:
    """The scripted engine's ``--script`` file for ``scripts`` (index i replays script i)."""
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": s.output}, ensure_ascii=False) + "\n" for s in scripts)
