"""Load generation for ``pdserve bench frontend``: the arms and their clients.

The client side is one asyncio loop with one ``httpx.AsyncClient`` (HTTP/1.1
keep-alive). Each arm is the request sequence a real client of that path has
to make; a chunk's token ids count as *arrived* when the client can use them:
on receipt for inline modes, and only when the derender answer for that chunk
is back for the per-chunk baselines. Server processes are in
:mod:`pdserve.bench.servers`, the workload in :mod:`pdserve.bench.workload`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import httpx
import msgspec

from pdserve.bench.servers import BenchError

JSON_HEADERS = {"content-type": "application/json"}

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


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
