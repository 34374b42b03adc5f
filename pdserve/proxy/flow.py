"""One client request through the topology: render once, the prefill leg, the decode leg, the answer.

The modes are :mod:`~pdserve.proxy.modes`; in ``derender-tier`` every decode chunk (or the batch
response) goes through the render server's ``/derender`` with the client-carried ``stream_state``
(one per choice). Both end in the same OpenAI output.

Every leg carries the same ``X-Request-Id``. Everything up to the decode stream's first byte runs
before the client gets a status, so render/prefill failures keep their HTTP status. After that a decode
leg that fails moves to another decode member (:mod:`~pdserve.proxy.migration`), and what cannot go on is
an error event followed by ``[DONE]``.

Each request's legs, members, retries and migrations go into its :class:`~pdserve.proxy.record.RequestRecord`
(the ``Server-Timing`` header, the phase histograms, and the ``metrics`` object with
``--enable-per-request-metrics``). The proxy owns its answers' ``metrics``: a member's never reaches the
client as it is, only inside the record.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, get_args

import httpx

from pdserve.output.surfaces import ChatSurface, CompletionsSurface, TokensSurface
from pdserve.protocol.generate import OutputMode
from pdserve.protocol.sse import DONE, sse_event
from pdserve.proxy import relay
from pdserve.proxy.legs import decode_body, prefill_body
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.migration import LegBroken, Resumption
from pdserve.proxy.modes import Mode
from pdserve.proxy.pool import Member, Pool
from pdserve.proxy.record import Leg, RequestRecord
from pdserve.proxy.upstream import OpenStream, UpstreamError, error_body, open_stream, post_json

if TYPE_CHECKING:  # loaded only with --otlp-traces-endpoint (it imports the OpenTelemetry SDK)
    from pdserve.proxy.tracing import ProxyTracing

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
    record: RequestRecord = field(default_factory=RequestRecord)
    decode_span: Any = None  # with --otlp-traces-endpoint: the open decode stream's leg span

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


@dataclass(frozen=True)
class MigrationSettings:
    """``--migration-limit`` (moves per stream; 0: off) and ``--stall-timeout-s`` (the silence between a
    decode stream's chunks after which its member counts as hung)."""

    limit: int = 1
    stall_timeout_s: float = 30.0


class Orchestrator:
    """The pools, the shared HTTP client, the mode and the metrics: what every request needs."""

    def __init__(self, client: httpx.AsyncClient, render: Pool, prefill: Pool, decode: Pool, mode: Mode,
                 metrics: ProxyMetrics, migration: MigrationSettings = MigrationSettings(),
                 per_request_metrics: bool = False, tracing: ProxyTracing | None = None):
        self.client = client
        self.render, self.prefill, self.decode = render, prefill, decode
        self.mode = mode
        self.metrics = metrics
        self.migration = migration
        self.per_request_metrics = per_request_metrics  # --enable-per-request-metrics
        self.tracing = tracing  # --otlp-traces-endpoint (None: off, and nothing of it runs)
        self.in_flight = 0  # client requests being answered (streams until they close)
        self.draining = False  # shutting down: new requests get 503
        self._streams: set[OpenStream] = set()  # decode streams being relayed
        self._cut_reason: str | None = None

    async def cut_streams(self, reason: str) -> None:
        """End every stream still relayed with an error event naming ``reason`` (the proxy is going away
        and its drain time is up); the decode legs close, which aborts them on their members."""
        self._cut_reason = reason
        for stream in list(self._streams):
            stream.cut_by_proxy = True
            await stream.aclose()

    @property
    def pools(self) -> tuple[Pool, Pool, Pool]:
        return self.render, self.prefill, self.decode

    async def _timed(self, leg: str, pool: Pool, path: str, body: Any, headers: dict[str, str],
                     exclude: Collection[str] = (), retry_of: str | None = None) -> tuple[Member, Any, float]:
        """POST to a member of ``pool``: the member, its JSON answer and the seconds it took (with tracing, in a
        span of the leg's own; ``retry_of``: the member that failed the leg before)."""
        tracing, span = self.tracing, None
        if tracing is not None:
            span, headers = tracing.start_leg(leg, headers, **{"pdserve.retry_of": retry_of})
        start = time.perf_counter()
        try:
            member, answer = await post_json(self.client, pool, path, body, headers, exclude)
        except BaseException as e:
            if tracing is not None and span is not None:
                tracing.leg_failed(span, e)
            raise
        finally:
            seconds = time.perf_counter() - start
            self.metrics.leg_seconds.labels(leg).observe(seconds)
        if tracing is not None and span is not None:
            tracing.leg_done(span, member.url)
        return member, answer, seconds

    def _check(self, body: dict[str, Any]) -> None:
        if self.mode == "derender-tier" and body.get("stream") and body.get("stop"):
            raise ClientRequestError(
                "stop strings are not supported by streaming in --mode derender-tier (per-chunk /derender cannot "
                "take back text it sent); drop stop, stream=false, or use --mode inline", "stop",
            )

    async def prepare(self, kind: Kind, body: dict[str, Any], request_id: str) -> Prepared:
        """Render once and run the prefill leg."""
        record = RequestRecord()
        self._check(body)
        headers = {"x-request-id": request_id}
        member, rendered, seconds = await self._timed("render", self.render, RENDER_PATH[kind], body, headers)
        record.render = Leg(member.url, seconds)
        if kind == "completions":
            if len(rendered) != 1:
                raise ClientRequestError(
                    f"pdserve proxy serves one prompt per completions request (got {len(rendered)}); "
                    "send each prompt as its own request", "prompt",
                )
            rendered = rendered[0]
        prefilled = await self._prefill(prefill_body(rendered), headers, record)
        self.metrics.observe_phases(record.prefill_phases())
        return Prepared(kind, body, rendered, headers, prefilled.get("kv_transfer_params"), record)

    async def _prefill(self, body: dict[str, Any], headers: dict[str, str], record: RequestRecord) -> Any:
        """The prefill leg; sent once more, to another member, when its member fails mid-request (died): a
        prefill's output is never shown, so running it twice is safe (the dead member's lease, if it made
        one, expires with it). The record's prefill leg spans both tries."""
        start = time.perf_counter()
        try:
            member, answer, _ = await self._timed("prefill", self.prefill, GENERATE, body, headers)
        except UpstreamError as e:
            if e.failed_member is None:
                raise
            self.metrics.retries.labels("prefill").inc()
            member, answer, _ = await self._timed("prefill", self.prefill, GENERATE, body, headers,
                                                  exclude={e.failed_member}, retry_of=e.failed_member)
            record.retried("prefill", e.cause or "dropped", e.failed_member, member.url)
        record.prefill_answered(member.url, time.perf_counter() - start, answer)
        return answer

    def _model(self, member: Member, p: Prepared) -> str:
        return member.model or self.decode.model or p.body.get("model") or "pdserve"

    # ------------------------------------------------------------ batch

    async def batch(self, p: Prepared) -> dict[str, Any]:
        """The client's batch answer; with ``--enable-per-request-metrics`` its ``metrics`` are the record's."""
        body = decode_body(p.rendered, decode_mode(self.mode, p.kind), p.kv_transfer_params)
        p.record.decode_started()
        member, response, seconds = await self._timed("decode", self.decode, GENERATE, body, p.headers)
        p.record.decode_answered(member.url, seconds, response)
        self.metrics.observe_phases(p.record.decode_phases())
        answer = await self._batch_answer(p, member, response)
        if self.per_request_metrics:
            answer["metrics"] = p.record.metrics()
        return answer

    async def _batch_answer(self, p: Prepared, member: Member, response: dict[str, Any]) -> dict[str, Any]:
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
        _, answer, seconds = await self._timed("derender", self.render, DERENDER_PATH[p.kind],
                                               request | p.derender_request(), p.headers)
        p.record.derendered(seconds)
        return relay.renamed(answer, p.response_id, model)

    # ------------------------------------------------------------ stream

    async def open_stream(self, p: Prepared) -> OpenStream:
        """Start the decode leg's stream (its status is known before the client's response starts). A member
        that dies before the stream's first byte leaves the client with nothing yet, so the leg goes once more
        to another decode member (which prefills the prompt itself: the KV's lease was that leg's), unless
        migration is off."""
        mode = decode_mode(self.mode, p.kind)
        body = decode_body(p.rendered, mode, p.kv_transfer_params)
        p.record.decode_started()
        try:
            return await self._open_decode(p, body)
        except UpstreamError as e:
            if e.failed_member is None or self.migration.limit <= 0:
                raise
            self.metrics.retries.labels("decode").inc()
            stream = await self._open_decode(p, decode_body(p.rendered, mode, None), exclude={e.failed_member},
                                             **{"pdserve.retry_of": e.failed_member})
            p.record.retried("decode", e.cause or "dropped", e.failed_member, stream.member.url)
            return stream

    async def _open_decode(self, p: Prepared, body: dict[str, Any], exclude: Collection[str] = (),
                           **span_attributes: Any) -> OpenStream:
        """Open a decode leg's stream; with tracing, in a leg span that stays open while it is relayed."""
        if self.tracing is None:
            return await open_stream(self.client, self.decode, "POST", GENERATE, body, p.headers, exclude)
        span, headers = self.tracing.start_leg("decode", p.headers, **span_attributes)
        try:
            stream = await open_stream(self.client, self.decode, "POST", GENERATE, body, headers, exclude)
        except BaseException as e:
            self.tracing.leg_failed(span, e)
            raise
        self.tracing.leg_answered(span, stream.member.url)
        p.decode_span = span
        return stream

    async def events(self, p: Prepared, stream: OpenStream) -> AsyncIterator[str]:
        """The client's SSE events from an open decode stream; always ends with ``[DONE]``.

        A decode leg that breaks moves to another decode member when it can (:meth:`_migrate`). Closing
        this iterator (the client left) closes the decode stream, which aborts the request on the decode
        server. With ``--enable-per-request-metrics`` the chunk that finishes the request (its last choice)
        carries the record as ``metrics``, as a server puts its own on that chunk."""
        model = self._model(stream.member, p)
        start = time.perf_counter()
        surface = self._surface(p, model)
        convert = self._converter(p, surface)
        resumption = Resumption(p.rendered, decode_mode(self.mode, p.kind), self.migration.limit)
        self._streams.add(stream)
        completed = False  # the relay reached its end (not cut short by the client leaving)
        try:
            for chunk in surface.opening():
                yield sse_event(chunk)
            while True:
                try:
                    async for chunk in _generate_chunks(stream, self.migration.stall_timeout_s):
                        if "error" in chunk:
                            _raise_if_member_failed(stream, chunk)
                            yield sse_event(chunk)
                            break
                        chunk = resumption.adjusted(chunk)
                        if not chunk.get("choices"):
                            if chunk.get("usage") is not None:
                                yield sse_event(relay.usage_chunk(surface, chunk["usage"]))
                            continue
                        resumption.saw(chunk)
                        finished = p.record.saw(chunk, stream.member.url, p.n)
                        out = await convert(chunk)
                        if out is not None:
                            if finished and self.per_request_metrics:
                                out["metrics"] = p.record.metrics()
                            yield sse_event(out)
                    break
                except LegBroken as broken:
                    self._streams.discard(stream)
                    if self.tracing is not None:
                        self.tracing.stream_broke(p, broken.cause, broken.error)
                    if stream.cut_by_proxy:
                        raise UpstreamError(503, error_body(str(self._cut_reason), 503, "ServiceUnavailableError")) from None
                    stream = await self._migrate(p, stream, resumption, broken)
                    self._streams.add(stream)
            completed = True
        except UpstreamError as e:
            completed = True
            yield sse_event(e.body)
        finally:
            self._streams.discard(stream)
            await stream.aclose()
            self.metrics.leg_seconds.labels("decode").observe(time.perf_counter() - start)
            self.metrics.observe_phases(p.record.decode_phases())
            if self.tracing is not None:
                self.tracing.stream_ended(p, completed)
        yield DONE

    async def _migrate(self, p: Prepared, broken_stream: OpenStream, resumption: Resumption,
                       broken: LegBroken) -> OpenStream:
        """The stream continued on another decode member, or the :class:`UpstreamError` the client gets."""
        await broken_stream.aclose()
        refusal = resumption.refusal()
        if refusal is not None:
            self.metrics.migrations.labels(broken.cause, "not_moved").inc()
            raise _explained(broken.error, f"not moved to another decode member: {refusal}")
        body = resumption.body(decode_body(p.rendered, decode_mode(self.mode, p.kind), None))
        try:
            stream = await self._open_decode(p, body, exclude={broken_stream.member.url},
                                             **{"pdserve.migrated_from": broken_stream.member.url,
                                                "pdserve.migration_cause": broken.cause})
        except UpstreamError as e:
            self.metrics.migrations.labels(broken.cause, "failed").inc()
            raise _explained(broken.error, f"moving it to another decode member failed: {e}") from None
        self.metrics.migrations.labels(broken.cause, "moved").inc()
        p.record.migrated(broken.cause, broken_stream.member.url, stream.member.url)
        return stream

    def _converter(self, p: Prepared, surface: relay.Surface) -> Callable[[dict[str, Any]], Any]:
        """chunk -> the client's chunk (or None): inline relays, derender-tier asks ``/derender`` first."""
        states: dict[int, Any] = {}

        async def inline(chunk: dict[str, Any]) -> dict[str, Any] | None:
            return relay.chunk(surface, chunk)

        async def derendered(chunk: dict[str, Any]) -> dict[str, Any] | None:
            index = chunk["choices"][0]["index"]
            request = {"stream": True, "generate_chunk": chunk, "stream_state": states.get(index),
                       "prompt_token_ids": p.prompt_token_ids, "prompt_tokens": len(p.prompt_token_ids)}
            _, answer, seconds = await self._timed("derender", self.render, DERENDER_PATH[p.kind],
                                                   request | p.derender_request(), p.headers)
            p.record.derendered(seconds)
            states[index] = answer["stream_state"]
            out = answer["chunk"]
            if isinstance(surface, ChatSurface):
                return relay.chunk(surface, out)
            return relay.derendered_completion(surface, chunk, out)

        return inline if self.mode == "inline" else derendered


async def _generate_chunks(stream: OpenStream, stall_timeout_s: float) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of a generate stream up to ``[DONE]``. A stream that breaks off, goes silent for
    ``stall_timeout_s`` once it started, ends without ``[DONE]`` or sends what is not JSON raises
    :class:`LegBroken` (a member that dropped or stalled leaves rotation until its health check passes)."""
    pool, member = stream.pool, stream.member
    lines = stream.response.aiter_lines()
    started = False
    try:
        while True:
            try:
                line = await (asyncio.wait_for(anext(lines), stall_timeout_s) if started else anext(lines))
            except StopAsyncIteration:
                break
            except TimeoutError:
                pool.mark_down(member, "stalled mid-stream")
                pool.failed(member, "stalled")
                message = f"{pool.name} server {member.url} sent nothing for {stall_timeout_s:g} s mid-stream"
                raise LegBroken("stalled", UpstreamError(504, error_body(message, 504, "GatewayTimeoutError"))) from None
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            if payload == "[DONE]":
                return
            started = True
            try:
                event = json.loads(payload)
            except ValueError:
                pool.failed(member, "garbage")
                message = f"{pool.name} server {member.url} sent an event that is not JSON: {payload[:200]!r}"
                raise LegBroken("garbage", UpstreamError(502, error_body(message, 502, "BadGatewayError"))) from None
            yield event
    except (httpx.HTTPError, httpx.StreamError) as e:
        if stream.cut_by_proxy:
            raise LegBroken("cut", UpstreamError.failed(pool, member, e)) from None
        pool.mark_down(member, f"dropped a stream ({type(e).__name__})")
        pool.failed(member, "dropped")
        raise LegBroken("dropped", UpstreamError.failed(pool, member, e)) from None
    pool.failed(member, "truncated")
    message = f"{pool.name} server {member.url} ended the stream without [DONE]"
    raise LegBroken("truncated", UpstreamError(502, error_body(message, 502, "BadGatewayError")))


def _raise_if_member_failed(stream: OpenStream, chunk: dict[str, Any]) -> None:
    """An error event with a 5xx code: the member failed the request (it is draining, its engine or a KV
    pull failed), so another member may serve it; a 4xx is about the request and goes to the client."""
    code = chunk["error"].get("code") if isinstance(chunk["error"], dict) else None
    if isinstance(code, int) and code >= 500:
        stream.pool.failed(stream.member, "error_event")
        raise LegBroken("error_event", UpstreamError(code, chunk))


def _explained(error: UpstreamError, why: str) -> UpstreamError:
    """``error`` with ``why`` added to its message."""
    body = dict(error.body)
    if isinstance(body.get("error"), dict):
        body["error"] = {**body["error"], "message": f"{body['error'].get('message')} ({why})"}
    return UpstreamError(error.status, body, error.headers)
