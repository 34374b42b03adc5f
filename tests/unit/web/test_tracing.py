"""Traces (``--otlp-traces-endpoint``): the W3C traceparent a process reads and the one each leg carries, the
endpoint a flag resolves to, the middleware's server span per request, a member's spans of its engine
requests (queue, KV pull, prefill, decode, derender) and the proxy's leg spans; and without the flag no
tracer, no SDK import."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from pdserve.output.request_state import OutputConfig, RequestState
from pdserve.protocol.engine import EngineOutput
from pdserve.web.trace_context import (
    TRACE_ATTRIBUTES_KEY,
    format_traceparent,
    parse_traceparent,
    traces_url,
    unsampled_traceparent,
)
from pdserve.web.tracing import CANCELLED, RequestSpan, Tracing, current, current_request, end

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


def test_a_traceparent_is_parsed_only_when_well_formed() -> None:
    parsed = parse_traceparent(f"00-{TRACE}-{PARENT}-01")
    assert parsed is not None and (parsed.trace_id, parsed.span_id, parsed.sampled) == (TRACE, PARENT, True)
    assert parse_traceparent(f"00-{TRACE}-{PARENT}-00").sampled is False  # type: ignore[union-attr]
    for bad in (None, "", f"00-{TRACE}-{PARENT}", f"00-{TRACE.upper()}-{PARENT}-01", f"00-{'0' * 32}-{PARENT}-01",
                f"00-{TRACE}-{'0' * 16}-01", f"ff-{TRACE}-{PARENT}-01", f"00-{TRACE}-{PARENT}-01-extra"):
        assert parse_traceparent(bad) is None, bad
    assert format_traceparent(int(TRACE, 16), int(PARENT, 16), 1) == f"00-{TRACE}-{PARENT}-01"
    assert format_traceparent(1, 2, 0) == f"00-{1:032x}-{2:016x}-00"
    probe = parse_traceparent(unsampled_traceparent())  # what the proxy's probes of its members carry
    assert probe is not None and not probe.sampled and probe.trace_id != parse_traceparent(unsampled_traceparent()).trace_id  # type: ignore[union-attr]


def test_the_endpoint_is_a_collector_base_url_or_the_full_traces_url() -> None:
    assert traces_url("http://localhost:4318") == "http://localhost:4318/v1/traces"
    assert traces_url("http://localhost:4318/") == "http://localhost:4318/v1/traces"
    assert traces_url("http://localhost:4318/v1/traces") == "http://localhost:4318/v1/traces"
    assert traces_url("https://otel.example:443/tenant/v1/traces") == "https://otel.example:443/tenant/v1/traces"
    for bad in ("localhost:4318", "grpc://localhost:4317", "http://", ""):
        with pytest.raises(ValueError, match="--otlp-traces-endpoint"):
            traces_url(bad)


def _tracing(service: str = "pdserve-test") -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing = Tracing("http://127.0.0.1:9", service, {"pdserve.role": "test"}, processor=SimpleSpanProcessor(exporter))
    return tracing, exporter


def _by_name(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    spans = exporter.get_finished_spans()
    named = {s.name: s for s in spans}
    assert len(named) == len(spans), [s.name for s in spans]
    return named


def test_a_server_span_continues_the_callers_trace_and_a_leg_names_its_own_span() -> None:
    tracing, exporter = _tracing()
    server = tracing.server_span("POST /x", f"00-{TRACE}-{PARENT}-01", {"gen_ai.request.id": "r-1", "none": None})
    leg = tracing.child(server, "decode", kind=SpanKind.CLIENT)
    header = tracing.traceparent(leg)
    end(leg)
    end(server)
    end(server)  # a second end does nothing
    spans = _by_name(exporter)
    assert f"{spans['POST /x'].context.trace_id:032x}" == TRACE and f"{spans['POST /x'].parent.span_id:016x}" == PARENT
    assert spans["POST /x"].kind == SpanKind.SERVER and dict(spans["POST /x"].attributes) == {"gen_ai.request.id": "r-1"}
    assert spans["decode"].parent.span_id == spans["POST /x"].context.span_id
    assert header == f"00-{TRACE}-{spans['decode'].context.span_id:016x}-01"
    assert spans["POST /x"].resource.attributes["service.name"] == "pdserve-test"

    fresh = tracing.server_span("POST /y", "garbage")
    assert fresh.parent is None and f"{fresh.get_span_context().trace_id:032x}" != TRACE  # type: ignore[attr-defined]


def test_a_caller_that_does_not_sample_gets_no_spans_but_its_flag_passed_on() -> None:
    tracing, exporter = _tracing()
    server = tracing.server_span("POST /x", f"00-{TRACE}-{PARENT}-00")
    leg = tracing.child(server, "decode")
    assert tracing.traceparent(leg).startswith(f"00-{TRACE}-") and tracing.traceparent(leg).endswith("-00")
    end(leg)
    end(server)
    assert exporter.get_finished_spans() == ()


async def _post(app: Any, path: str, headers: list[tuple[bytes, bytes]], method: str = "POST") -> dict[str, Any]:
    scope: dict[str, Any] = {"type": "http", "method": method, "path": path, "headers": headers, "state": {}}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        pass

    await app(scope, receive, send)
    return scope


def test_the_middleware_traces_each_post_and_hands_its_span_to_the_handlers() -> None:
    tracing, exporter = _tracing()
    seen: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(current())
        await receive()
        scope["state"][TRACE_ATTRIBUTES_KEY] = lambda: {"pdserve.retries": 0, "skipped": None}
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    traced = tracing.middleware(app, {"/v1/chat/completions/derender": "derender"})
    asyncio.run(_post(traced, "/v1/chat/completions/derender",
                      [(b"traceparent", f"00-{TRACE}-{PARENT}-01".encode()), (b"x-request-id", b"r-7")]))
    asyncio.run(_post(traced, "/health", [], method="GET"))
    assert seen[0] is not None and seen[1] is None and current() is None  # a GET is not traced
    spans = _by_name(exporter)
    server, phase = spans["POST /v1/chat/completions/derender"], spans["derender"]
    assert server.attributes["gen_ai.request.id"] == "r-7" and server.attributes["http.response.status_code"] == 200
    assert server.attributes["pdserve.retries"] == 0 and "skipped" not in server.attributes
    assert phase.parent.span_id == server.context.span_id and server.start_time <= phase.start_time
    assert phase.end_time <= server.end_time and server.status.status_code == StatusCode.UNSET


def test_a_request_the_client_left_or_that_failed_ends_its_span_with_an_error() -> None:
    tracing, exporter = _tracing()

    async def stream(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        current().outcome(499)  # type: ignore[union-attr]  # the stream's client left: its 200 says nothing

    async def broken(scope: Any, receive: Any, send: Any) -> None:
        raise RuntimeError("bug")

    asyncio.run(_post(tracing.middleware(stream), "/s", []))
    with pytest.raises(RuntimeError):
        asyncio.run(_post(tracing.middleware(broken), "/b", []))
    spans = _by_name(exporter)
    assert spans["POST /s"].attributes[CANCELLED] is True and spans["POST /s"].status.status_code == StatusCode.ERROR
    assert spans["POST /b"].status.status_code == StatusCode.ERROR and spans["POST /b"].attributes[
        "http.response.status_code"] == 500
    assert [e.name for e in spans["POST /b"].events] == ["exception"]


def _state(mode: str = "tokens", streaming: bool = False, prompt: int = 5) -> RequestState:
    return RequestState("generate-tokens-r", 1, OutputConfig(mode, list(range(prompt)), streaming=streaming))  # type: ignore[arg-type]


def _engine_request(state: RequestState) -> Any:
    """What the spans read of an engine request: its id."""
    return SimpleNamespace(request_id=state.request_id)


def _member_spans(prepared: list[tuple[Any, RequestState]], status: str) -> tuple[dict[str, ReadableSpan], Any]:
    """The spans serve.tracing writes for ``prepared`` answered with ``status``, under a server span."""
    from pdserve.serve.tracing import record_engine_requests

    tracing, exporter = _tracing("pdserve-decode")
    request = RequestSpan(tracing, tracing.server_span("POST /inference/v1/generate", None))
    token = current_request.set(request)
    try:
        record_engine_requests(prepared, status)
    finally:
        current_request.reset(token)
    end(request.span, cancelled=request.cancelled, error=request.error)
    return _by_name(exporter), request


def test_a_decode_legs_spans_are_its_queue_kv_pull_first_step_and_decode() -> None:
    state = _state(mode="derender", streaming=True)
    t0 = time.monotonic()
    state.timing.arrival = t0
    state.add(EngineOutput(request_id="r", index=0, new_token_ids=[1], scheduled_at=t0 + 0.010, kv_pull_seconds=0.004,
                           kv_pull_bytes=4096))
    state.timing.first_token = state.timing.last_token = t0 + 0.015
    state.add(EngineOutput(request_id="r", index=0, new_token_ids=[2, 3], finish_reason="length"))
    state.timing.last_token = t0 + 0.025
    spans, request = _member_spans([(_engine_request(state), state)], "200")
    assert set(spans) == {"POST /inference/v1/generate", "queue", "kv_pull", "prefill", "decode", "derender"}
    ms = {name: (s.end_time - s.start_time) / 1e6 for name, s in spans.items()}
    assert ms["queue"] == pytest.approx(10, abs=0.01) and ms["kv_pull"] == pytest.approx(4, abs=0.01)
    assert ms["prefill"] == pytest.approx(5, abs=0.01) and ms["decode"] == pytest.approx(10, abs=0.01)
    assert spans["kv_pull"].end_time == spans["queue"].end_time == spans["prefill"].start_time  # the pull ends when scheduled
    assert spans["kv_pull"].attributes["pdserve.kv_pull.bytes"] == 4096
    assert spans["decode"].attributes["gen_ai.usage.completion_tokens"] == 3
    assert spans["derender"].start_time == spans["decode"].start_time  # a stream derenders as it decodes
    server = spans["POST /inference/v1/generate"]
    assert {k: server.attributes[k] for k in ("gen_ai.usage.prompt_tokens", "gen_ai.usage.completion_tokens",
                                              "pdserve.kv_pull.bytes", "pdserve.output_mode")} == {
        "gen_ai.usage.prompt_tokens": 5, "gen_ai.usage.completion_tokens": 3, "pdserve.kv_pull.bytes": 4096,
        "pdserve.output_mode": "derender"}
    assert all(s.parent.span_id == server.context.span_id for n, s in spans.items() if n != server.name)
    assert not request.cancelled and all(s.status.status_code == StatusCode.UNSET for s in spans.values())


def test_a_prefill_leg_has_no_decode_span_and_an_unfinished_one_ends_what_was_open() -> None:
    state = _state()
    state.add(EngineOutput(request_id="r", index=0, new_token_ids=[1], scheduled_at=time.monotonic(),
                           finish_reason="length"))
    spans, _ = _member_spans([(_engine_request(state), state)], "200")
    assert set(spans) == {"POST /inference/v1/generate", "queue", "prefill"}

    dropped = _state()
    dropped.add(EngineOutput(request_id="r", index=0, new_token_ids=[1], scheduled_at=time.monotonic()))
    spans, request = _member_spans([(_engine_request(dropped), dropped)], "200")  # not finished: the client left
    assert request.cancelled and spans["decode"].attributes[CANCELLED] is True
    assert spans["POST /inference/v1/generate"].status.status_code == StatusCode.ERROR
    assert CANCELLED not in spans["queue"].attributes and CANCELLED not in spans["prefill"].attributes

    waiting = _state()  # left while it waited for the engine
    spans, request = _member_spans([(_engine_request(waiting), waiting)], "499")
    assert set(spans) == {"POST /inference/v1/generate", "queue"} and spans["queue"].attributes[CANCELLED] is True

    failed = _state()  # the engine died mid-decode: an error, not a cancellation
    failed.add(EngineOutput(request_id="r", index=0, new_token_ids=[1], scheduled_at=time.monotonic()))
    spans, request = _member_spans([(_engine_request(failed), failed)], "503")
    assert not request.cancelled and request.error == "status 503"
    assert spans["decode"].status.status_code == StatusCode.ERROR and CANCELLED not in spans["decode"].attributes
    assert spans["decode"].status.description == "status 503"
    assert spans["POST /inference/v1/generate"].status.status_code == StatusCode.ERROR


def test_the_proxy_sends_each_leg_with_a_traceparent_naming_the_legs_span() -> None:
    from pdserve.proxy.tracing import ProxyTracing
    from pdserve.proxy.upstream import UpstreamError, error_body

    tracing, exporter = _tracing("pdserve-proxy")
    proxy = ProxyTracing(tracing)
    request = RequestSpan(tracing, tracing.server_span("POST /v1/chat/completions", None))
    token = current_request.set(request)
    try:
        render, headers = proxy.start_leg("render", {"x-request-id": "r-1"})
        proxy.leg_done(render, "http://render:1")
        prefill, prefill_headers = proxy.start_leg("prefill", {"x-request-id": "r-1"})
        proxy.leg_failed(prefill, UpstreamError(502, error_body("died", 502, "BadGatewayError"),
                                                failed_member="http://p:1", cause="dropped"))
        again, _ = proxy.start_leg("prefill", {"x-request-id": "r-1"}, **{"pdserve.retry_of": "http://p:1"})
        proxy.leg_failed(again, asyncio.CancelledError())
    finally:
        current_request.reset(token)
    end(request.span)
    spans = exporter.get_finished_spans()
    root = next(s for s in spans if s.kind == SpanKind.SERVER)
    legs = [s for s in spans if s.kind == SpanKind.CLIENT]
    assert [s.name for s in legs] == ["render", "prefill", "prefill"]
    assert all(s.parent.span_id == root.context.span_id for s in legs)
    assert headers == {"x-request-id": "r-1", "traceparent": tracing.traceparent(render)}
    assert prefill_headers["traceparent"].split("-")[2] == f"{legs[1].context.span_id:016x}"
    assert legs[0].attributes["pdserve.member"] == "http://render:1" and legs[0].status.status_code == StatusCode.UNSET
    assert legs[1].attributes["pdserve.member"] == "http://p:1" and legs[1].attributes["pdserve.failure"] == "dropped"
    assert legs[1].status.status_code == StatusCode.ERROR and legs[1].attributes["http.response.status_code"] == 502
    assert legs[2].attributes["pdserve.retry_of"] == "http://p:1" and legs[2].attributes[CANCELLED] is True


FLAG_OFF = """
import argparse, sys
from pdserve.cli import build_parser
from pdserve.serve.cli import render_config
from pdserve.serve.app import create_app
from pdserve.serve.tracing import configure_tracing
from pdserve.proxy.server import build_orchestrator, proxy_tracing
from pdserve.topology.cli import proxy_flags, traces_flags

parser = build_parser()
config = render_config(parser.parse_args(["launch", "render"]))
assert config.otlp_traces_endpoint is None and configure_tracing(config, "http://x:1") is None
assert create_app(config, None, None).state.pdserve.tracing is None
args = parser.parse_args(["proxy", "--render", "http://r:1", "--prefill", "http://p:1", "--decode", "http://d:1"])
assert proxy_tracing(args, "http://x:1") is None and build_orchestrator(args).tracing is None
up, _ = parser.parse_known_args(["up"])
assert traces_flags(up) == () and "--otlp-traces-endpoint" not in proxy_flags(up, [])
loaded = sorted(m for m in sys.modules if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter", "pdserve.web.tracing", "pdserve.proxy.tracing")))
print("loaded:", loaded)
assert not loaded
"""


def test_without_the_flag_no_tracer_is_built_and_the_sdk_is_never_imported() -> None:
    """A fresh interpreter: the serve app, the proxy's orchestrator and up's flags without
    --otlp-traces-endpoint, and no module of the SDK or the exporter loaded."""
    result = subprocess.run([sys.executable, "-c", FLAG_OFF], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
