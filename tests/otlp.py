"""A tiny OTLP/HTTP trace receiver on loopback, for tests and for drawing one request's trace.

It takes what an OpenTelemetry collector takes on ``POST /v1/traces`` (an ``ExportTraceServiceRequest`` in
protobuf, gzipped or not), decodes it with ``opentelemetry-proto`` and keeps every span with its process's
``service.name``; :func:`tree` draws a trace as the indented tree docs/observability.md shows.

    with Receiver() as receiver:           # receiver.url: pass it as --otlp-traces-endpoint
        ...
        spans = receiver.wait_for_trace(trace_id, lambda spans: len(spans) >= 10)
        print(tree(spans))
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan
from opentelemetry.proto.trace.v1.trace_pb2 import Status

from tests.loopback import LoopbackServer, reply

KINDS = {ProtoSpan.SPAN_KIND_SERVER: "server", ProtoSpan.SPAN_KIND_CLIENT: "client",
         ProtoSpan.SPAN_KIND_INTERNAL: "internal", ProtoSpan.SPAN_KIND_PRODUCER: "producer",
         ProtoSpan.SPAN_KIND_CONSUMER: "consumer"}


def _value(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which == "array_value":
        return [_value(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in value.kvlist_value.values}
    return None if which is None else getattr(value, which)


@dataclass
class Span:
    """One received span, its ids in hex (``parent_id`` empty for a trace's root)."""

    service: str
    resource: dict[str, Any]
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    status: str = "unset"  # unset, ok, error
    status_message: str = ""

    @property
    def ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6

    @property
    def cancelled(self) -> bool:
        return self.attributes.get("pdserve.cancelled") is True and self.status == "error"


def decode(body: bytes) -> list[Span]:
    """The spans of one ``ExportTraceServiceRequest``."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                status = {Status.STATUS_CODE_OK: "ok", Status.STATUS_CODE_ERROR: "error"}.get(s.status.code, "unset")
                spans.append(Span(
                    service=str(resource.get("service.name", "")), resource=resource, trace_id=s.trace_id.hex(),
                    span_id=s.span_id.hex(), parent_id=s.parent_span_id.hex(), name=s.name, kind=KINDS.get(s.kind, "?"),
                    start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                    attributes={kv.key: _value(kv.value) for kv in s.attributes}, status=status,
                    status_message=s.status.message,
                ))
    return spans


class Receiver:
    """``POST /v1/traces`` on a free loopback port, in a thread; every span received so far in :attr:`spans`."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.posts = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                spans = decode(body)
                with receiver._lock:
                    receiver.spans.extend(spans)
                    receiver.posts += 1
                reply(self, 200, ExportTraceServiceResponse().SerializeToString(), "application/x-protobuf")

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
                pass

        self._server = LoopbackServer(Handler)
        self.url = self._server.url

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.close()

    def trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def find(self, predicate: Callable[[Span], bool]) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if predicate(s)]

    def wait_for_trace(self, trace_id: str, done: Callable[[list[Span]], bool], bound_s: float = 30.0) -> list[Span]:
        """The spans of ``trace_id`` once ``done`` says they are all in (batches come every few hundred ms)."""
        deadline = time.monotonic() + bound_s
        while True:
            spans = self.trace(trace_id)
            if done(spans):
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"trace {trace_id} not complete after {bound_s:g} s; got:\n{tree(spans)}")
            time.sleep(0.05)


# Attributes :func:`tree` shows, under short names.
SHOWN = {"gen_ai.request.id": "request", "pdserve.member": "member", "gen_ai.usage.prompt_tokens": "prompt",
         "gen_ai.usage.completion_tokens": "output", "pdserve.cached_tokens": "cached",
         "pdserve.kv_pull.bytes": "kv_bytes", "pdserve.retry_of": "retry_of", "pdserve.migrated_from": "migrated_from",
         "http.response.status_code": "status"}


def tree(spans: list[Span], attributes: bool = True) -> str:
    """A trace drawn as a tree, children in start order: each span's name, its process (``service.name``),
    its duration, its start after the root's, and (``attributes``) the attributes of :data:`SHOWN`. A span
    whose parent is not among ``spans`` is drawn as a root."""
    ids = {s.span_id for s in spans}
    children: dict[str, list[Span]] = {}
    for s in spans:
        children.setdefault(s.parent_id if s.parent_id in ids else "", []).append(s)
    for kids in children.values():
        kids.sort(key=lambda s: (s.start_ns, s.name))
    roots = children.get("", [])
    origin = min((s.start_ns for s in spans), default=0)
    rows: list[tuple[str, Span]] = []

    def walk(span: Span, lead: str, branch: str) -> None:
        rows.append((lead + branch + span.name, span))
        kids = children.get(span.span_id, [])
        below = lead + ("" if not branch else "   " if branch == "└─ " else "│  ")
        for i, kid in enumerate(kids):
            walk(kid, below, "└─ " if i == len(kids) - 1 else "├─ ")

    for root in roots:
        walk(root, "", "")
    width = max((len(label) for label, _ in rows), default=0)
    service_width = max((len(s.service) for s in spans), default=0)
    lines = []
    for label, span in rows:
        line = f"{label:<{width}}  {span.service:<{service_width}}  {span.ms:8.2f} ms  +{(span.start_ns - origin) / 1e6:7.2f}"
        extra = [f"{short}={span.attributes[name]}" for name, short in SHOWN.items() if name in span.attributes
                 and not (name == "http.response.status_code" and span.attributes[name] == 200)] if attributes else []
        if span.cancelled:
            extra.append("CANCELLED")
        elif span.status == "error":
            extra.append(f"ERROR({span.status_message})")
        lines.append((line + ("  " + " ".join(extra) if extra else "")).rstrip())
    return "\n".join(lines)
