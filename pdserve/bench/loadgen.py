"""Load generation for ``pdserve bench frontend``: server processes and their CPU, the workload, the arms.

Benchmarks ship with the package, so this module starts real ``pdserve``
processes itself (no test helpers) and reads their CPU from ``/proc``, which is
the only way to charge a server's work to the arm that caused it on a machine
where client and servers share two cores.

The workload is synthetic but shaped like Qwen3 agent traffic (thinking, then a
markdown answer or a hermes tool call), built to a target token count with the
real tokenizer, so parsers and detokenizer do the work they do in production.

The client side is one asyncio loop with one ``httpx.AsyncClient`` (HTTP/1.1
keep-alive). Each arm is the request sequence a real client of that path has
to make; a chunk's token ids count as *arrived* when the client can use them:
on receipt for inline modes, and only when the derender answer for that chunk
is back for the per-chunk baselines.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import httpx
import msgspec

from pdserve.text.tokenizer import Tokenizer

JSON_HEADERS = {"content-type": "application/json"}
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode
EOS = "<|im_end|>"  # Qwen3's end of turn: every script ends with it, as a real generation does


class BenchError(RuntimeError):
    """The benchmark cannot produce trustworthy numbers (server failure or wrong output)."""


# ---------------------------------------------------------------- processes and CPU


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stat_fields(stat_line: str) -> tuple[int, int]:
    """(ppid, utime+stime+cutime+cstime in clock ticks) from one ``/proc/<pid>/stat`` line.

    The command name may hold spaces or parentheses, so fields are counted from the last ``)``.
    """
    rest = stat_line[stat_line.rindex(")") + 2 :].split()
    # rest[0] is field 3 (state): ppid is field 4, utime..cstime are fields 14..17.
    return int(rest[1]), sum(int(v) for v in rest[11:15])


def process_tree_cpu_seconds(pid: int, proc_root: Path = Path("/proc")) -> float:
    """CPU seconds of ``pid`` and every live descendant (user + system, reaped children included).

    Summing ``cutime``/``cstime`` of each live process counts a finished child exactly once: in
    its parent after it was reaped, and never again since it is no longer listed.
    """
    ticks: dict[int, int] = {}
    children: dict[int, list[int]] = {}
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid, used = stat_fields((entry / "stat").read_text())
        except (OSError, ValueError, IndexError):
            continue  # exited while we looked
        ticks[int(entry.name)] = used
        children.setdefault(ppid, []).append(int(entry.name))
    if pid not in ticks:
        raise BenchError(f"process {pid} is gone; see its log")
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        total += ticks.get(current, 0)
        todo.extend(children.get(current, ()))
    return total / CLOCK_TICKS


class ServerProcess:
    """A ``python -m pdserve.cli ...`` child on a free loopback port, logging to a temp file."""

    def __init__(self, name: str, args: Sequence[str]):
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._cmd = [sys.executable, "-m", "pdserve.cli", *args, "--host", "127.0.0.1", "--port", str(self.port)]
        fd, log = tempfile.mkstemp(prefix=f"pdserve-bench-{name}-", suffix=".log")
        os.close(fd)
        self._log = Path(log)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise BenchError(f"{self.name} server was not started")
        return self.proc.pid

    def spawn(self) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with self._log.open("wb") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(self._cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise BenchError(f"{self.name} server exited at startup:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise BenchError(f"{self.name} server not healthy after {timeout_s:.0f}s:\n{self.log_tail()}")

    def cpu_seconds(self) -> float:
        try:
            return process_tree_cpu_seconds(self.pid)
        except BenchError:
            raise BenchError(f"{self.name} server died:\n{self.log_tail()}") from None

    def log_tail(self, chars: int = 4000) -> str:
        return self._log.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.unlink(missing_ok=True)


def start_all(servers: Sequence[ServerProcess], timeout_s: float = 120.0) -> None:
    """Spawn every server first, then wait: their imports and tokenizer loads overlap."""
    for server in servers:
        server.spawn()
    for server in servers:
        server.wait_healthy(timeout_s)


# ---------------------------------------------------------------- workload: Qwen3-style outputs

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


# ---------------------------------------------------------------- arms


class Arm(Enum):
    """One way for a client to get streamed output; the value is the column label."""

    TOKENS = "tokens (reference)"
    TEXT = "inline text"
    TOKENS_COMPLETIONS_DERENDER = "tokens + /v1/completions/derender per chunk"
    DERENDER = "inline derender"
    TOKENS_CHAT_DERENDER = "tokens + /v1/chat/completions/derender per chunk"

    @property
    def output_kind(self) -> str:
        """What the arm's client ends up with: ``ids``, ``text`` or an OpenAI ``message``."""
        if self is Arm.TOKENS:
            return "ids"
        if self in (Arm.TEXT, Arm.TOKENS_COMPLETIONS_DERENDER):
            return "text"
        return "message"


