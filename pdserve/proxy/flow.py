"""One client request through the topology: render once, the prefill leg, the decode leg, the answer.

The modes are :mod:`~pdserve.proxy.modes`; in ``derender-tier`` every decode chunk (or the batch
response) goes through the render server's ``/derender`` with the client-carried ``stream_state``
(one per choice). Both end in the same OpenAI output.

Every leg carries the same ``X-Request-Id``. Everything up to the decode stream's first byte runs
before the client gets a status, so render/prefill failures keep their HTTP status; after that an
upstream failure is an error event followed by ``[DONE]``.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

import httpx

from pdserve.output.surfaces import ChatSurface, CompletionsSurface, TokensSurface
from pdserve.protocol.generate import OutputMode
from pdserve.protocol.sse import DONE, sse_event
from pdserve.proxy import relay
from pdserve.proxy.legs import decode_body, prefill_body
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.modes import Mode
from pdserve.proxy.pool import Member, Pool
from pdserve.proxy.upstream import OpenStream, UpstreamError, error_body, open_stream, post_json

Kind = Literal["chat", "completions"]

GENERATE = "/inference/v1/generate"
RENDER_PATH = {"chat": "/v1/chat/completions/render", "completions": "/v1/completions/render"}
DERENDER_PATH = {"chat": "/v1/chat/completions/derender", "completions": "/v1/completions/derender"}


def decode_mode(mode: Mode, kind: Kind) -> OutputMode:
    """The decode leg's output mode: ids for ``/derender``, else what the client's surface shows."""
    if mode == "derender-tier":
        return TokensSurface.output_mode
    return (ChatSurface if kind == "chat" else CompletionsSurface).output_mode


def decode_modes(mode: Mode) -> tuple[OutputMode, ...]:
    """Every output mode the proxy's decode legs use in ``mode`` (what a decode member must serve)."""
    return tuple(dict.fromkeys(decode_mode(mode, kind) for kind in get_args(Kind)))


class ClientRequestError(UpstreamError):
    """The client's request cannot go through this proxy as sent (400 naming the field)."""

    def __init__(self, message: str, param: str):
        super().__init__(400, error_body(message, 400, "BadRequestError", param))


@dataclass
class Prepared:
    """A request after render and prefill: everything the decode leg and the relay need."""

    kind: Kind
    body: dict[str, Any]  # the client's OpenAI request
    rendered: dict[str, Any]
    headers: dict[str, str]
    kv_transfer_params: dict[str, Any] | None

    @property
    def response_id(self) -> str:
        return str(self.rendered["request_id"])

    @property
    def prompt_token_ids(self) -> list[int]:
        return list(self.rendered["token_ids"])

    @property
    def return_token_ids(self) -> bool:
        return bool(self.body.get("return_token_ids"))

    @property
    def include_usage(self) -> bool:
        return bool((self.body.get("stream_options") or {}).get("include_usage"))

    @property
    def n(self) -> int:
        return int(self.rendered["sampling_params"].get("n", 1))

    @property
    def completion_logprobs(self) -> int | None:
        return self.body.get("logprobs") if self.kind == "completions" else None

    def derender_request(self) -> dict[str, Any]:
        """The client's request as ``/derender`` reads it (``chat_request`` / ``completion_request``)."""
        key = "chat_request" if self.kind == "chat" else "completion_request"
        return {key: self.body}


