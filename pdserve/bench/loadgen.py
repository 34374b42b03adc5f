"""The client side of ``pdserve bench serve``: what each arm sends, and when its tokens arrive.

An :class:`Arm` is one way of getting output from one server: the generate endpoint at an output
mode (streamed or batch), the coupled ``/v1/chat/completions`` or ``/v1/completions``, or the tier
baseline (stream ``tokens`` and POST each chunk to a stateless ``/derender`` with the
``stream_state`` it returned). Everything here is plain vLLM wire format, so any compatible server
can be on the other side.

A chunk's tokens count as arrived when the client can use them: on receipt for one-hop paths, and
only once that chunk's derender answer is back for the tier baseline. Tokens are counted from
``token_ids``, else from the growth of continuous ``usage``, else one per chunk with content.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec

from pdserve.bench.metrics import RequestResult

JSON_HEADERS = {"content-type": "application/json"}
ENDPOINTS = ("generate", "chat", "completions", "tier")
MODES = ("tokens", "text", "derender")
GENERATE_PATH = "/inference/v1/generate"
DERENDER_PATHS = {"chat": "/v1/chat/completions/derender", "completions": "/v1/completions/derender"}

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


@dataclass(frozen=True)
class Prompt:
    """One workload item: the chat request, its render (a GenerateRequest body) and the output length."""

    chat: dict[str, Any]  # OpenAI chat request without max_tokens/stream
    rendered: dict[str, Any]  # /v1/chat/completions/render output
    max_tokens: int | None = None
    ignore_eos: bool = False

    @property
    def prompt_len(self) -> int:
        return len(self.rendered["token_ids"])


@dataclass(frozen=True)
class Arm:
    """One measured path; ``modes`` are cycled per request (a mixed-traffic arm has several)."""

    label: str
    base_url: str
    endpoint: str = "generate"
    modes: tuple[str, ...] = ("tokens",)
    stream: bool = True
    derender: str = "chat"  # tier: which stateless derender endpoint the chunks go to
    derender_url: str | None = None  # tier: that server (default: base_url)
    sampling: dict[str, Any] = field(default_factory=dict)  # extra sampling params (e.g. logprobs)
    # Servers behind base_url (a proxy's render/prefill/decode members): their CPU is charged to this arm too.
    backends: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint {self.endpoint!r}: choose from {', '.join(ENDPOINTS)}")
        if not self.modes or any(m not in MODES for m in self.modes):
            raise ValueError(f"output modes {self.modes!r}: choose from {', '.join(MODES)}")
        if self.derender not in DERENDER_PATHS:
            raise ValueError(f"derender {self.derender!r}: choose from {', '.join(DERENDER_PATHS)}")
        if self.endpoint == "tier" and not self.stream:
            raise ValueError("the tier baseline streams (one /derender call per chunk)")

    @property
    def urls(self) -> tuple[str, ...]:
        """Every server this arm's requests reach: the base URL, the derender tier, the backends."""
        tier = (self.derender_url,) if self.endpoint == "tier" and self.derender_url else ()
        return tuple(dict.fromkeys((self.base_url, *tier, *self.backends)))

    def mode_of(self, index: int) -> str:
        return self.modes[index % len(self.modes)]


def _sampling(arm: Arm, prompt: Prompt, rendered: dict[str, Any] | None) -> dict[str, Any]:
    params = dict(rendered["sampling_params"]) if rendered is not None else {}
    if prompt.max_tokens is not None:
        params["max_tokens"] = prompt.max_tokens
    if prompt.ignore_eos:
        params["ignore_eos"] = True
    params.update(arm.sampling)
    return params


def generate_body(arm: Arm, prompt: Prompt, mode: str) -> dict[str, Any]:
    """The generate request: the render output, the arm's output mode and knobs."""
    drop = ("model", "parse_context", "request_id", "stream", "stream_options", "output_mode", "chat_request")
    body = {k: v for k, v in prompt.rendered.items() if k not in drop and v is not None}
    params = _sampling(arm, prompt, prompt.rendered)
    if mode == "text":
        # A completions-shaped client keeps the default skip_special_tokens, as /v1/completions does.
        params.pop("skip_special_tokens", None)
    body["sampling_params"] = params
    body["output_mode"] = mode
    if mode == "derender" and prompt.rendered.get("parse_context") is not None:
        body["parse_context"] = prompt.rendered["parse_context"]
    if arm.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def openai_body(arm: Arm, prompt: Prompt) -> dict[str, Any]:
    """The coupled request: the chat request as is, or the rendered ids as a completions prompt."""
    if arm.endpoint == "chat":
        body: dict[str, Any] = dict(prompt.chat)
    else:
        body = {"prompt": list(prompt.rendered["token_ids"])}
    if prompt.max_tokens is not None:
        body["max_tokens"] = prompt.max_tokens
    if prompt.ignore_eos:
        body["ignore_eos"] = True
    body.update(arm.sampling)
    if arm.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return body


