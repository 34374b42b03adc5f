"""One P/D request's trace across the four processes (docs/observability.md, "Traces"): a proxy, a render, a
prefill and a decode server on loopback with ``--otlp-traces-endpoint`` pointing at a tiny OTLP/HTTP receiver
(tests/otlp.py, decoding with ``opentelemetry-proto``).

Checked on what the receiver got: one trace holds spans of all four ``service.name``s; every span's parent is in
the trace but the root's; the root is the proxy's server span (or, when the client sent a ``traceparent``, the
child of the client's span); each member's server span is the child of the proxy's span for that leg (the
``traceparent`` the leg carried) and holds the member's phases; and a streaming client that leaves mid-way still
gets every span ended, the open ones marked cancelled.

qwen3-tiny on the torch engine with the KV hand-off on (the decode member pulls the prompt's KV over NIXL).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import pytest

from pdserve.checkpoints.resolve import resolve_model
from pdserve.topology.process import start_all, stop_all
from tests.otlp import Receiver, Span, tree
from tests.serverproc import ServerProcess
from tests.waiting import wait_until

MODEL = "qwen3-tiny"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 6, "ignore_eos": True, "temperature": 0}
SERVICES = {"render": "pdserve-render", "prefill": "pdserve-prefill", "decode": "pdserve-decode",
            "proxy": "pdserve-proxy"}
# Each member's server span and the spans under it (a batch chat: the decode leg derenders its message).
MEMBER_SPANS = {
    "render": ("POST /v1/chat/completions/render", {"render"}),
    "prefill": ("POST /inference/v1/generate", {"queue", "prefill"}),
    "decode": ("POST /inference/v1/generate", {"queue", "kv_pull", "prefill", "decode", "derender"}),
}
CLIENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[Receiver, dict[str, ServerProcess]]]:
    with Receiver() as receiver, pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # the SDK's batch delay, 5 s by default: the test waits less
        traces = ("--otlp-traces-endpoint", receiver.url)
        engine = (MODEL, "--kv-transfer", "nixl", *traces)
        servers = {
            "render": ServerProcess("launch", "render", "--tokenizer", str(resolve_model(MODEL)), *traces),
            "prefill": ServerProcess("serve", *engine, "--tokens-only", "--kv-role", "prefill"),
            "decode": ServerProcess("serve", *engine, "--kv-role", "decode"),
        }
        try:
            start_all(list(servers.values()))
            servers["proxy"] = ServerProcess("proxy", "--render", servers["render"].url, "--prefill",
                                             servers["prefill"].url, "--decode", servers["decode"].url, *traces)
            start_all([servers["proxy"]])
            yield receiver, servers
        finally:
            stop_all(list(servers.values()))


def _root_of(receiver: Receiver, request_id: str) -> Span:
    """The proxy's span of the client request ``request_id``."""
    found = wait_until(lambda: receiver.find(lambda s: s.service == "pdserve-proxy" and s.kind == "server"
                                             and s.attributes.get("gen_ai.request.id") == request_id),
                       f"the proxy's span of {request_id}", bound_s=30)
    assert len(found) == 1, found
    return found[0]


def _complete(spans: list[Span]) -> bool:
    """Every member's server span and its phases are in."""
    names = {(s.service, s.name) for s in spans}
    return all((SERVICES[role], server) in names and {(SERVICES[role], n) for n in phases} <= names
               for role, (server, phases) in MEMBER_SPANS.items())