class Orchestrator:
    """The pools, the shared HTTP client, the mode and the metrics: what every request needs."""

    def __init__(self, client: httpx.AsyncClient, render: Pool, prefill: Pool, decode: Pool, mode: Mode,
                 metrics: ProxyMetrics):
        self.client = client
        self.render, self.prefill, self.decode = render, prefill, decode
        self.mode = mode
        self.metrics = metrics

    @property
    def pools(self) -> tuple[Pool, Pool, Pool]:
        return self.render, self.prefill, self.decode

    async def _timed(self, leg: str, pool: Pool, path: str, body: Any, headers: dict[str, str]) -> tuple[Member, Any]:
        start = time.perf_counter()
        try:
            return await post_json(self.client, pool, path, body, headers)
        finally:
            self.metrics.leg_seconds.labels(leg).observe(time.perf_counter() - start)

    def _check(self, body: dict[str, Any]) -> None:
        if self.mode == "derender-tier" and body.get("stream") and body.get("stop"):
            raise ClientRequestError(
                "stop strings are not supported by streaming in --mode derender-tier (per-chunk /derender cannot "
                "take back text it sent); drop stop, stream=false, or use --mode inline", "stop",
            )

    async def prepare(self, kind: Kind, body: dict[str, Any], request_id: str) -> Prepared:
        """Render once and run the prefill leg."""
        self._check(body)
        headers = {"x-request-id": request_id}
        _, rendered = await self._timed("render", self.render, RENDER_PATH[kind], body, headers)
        if kind == "completions":
            if len(rendered) != 1:
                raise ClientRequestError(
                    f"pdserve proxy serves one prompt per completions request (got {len(rendered)}); "
                    "send each prompt as its own request", "prompt",
                )
            rendered = rendered[0]
        _, prefilled = await self._timed("prefill", self.prefill, GENERATE, prefill_body(rendered), headers)
        return Prepared(kind, body, rendered, headers, prefilled.get("kv_transfer_params"))

    def _model(self, member: Member, p: Prepared) -> str:
        return member.model or self.decode.model or p.body.get("model") or "pdserve"

    # ------------------------------------------------------------ batch

    async def batch(self, p: Prepared) -> dict[str, Any]:
        body = decode_body(p.rendered, decode_mode(self.mode, p.kind), p.kv_transfer_params)
        member, response = await self._timed("decode", self.decode, GENERATE, body, p.headers)
        model = self._model(member, p)
        if self.mode == "derender-tier":
            return await self._derender_batch(p, response, model)
        surface = self._surface(p, model)
        if isinstance(surface, ChatSurface):
            return relay.chat_response(surface, response, p.prompt_token_ids)
        return relay.completion_response(surface, response, p.prompt_token_ids)

    def _surface(self, p: Prepared, model: str) -> relay.Surface:
        """The client's response surface, the coupled endpoint's."""
        if p.kind == "chat":
            return relay.chat_surface(p.response_id, model, p.n, p.return_token_ids)
        return relay.completions_surface(p.response_id, model, p.return_token_ids, p.completion_logprobs)

    async def _derender_batch(self, p: Prepared, response: dict[str, Any], model: str) -> dict[str, Any]:
        prompt, n_prompt = p.prompt_token_ids, len(p.prompt_token_ids)
        if p.kind == "chat":
            request = {"generate_response": response, "prompt_token_ids": prompt, "prompt_tokens": n_prompt}
        else:
            request = {"generate_responses": [response], "prompt_token_ids": [prompt], "prompt_tokens": [n_prompt]}
        _, answer = await self._timed("derender", self.render, DERENDER_PATH[p.kind],
                                      request | p.derender_request(), p.headers)
        return relay.renamed(answer, p.response_id, model)

    # ------------------------------------------------------------ stream

    async def open_stream(self, p: Prepared) -> OpenStream:
        """Start the decode leg's stream (its status is known before the client's response starts)."""
        body = decode_body(p.rendered, decode_mode(self.mode, p.kind), p.kv_transfer_params)
        return await open_stream(self.client, self.decode, "POST", GENERATE, body, p.headers)

    async def events(self, p: Prepared, stream: OpenStream) -> AsyncIterator[str]:
        """The client's SSE events from an open decode stream; always ends with ``[DONE]``.

        Closing this iterator (the client left) closes the decode stream, which aborts the request
        on the decode server."""
        model = self._model(stream.member, p)
        start = time.perf_counter()
        surface = self._surface(p, model)
        convert = self._converter(p, surface)
        try:
            for chunk in surface.opening():
                yield sse_event(chunk)
            async for chunk in _generate_chunks(stream):
                if "error" in chunk:
                    yield sse_event(chunk)
                    break
                if not chunk.get("choices"):
                    if chunk.get("usage") is not None:
                        yield sse_event(relay.usage_chunk(surface, chunk["usage"]))
                    continue
                out = await convert(chunk)
                if out is not None:
                    yield sse_event(out)
        except UpstreamError as e:
            yield sse_event(e.body)
        finally:
            await stream.aclose()
            self.metrics.leg_seconds.labels("decode").observe(time.perf_counter() - start)
        yield DONE

    def _converter(self, p: Prepared, surface: relay.Surface) -> Callable[[dict[str, Any]], Any]:
        """chunk -> the client's chunk (or None): inline relays, derender-tier asks ``/derender`` first."""
        states: dict[int, Any] = {}

        async def inline(chunk: dict[str, Any]) -> dict[str, Any] | None:
            return relay.chunk(surface, chunk)

        async def derendered(chunk: dict[str, Any]) -> dict[str, Any] | None:
            index = chunk["choices"][0]["index"]
            request = {"stream": True, "generate_chunk": chunk, "stream_state": states.get(index),
                       "prompt_token_ids": p.prompt_token_ids, "prompt_tokens": len(p.prompt_token_ids)}
            _, answer = await self._timed("derender", self.render, DERENDER_PATH[p.kind],
                                          request | p.derender_request(), p.headers)
            states[index] = answer["stream_state"]
            out = answer["chunk"]
            if isinstance(surface, ChatSurface):
                return relay.chunk(surface, out)
            return relay.derendered_completion(surface, chunk, out)

        return inline if self.mode == "inline" else derendered


async def _generate_chunks(stream: OpenStream) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of a generate stream up to ``[DONE]``; a stream that breaks off is an
    :class:`UpstreamError` (and takes the member out of rotation until its health check passes)."""
    pool, member = stream.pool, stream.member
    try:
        async for line in stream.response.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            if payload == "[DONE]":
                return
            yield json.loads(payload)
    except httpx.HTTPError as e:
        pool.mark_down(member, f"dropped a stream ({type(e).__name__})")
        pool.failed(member, "dropped")
        raise UpstreamError.failed(pool, member, e) from None
    message = f"{pool.name} server {member.url} ended the stream without [DONE]"
    raise UpstreamError(502, error_body(message, 502, "BadGatewayError"))
