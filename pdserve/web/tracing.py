"""OpenTelemetry traces over OTLP/HTTP (``--otlp-traces-endpoint``), for the server and the proxy alike.

Imported only when the flag is set: this module loads the OpenTelemetry SDK and its OTLP/HTTP exporter, and
a process without the flag never imports it (:mod:`pdserve.web.trace_context` is all it reads).

* :class:`Tracing`: one process's tracer provider, named by ``service.name`` (``pdserve-proxy``,
  ``pdserve-render``, ``pdserve-prefill``, ``pdserve-decode``, ``pdserve-serve``), whose spans a
  ``BatchSpanProcessor`` hands to an ``OTLPSpanExporter`` (HTTP, protobuf) on its own thread: a request
  only queues its ended spans. :meth:`Tracing.shutdown` flushes what is queued when the process stops.
* :class:`TracingMiddleware`: one ``SERVER`` span per POST request (the work: not health checks, metrics
  scrapes or model lists), the child of the caller's W3C ``traceparent`` when the request has a well-formed
  one, else the root of a new trace; the handlers below reach it as :func:`current` and add their spans
  under it.

The SDK's own settings still apply where pdserve sets nothing (``OTEL_BSP_SCHEDULE_DELAY``,
``OTEL_EXPORTER_OTLP_TRACES_HEADERS``, ``OTEL_EXPORTER_OTLP_TRACES_COMPRESSION``, ``OTEL_RESOURCE_ATTRIBUTES``).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from contextvars import ContextVar
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from pdserve.web.trace_context import TRACE_ATTRIBUTES_KEY, format_traceparent, parse_traceparent, traces_url

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# What a span says of a request the client left before its answer ended (its status is ERROR too).
CANCELLED = "pdserve.cancelled"
CANCELLED_WHY = "cancelled: the client went away before the answer ended"


def kept(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    """``attributes`` without the unset ones (OpenTelemetry refuses None values, with a warning each)."""
    return {k: v for k, v in (attributes or {}).items() if v is not None}


class Tracing:
    """This process's tracer: spans go in batches to the OTLP/HTTP collector at ``endpoint``."""

    def __init__(self, endpoint: str, service_name: str, resource: Mapping[str, Any] | None = None,
                 processor: SpanProcessor | None = None) -> None:
        """``resource``: attributes of every span of the process (its URL, its role); ``processor``: where
        ended spans go instead of the batches to ``endpoint`` (tests keep them in memory)."""
        self.url = traces_url(endpoint)
        self.service_name = service_name
        self.provider = TracerProvider(resource=Resource.create({**kept(resource), "service.name": service_name}))
        self.provider.add_span_processor(processor or BatchSpanProcessor(OTLPSpanExporter(endpoint=self.url)))
        self.tracer = self.provider.get_tracer("pdserve")

    def describe(self) -> str:
        """The ready banner's line."""
        return f"OTLP/HTTP to {self.url} as service {self.service_name}"

    def server_span(self, name: str, traceparent: str | None, attributes: Mapping[str, Any] | None = None) -> Span:
        """A request's ``SERVER`` span: the child of the caller's span where ``traceparent`` is well formed
        (a caller that does not sample leaves it unrecorded, and says so on every leg), else a new trace."""
        parent = parse_traceparent(traceparent)
        context = Context()
        if parent is not None:
            remote = SpanContext(int(parent.trace_id, 16), int(parent.span_id, 16), is_remote=True,
                                 trace_flags=TraceFlags(parent.flags))
            context = trace.set_span_in_context(NonRecordingSpan(remote), context)
        return self.tracer.start_span(name, context, SpanKind.SERVER, kept(attributes))

    def child(self, parent: Span | None, name: str, *, kind: SpanKind = SpanKind.INTERNAL, start_ns: int | None = None,
              attributes: Mapping[str, Any] | None = None) -> Span:
        """A span under ``parent`` (a new trace's root where there is none), started now or at ``start_ns``."""
        context = Context() if parent is None else trace.set_span_in_context(parent, Context())
        return self.tracer.start_span(name, context, kind, kept(attributes), start_time=start_ns)

    def interval(self, parent: Span, name: str, start_ns: int, end_ns: int,
                 attributes: Mapping[str, Any] | None = None, *, cancelled: bool = False, error: str | None = None
                 ) -> None:
        """A span of what already happened, from ``start_ns`` to ``end_ns`` (epoch nanoseconds); ``cancelled``,
        ``error``: it was cut short (:func:`end`)."""
        span = self.child(parent, name, start_ns=start_ns, attributes=attributes)
        end(span, cancelled=cancelled, error=error, end_ns=max(start_ns, end_ns))

    @staticmethod
    def traceparent(span: Span) -> str:
        """The ``traceparent`` header of a request sent from within ``span`` (its parent there)."""
        context = span.get_span_context()
        return format_traceparent(context.trace_id, context.span_id, context.trace_flags)

    def middleware(self, app: ASGIApp, phases: Mapping[str, str] | None = None) -> TracingMiddleware:
        return TracingMiddleware(app, self, phases or {})

    def shutdown(self) -> None:
        """Export what is queued and stop the exporter's thread (the process is stopping)."""
        self.provider.shutdown()