def _check_tree(spans: list[Span], servers: dict[str, ServerProcess], root: Span, request_id: str) -> None:
    """Four processes, no orphan, every member's server span under the proxy's span of its leg, its phases
    under it, every span started after its parent and, within a process, ended before it (one host's clock; a
    millisecond for the conversion from the monotonic stamps)."""
    by_id = {s.span_id: s for s in spans}
    assert len(by_id) == len(spans), "a span id twice"
    assert {s.service for s in spans} == set(SERVICES.values()), tree(spans)
    assert [s for s in spans if s.parent_id not in by_id] == [root], tree(spans)
    assert root.name == "POST /v1/chat/completions" and root.attributes["http.response.status_code"] == 200
    legs = {s.name: s for s in spans if s.parent_id == root.span_id}
    assert set(legs) == {"render", "prefill", "decode"} and all(leg.kind == "client" for leg in legs.values())
    for role, (server_name, phases) in MEMBER_SPANS.items():
        leg, url = legs[role], servers[role].url
        assert leg.service == "pdserve-proxy" and leg.attributes["pdserve.member"] == url
        (server,) = [s for s in spans if s.parent_id == leg.span_id]  # the traceparent the leg carried
        assert (server.service, server.name, server.kind) == (SERVICES[role], server_name, "server")
        assert server.resource["service.instance.id"] == url and server.attributes["gen_ai.request.id"] == request_id
        assert {s.name for s in spans if s.parent_id == server.span_id} == phases, tree(spans)
    slack = 1_000_000
    for span in spans:
        assert span.end_ns >= span.start_ns and span.status != "error", span
        if span is not root:
            parent = by_id[span.parent_id]
            assert parent.start_ns - slack <= span.start_ns, tree(spans)
            # A member's server span may end after the leg that called it: the proxy has the answer when the
            # member's last byte left, the member ends its span after that. Within one process, spans nest.
            assert span.service != parent.service or span.end_ns <= parent.end_ns + slack, tree(spans)
    decode = {s.name: s for s in spans if s.service == "pdserve-decode"}
    assert decode["POST /inference/v1/generate"].attributes["gen_ai.usage.completion_tokens"] == CHAT["max_tokens"]
    assert decode["kv_pull"].attributes["pdserve.kv_pull.bytes"] > 0
    prefill = {s.name: s for s in spans if s.service == "pdserve-prefill"}
    assert prefill["prefill"].attributes["gen_ai.usage.prompt_tokens"] == root.attributes["gen_ai.usage.prompt_tokens"]


def test_one_pd_request_is_one_trace_across_the_four_processes(fleet) -> None:  # type: ignore[no-untyped-def]
    receiver, servers = fleet
    r = httpx.post(servers["proxy"].url + "/v1/chat/completions", json=CHAT, headers={"x-request-id": "trace-1"},
                   timeout=60)
    assert r.status_code == 200, r.text
    root = _root_of(receiver, "trace-1")
    assert root.parent_id == ""  # no traceparent from the client: the proxy starts the trace
    spans = receiver.wait_for_trace(root.trace_id, _complete)
    _check_tree(spans, servers, root, "trace-1")
    # Every trace starts at the proxy: its probes of the decode member at start (a generate request per output
    # mode) carry an unsampled traceparent, so the member recorded none of them.
    assert receiver.find(lambda s: s.parent_id == "" and s.service != "pdserve-proxy") == []
    for role, server in servers.items():  # each ready banner says where its spans go
        assert f"traces     OTLP/HTTP to {receiver.url}/v1/traces as service {SERVICES[role]}" in server.log(), role


def test_a_clients_traceparent_is_continued_on_every_leg(fleet) -> None:  # type: ignore[no-untyped-def]
    receiver, servers = fleet
    trace = os.urandom(16).hex()
    headers = {"x-request-id": "trace-2", "traceparent": f"00-{trace}-{CLIENT_SPAN}-01"}
    r = httpx.post(servers["proxy"].url + "/v1/chat/completions", json=CHAT, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    root = _root_of(receiver, "trace-2")
    assert (root.trace_id, root.parent_id) == (trace, CLIENT_SPAN)
    spans = receiver.wait_for_trace(trace, _complete)
    _check_tree(spans, servers, root, "trace-2")


def test_a_stream_its_client_drops_still_ends_every_span(fleet) -> None:  # type: ignore[no-untyped-def]
    receiver, servers = fleet
    body = CHAT | {"stream": True, "max_tokens": 2000}
    with httpx.stream("POST", servers["proxy"].url + "/v1/chat/completions", json=body,
                      headers={"x-request-id": "trace-drop"}, timeout=60) as r:
        assert r.status_code == 200
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: {")
            if chunks == 4:
                break  # leaving the block closes the connection mid-stream
    root = _root_of(receiver, "trace-drop")

    def decode_ended(spans: list[Span]) -> bool:
        return any(s.service == "pdserve-decode" and s.name == "decode" for s in spans)

    spans = receiver.wait_for_trace(root.trace_id, decode_ended)
    by_name = {(s.service, s.name): s for s in spans}
    assert root.cancelled and root.attributes["pdserve.stream"] is True, tree(spans)
    assert by_name[("pdserve-proxy", "decode")].cancelled  # the leg the proxy closed when its client left
    member = by_name[("pdserve-decode", "POST /inference/v1/generate")]
    assert member.cancelled and by_name[("pdserve-decode", "decode")].cancelled, tree(spans)
    assert 0 < member.attributes["gen_ai.usage.completion_tokens"] < body["max_tokens"]
    assert not by_name[("pdserve-prefill", "POST /inference/v1/generate")].cancelled  # done before the stream
    ids = {s.span_id for s in spans}
    assert [s for s in spans if s.parent_id not in ids] == [root]
