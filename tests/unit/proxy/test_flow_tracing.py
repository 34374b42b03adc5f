"""The proxy's leg spans over mocked servers (tests/unit/proxy/test_flow.py's): every leg it sends, retried
and migrated ones included, carries a ``traceparent`` naming a span of its own under the client request's span,
which says which member it went to and how it ended. Four real processes: tests/e2e/test_tracing.py."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import httpx
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from pdserve.proxy.flow import Orchestrator
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.pool import Pool
from pdserve.proxy.tracing import ProxyTracing
from pdserve.web.trace_context import parse_traceparent
from pdserve.web.tracing import CANCELLED, RequestSpan, Tracing, current_request, end
from tests.unit.proxy.test_flow import CHAT, IN_ORDER, RESUMABLE, Upstreams, chunk, sse


def traced_run(upstreams: Upstreams, prefill_hosts: tuple[str, ...], decode_hosts: tuple[str, ...],
               close_after: int | None = None) -> tuple[list[ReadableSpan], ReadableSpan]:
    """One streamed chat through the flow with tracing on, under a client request span as the middleware
    makes it; ``close_after``: the client leaves after that many events. The finished spans, and the root."""
    exporter = InMemorySpanExporter()
    tracing = Tracing("http://collector:4318", "pdserve-proxy", processor=SimpleSpanProcessor(exporter))

    async def go() -> None:
        metrics = ProxyMetrics()
        client = httpx.AsyncClient(transport=httpx.MockTransport(upstreams))
        pools = [Pool(name, [f"http://{h}" for h in hosts], rng=random.Random(IN_ORDER))
                 for name, hosts in (("render", ("render",)), ("prefill", prefill_hosts), ("decode", decode_hosts))]
        for pool in pools:
            for member in pool.members:
                pool.mark_up(member)
        orch = Orchestrator(client, *pools, "inline", metrics, tracing=ProxyTracing(tracing))
        request = RequestSpan(tracing, tracing.server_span("POST /v1/chat/completions", None))
        token = current_request.set(request)
        try:
            prepared = await orch.prepare("chat", CHAT, "rid")
            stream = await orch.open_stream(prepared)
            events = orch.events(prepared, stream)
            seen = 0
            async for _ in events:
                seen += 1
                if seen == close_after:
                    break
            await events.aclose()
            await stream.aclose()
            orch.tracing.stream_closed(prepared, 200 if close_after is None else 499)  # type: ignore[union-attr]
        finally:
            current_request.reset(token)
            await client.aclose()
        end(request.span, cancelled=request.cancelled)

    asyncio.run(go())
    spans = list(exporter.get_finished_spans())
    (root,) = [s for s in spans if s.kind == SpanKind.SERVER]
    return spans, root


def _sent_under(upstreams: Upstreams, spans: list[ReadableSpan]) -> list[tuple[str, str, dict[str, Any]]]:
    """Each request a mocked member received: its host, and the name and attributes of the span its
    ``traceparent`` names."""
    by_id = {s.context.span_id: s for s in spans}
    out = []
    for host, headers, _ in upstreams.seen:
        parent = parse_traceparent(headers.get("traceparent"))
        assert parent is not None, (host, headers)
        span = by_id[int(parent.span_id, 16)]
        out.append((host, span.name, dict(span.attributes or {})))
    return out


def test_retried_and_migrated_legs_each_carry_a_span_of_their_own() -> None:
    first = sse(chunk(delta={"role": "assistant", "content": "a"}, token_ids=[7]), done=False)
    rest = sse(chunk(delta={"content": "d"}, token_ids=[10], finish_reason="length"))
    upstreams = Upstreams(b"", streams={"d0": first, "d1": rest}, rendered=RESUMABLE, dropping={"prefill0"})
    spans, root = traced_run(upstreams, ("prefill0", "prefill1"), ("d0", "d1"))
    legs = [s for s in spans if s is not root]
    assert all(s.kind == SpanKind.CLIENT and s.parent.span_id == root.context.span_id for s in legs)
    assert all(s.context.trace_id == root.context.trace_id for s in legs)
    sent = _sent_under(upstreams, spans)
    assert [(host, name) for host, name, _ in sent] == [
        ("render", "render"), ("prefill0", "prefill"), ("prefill1", "prefill"), ("d0", "decode"), ("d1", "decode")]
    assert len(legs) == 5  # one span per leg sent
    by_host = {host: attributes for host, _, attributes in sent}
    assert by_host["prefill0"]["pdserve.member"] == "http://prefill0" and by_host["prefill0"]["pdserve.failure"] == "dropped"
    assert by_host["prefill1"]["pdserve.retry_of"] == "http://prefill0"
    assert by_host["d0"]["pdserve.broken"] == "truncated"
    assert by_host["d1"]["pdserve.migrated_from"] == "http://d0" and by_host["d1"]["pdserve.migration_cause"] == "truncated"
    assert by_host["d1"]["gen_ai.usage.completion_tokens"] == 2
    status = {s.attributes["pdserve.member"]: s.status.status_code for s in legs}
    assert status == {"http://render": StatusCode.UNSET, "http://prefill0": StatusCode.ERROR,
                      "http://prefill1": StatusCode.UNSET, "http://d0": StatusCode.ERROR, "http://d1": StatusCode.UNSET}
    assert root.status.status_code == StatusCode.UNSET


def test_a_client_that_leaves_mid_stream_ends_the_decode_legs_span_cancelled() -> None:
    stream = sse(*[chunk(delta={"content": "a"}, token_ids=[7]) for _ in range(5)],
                 chunk(delta={"content": "b"}, token_ids=[8], finish_reason="length"))
    spans, root = traced_run(Upstreams(stream, rendered=RESUMABLE), ("prefill",), ("decode",), close_after=2)
    decode = next(s for s in spans if s.name == "decode")
    assert decode.attributes[CANCELLED] is True and decode.status.status_code == StatusCode.ERROR
    assert root.attributes[CANCELLED] is True
    assert all(s.status.status_code == StatusCode.UNSET for s in spans if s.name in ("render", "prefill"))