@dataclass(frozen=True)
class Job:
    """One scripted request, rendered once up front (render is common to every arm)."""

    script_index: int
    rendered: dict[str, Any]  # /v1/chat/completions/render output, usable as a GenerateRequest
    chat_request: dict[str, Any]  # the OpenAI request the baseline echoes to derender on every chunk

    @property
    def prompt_token_ids(self) -> list[int]:
        return list(self.rendered["token_ids"])


@dataclass
class RequestRecord:
    """Timings and assembled output of one request; times are ``time.perf_counter()`` seconds."""

    arm: Arm
    script_index: int
    start: float
    end: float = 0.0
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, token ids made usable)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    deltas: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def output_tokens(self) -> int:
        return sum(n for _, n in self.arrivals)


def generate_body(arm: Arm, job: Job) -> dict[str, Any]:
    """The streamed generate request each arm sends (the per-chunk baselines stream ``tokens``)."""
    rendered = {k: v for k, v in job.rendered.items() if k not in ("model", "parse_context", "request_id")}
    body: dict[str, Any] = {**rendered, "stream": True}
    if arm is Arm.DERENDER:
        return {**body, "output_mode": "derender", "parse_context": job.rendered["parse_context"]}
    if arm in (Arm.TEXT, Arm.TOKENS_COMPLETIONS_DERENDER):
        # Completions-shaped clients keep the default skip_special_tokens, as /v1/completions/derender does.
        params = {k: v for k, v in body["sampling_params"].items() if k != "skip_special_tokens"}
        body["sampling_params"] = params
        return {**body, "output_mode": "text" if arm is Arm.TEXT else "tokens"}
    return {**body, "output_mode": "tokens"}


def _echoed_fields(arm: Arm, job: Job) -> bytes:
    """The JSON members a baseline re-sends with every chunk, encoded once per request (they never change).

    The chat path needs the full request and prompt for its parsers; the completions path the prompt
    only, to prime its detokenizer.
    """
    fields: dict[str, Any] = {"prompt_token_ids": job.prompt_token_ids}
    if arm is Arm.TOKENS_CHAT_DERENDER:
        fields["chat_request"] = job.chat_request
    return _encode(fields)[1:-1]