class StreamTokenTally:
    """Output tokens a chunk makes usable: its ``token_ids``, else the growth of continuous usage,
    else one per chunk with visible content (what a client that gets neither can do)."""

    def __init__(self) -> None:
        self._usage = 0

    def count(self, chunk: dict[str, Any]) -> int:
        choices = chunk.get("choices") or []
        ids = [c.get("token_ids") for c in choices]
        usage = (chunk.get("usage") or {}).get("completion_tokens")
        if not choices:  # the final usage-only chunk releases nothing new
            return 0
        if any(i is not None for i in ids):
            n = sum(len(i or ()) for i in ids)
        elif usage is not None:
            n = max(0, usage - self._usage)
        else:
            n = sum(1 for c in choices if _has_content(c))
        if usage is not None:
            self._usage = max(self._usage, usage)
        return n


def _has_content(choice: dict[str, Any]) -> bool:
    if choice.get("text"):
        return True
    delta = choice.get("delta") or {}
    return bool(delta.get("content") or delta.get("reasoning") or delta.get("reasoning_content")
                or delta.get("tool_calls"))


async def _sse(response: httpx.Response) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """``(raw payload, decoded chunk)`` per SSE data event, up to ``[DONE]``; an error event raises."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        chunk = _decode(payload)
        if "error" in chunk:
            raise RuntimeError(f"stream error: {chunk['error']}")
        yield payload, chunk


class ArmClient:
    """Runs one request of an arm over a shared ``httpx.AsyncClient``; failures become results."""

    def __init__(self, client: httpx.AsyncClient):
        self._client = client

    async def run(self, arm: Arm, prompt: Prompt, index: int) -> RequestResult:
        mode = arm.mode_of(index)
        result = RequestResult(start=time.perf_counter(), prompt_len=prompt.prompt_len, mode=mode)
        try:
            if arm.endpoint in ("generate", "tier"):
                url, body = arm.base_url + GENERATE_PATH, generate_body(arm, prompt, "tokens" if arm.endpoint == "tier"
                                                                        else mode)
            else:
                url = arm.base_url + ("/v1/chat/completions" if arm.endpoint == "chat" else "/v1/completions")
                body = openai_body(arm, prompt)
            if arm.stream:
                await self._stream(arm, prompt, url, body, result)
            else:
                await self._batch(url, body, result)
            result.success = True
        except (httpx.HTTPError, RuntimeError, ValueError, KeyError, msgspec.DecodeError) as e:
            result.error = f"{type(e).__name__}: {e}"[:500]
        result.end = time.perf_counter()
        return result

    async def _batch(self, url: str, body: dict[str, Any], result: RequestResult) -> None:
        response = await self._client.post(url, content=_encode(body), headers=JSON_HEADERS)
        if response.status_code != 200:
            raise RuntimeError(f"{url} answered {response.status_code}: {response.text[:300]}")
        data = _decode(response.content)
        now = time.perf_counter()
        counted = StreamTokenTally().count(data)
        result.usage_output_tokens = (data.get("usage") or {}).get("completion_tokens")
        result.arrivals.append((now, result.usage_output_tokens if result.usage_output_tokens is not None else counted))
        result.server_metrics = data.get("metrics")

    async def _stream(self, arm: Arm, prompt: Prompt, url: str, body: dict[str, Any], result: RequestResult) -> None:
        counter = StreamTokenTally()
        derender = (arm.derender_url or arm.base_url) + DERENDER_PATHS[arm.derender] if arm.endpoint == "tier" else None
        echoed = _echoed_fields(arm, prompt) if derender else b""
        state = b"null"
        async with self._client.stream("POST", url, content=_encode(body), headers=JSON_HEADERS) as response:
            if response.status_code != 200:
                raise RuntimeError(f"{url} answered {response.status_code}: {(await response.aread())[:300]!r}")
            async for payload, chunk in _sse(response):
                if chunk.get("metrics"):
                    result.server_metrics = chunk["metrics"]
                usage = (chunk.get("usage") or {}).get("completion_tokens")
                if usage is not None and not chunk.get("choices"):
                    result.usage_output_tokens = usage  # the final usage-only chunk
                n = counter.count(chunk)
                if derender is not None and chunk.get("choices"):
                    state = await self._derender(derender, payload, state, echoed)
                if n:
                    result.arrivals.append((time.perf_counter(), n))

    async def _derender(self, url: str, payload: str, state: bytes, echoed: bytes) -> bytes:
        """POST one chunk to the stateless derender endpoint; the ``stream_state`` to send next."""
        body = b'{"stream":true,"generate_chunk":%b,"stream_state":%b,%b}' % (payload.encode(), state, echoed)
        response = await self._client.post(url, content=body, headers=JSON_HEADERS)
        if response.status_code != 200:
            raise RuntimeError(f"{url} answered {response.status_code}: {response.text[:300]}")
        return _encode(_decode(response.content)["stream_state"])


def _echoed_fields(arm: Arm, prompt: Prompt) -> bytes:
    """What the tier client re-sends with every chunk, encoded once: the prompt ids (to prime the
    detokenizer) and, for chat, the original request (for its parsers)."""
    fields: dict[str, Any] = {"prompt_token_ids": list(prompt.rendered["token_ids"])}
    if arm.derender == "chat":
        fields["chat_request"] = prompt.chat
    return _encode(fields)[1:-1]