def end(span: Span, *, error: str | None = None, cancelled: bool = False, end_ns: int | None = None) -> None:
    """End ``span`` once (a second call does nothing): ``cancelled`` (the client left) or ``error`` make its
    status ERROR with the reason, and a cancelled span says so in :data:`CANCELLED` too."""
    if not span.is_recording():  # ended already, or a trace the caller does not sample
        return
    if cancelled:
        span.set_attribute(CANCELLED, True)
        span.set_status(Status(StatusCode.ERROR, CANCELLED_WHY))
    elif error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=end_ns)


class RequestSpan:
    """One request's ``SERVER`` span, as the middleware hands it to the handlers: they add spans under it
    and say how the request ended where the HTTP status cannot (a stream is a 200 from its first byte)."""

    __slots__ = ("tracing", "span", "cancelled", "error")

    def __init__(self, tracing: Tracing, span: Span) -> None:
        self.tracing = tracing
        self.span = span
        self.cancelled = False
        self.error: str | None = None

    def outcome(self, status: int) -> None:
        """How the request ended: 499 (the client left) cancels the span, a 5xx fails it."""
        if status == 499:
            self.cancelled = True
        elif status >= 500:
            self.error = f"status {status}"


# The server span of the request being handled, set by the middleware for the handlers below it (a task a
# handler starts inherits it).
current_request: ContextVar[RequestSpan | None] = ContextVar("pdserve_request_span", default=None)


def current() -> RequestSpan | None:
    """The request's server span, where the middleware traces the request; else None."""
    return current_request.get()


class TracingMiddleware:
    """ASGI: a ``SERVER`` span per POST request, current for the handlers (:func:`current`),
    ended once the app returned (a stream: when it closed). ``phases`` maps a path to the name of a child span
    from the request's body read to its answer's start (the render server's ``render`` and ``derender``)."""

    def __init__(self, app: ASGIApp, tracing: Tracing, phases: Mapping[str, str]) -> None:
        self.app = app
        self.tracing = tracing
        self.phases = phases

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        traceparent = request_id = None
        for name, value in scope.get("headers", ()):
            if name == b"traceparent":
                traceparent = value.decode("latin-1")
            elif name == b"x-request-id":
                request_id = value.decode("latin-1")
        path = scope.get("path", "")
        span = self.tracing.server_span(f"POST {path}", traceparent, {
            "http.request.method": "POST", "url.path": path, "gen_ai.request.id": request_id})
        request = RequestSpan(self.tracing, span)
        phase = self.phases.get(path)
        status = 500  # the app raised before it answered
        body_read: list[int] = []

        async def receiving() -> Message:
            message = await receive()
            if not body_read and message["type"] == "http.request" and not message.get("more_body"):
                body_read.append(time.time_ns())
            return message

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if phase is not None and body_read:
                    self.tracing.interval(span, phase, body_read[0], time.time_ns(), {"http.response.status_code": status})
            await send(message)

        token = current_request.set(request)
        try:
            await self.app(scope, receiving if phase is not None else receive, sending)
        except BaseException as e:  # recorded, then raised on
            if isinstance(e, Exception):
                span.record_exception(e)
            raise
        finally:
            current_request.reset(token)
            self._finish(request, status, scope.get("state") or {})

    @staticmethod
    def _finish(request: RequestSpan, status: int, state: Mapping[str, Any]) -> None:
        span = request.span
        if span.is_recording():
            span.set_attribute("http.response.status_code", status)
            if state.get("request_id") is not None:
                span.set_attribute("gen_ai.request.id", state["request_id"])
            more = state.get(TRACE_ATTRIBUTES_KEY)
            if callable(more):
                span.set_attributes(kept(more()))
        request.outcome(status)
        end(span, cancelled=request.cancelled, error=request.error or (f"status {status}" if status >= 500 else None))