class ArmClient:
    """Runs one request of any arm against a generate server and (for baselines) a derender server."""

    def __init__(self, client: httpx.AsyncClient, generate_url: str, derender_url: str):
        self._client = client
        self._generate = generate_url + "/inference/v1/generate"
        self._derender = {
            Arm.TOKENS_COMPLETIONS_DERENDER: derender_url + "/v1/completions/derender",
            Arm.TOKENS_CHAT_DERENDER: derender_url + "/v1/chat/completions/derender",
        }

    async def run(self, arm: Arm, job: Job) -> RequestRecord:
        record = RequestRecord(arm=arm, script_index=job.script_index, start=time.perf_counter())
        derender = self._derender.get(arm)
        echoed = _echoed_fields(arm, job)
        state: bytes = b"null"
        async with self._client.stream(
            "POST", self._generate, content=_encode(generate_body(arm, job)), headers=JSON_HEADERS
        ) as response:
            if response.status_code != 200:
                raise BenchError(f"{arm.value}: generate answered {response.status_code}: {(await response.aread())!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    break
                chunk = _decode(payload)
                if "error" in chunk:
                    raise BenchError(f"{arm.value}: generate stream error {chunk['error']}")
                if not chunk["choices"]:
                    continue
                choice = chunk["choices"][0]
                ids = choice.get("token_ids") or []
                record.token_ids += ids
                if derender is None:
                    self._take_inline(arm, record, choice, len(ids))
                    continue
                body = b'{"stream":true,"generate_chunk":%b,"stream_state":%b,%b}' % (payload.encode(), state, echoed)
                result = await self._post(derender, body)
                state = _encode(result["stream_state"])
                self._take_derendered(arm, record, result["chunk"]["choices"], len(ids))
        record.end = time.perf_counter()
        return record

    @staticmethod
    def _take_inline(arm: Arm, record: RequestRecord, choice: dict[str, Any], n_ids: int) -> None:
        if n_ids:
            record.arrivals.append((time.perf_counter(), n_ids))
        record.finish_reason = choice.get("finish_reason") or record.finish_reason
        if arm is Arm.TEXT:
            record.text += choice.get("text") or ""
        elif arm is Arm.DERENDER and choice.get("delta") is not None:
            record.deltas.append(choice["delta"])

    @staticmethod
    def _take_derendered(arm: Arm, record: RequestRecord, choices: list[dict[str, Any]], n_ids: int) -> None:
        if n_ids:
            record.arrivals.append((time.perf_counter(), n_ids))
        for choice in choices:
            record.finish_reason = choice.get("finish_reason") or record.finish_reason
            if arm is Arm.TOKENS_COMPLETIONS_DERENDER:
                record.text += choice.get("text") or ""
            elif choice.get("delta") is not None:
                record.deltas.append(choice["delta"])

    async def _post(self, url: str, body: bytes) -> dict[str, Any]:
        response = await self._client.post(url, content=body, headers=JSON_HEADERS)
        if response.status_code != 200:
            raise BenchError(f"{url} answered {response.status_code}: {response.text[:2000]}")
        result: dict[str, Any] = _decode(response.content)
        return result


def assemble_message(deltas: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Fold chat deltas into one message (content, reasoning, tool calls by index); ids must stay put."""
    content, reasoning = "", None
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        content += delta.get("content") or ""
        if delta.get("reasoning") is not None:
            reasoning = (reasoning or "") + delta["reasoning"]
        for call in delta.get("tool_calls") or []:
            slot = calls.setdefault(call["index"], {"id": None, "name": "", "arguments": ""})
            if call.get("id"):
                if slot["id"] not in (None, call["id"]):
                    raise BenchError(f"tool call {call['index']} changed its id mid-stream")
                slot["id"] = call["id"]
            function = call.get("function") or {}
            slot["name"] += function.get("name") or ""
            slot["arguments"] += function.get("arguments") or ""
    for index, slot in calls.items():
        if not slot["id"]:
            raise BenchError(f"tool call {index} never got an id")
    tool_calls = [(slot["name"], slot["arguments"]) for _, slot in sorted(calls.items())]
    return {"content": content, "reasoning": reasoning, "tool_calls": tool_calls}


def rendered_jobs(render_url: str, chat_requests: Sequence[dict[str, Any]]) -> list[Job]:
    """Render every chat request once on the render server (blocking; before any timing starts)."""
    jobs = []
    with httpx.Client(timeout=60.0) as client:
        for index, chat in enumerate(chat_requests):
            response = client.post(render_url + "/v1/chat/completions/render", json=chat)
            if response.status_code != 200:
                raise BenchError(f"render answered {response.status_code}: {response.text[:2000]}")
            jobs.append(Job(script_index=index, rendered=response.json(), chat_request=chat))
    return jobs
