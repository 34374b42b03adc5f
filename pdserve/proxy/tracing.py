"""The proxy's traces (``--otlp-traces-endpoint``): a ``CLIENT`` span per leg, and the ``traceparent`` it sends.

The client request's ``SERVER`` span comes from the tracing middleware (:mod:`pdserve.web.tracing`): the child
of the client's ``traceparent`` when it sent one, else the root of a new trace. Every leg the proxy sends —
render, prefill, decode, each ``/derender`` call in ``--mode derender-tier``, a retried prefill or decode leg,
a migrated decode stream — is a span of its own under it, and carries a ``traceparent`` naming that span, so
the member's server span (and its queue, prefill, KV pull, decode spans) sits under the leg that called it.
A decode stream's span stays open while the stream is relayed: it ends with the stream, when it breaks (and
migrates: the next member's leg is a new span), or when the client leaves (cancelled).

Imported only when the flag is set (it loads the SDK through :mod:`pdserve.web.tracing`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from opentelemetry.trace import Span, SpanKind

from pdserve.proxy.upstream import UpstreamError
from pdserve.web.trace_context import TRACE_ATTRIBUTES_KEY
from pdserve.web.tracing import Tracing, current, end, kept

# A client request through the flow (pdserve.proxy.flow.Prepared, which imports this module's class for its
# annotations): its record, its rendered and client bodies, and its open decode stream's span.
Prepared = Any


class ProxyTracing:
    """The proxy's tracer and its leg spans."""

    def __init__(self, tracing: Tracing) -> None:
        self.tracing = tracing

    def describe(self) -> str:
        return self.tracing.describe()

    def shutdown(self) -> None:
        self.tracing.shutdown()

    def start_leg(self, leg: str, headers: Mapping[str, str], **attributes: Any) -> tuple[Span, dict[str, str]]:
        """A leg's span (the client request's child) and the leg's headers with its ``traceparent``."""
        request = current()
        span = self.tracing.child(request.span if request is not None else None, leg, kind=SpanKind.CLIENT,
                                  attributes={"pdserve.leg": leg, **attributes})
        return span, {**headers, "traceparent": self.tracing.traceparent(span)}

    @staticmethod
    def leg_answered(span: Span, member: str) -> None:
        """The leg's member answered it (a stream: it opened)."""
        span.set_attribute("pdserve.member", member)

    @staticmethod
    def leg_done(span: Span, member: str, **attributes: Any) -> None:
        span.set_attributes(kept({"pdserve.member": member, **attributes}))
        end(span)

    @staticmethod
    def leg_failed(span: Span, error: BaseException) -> None:
        """The leg ended without an answer: a member's failure or refusal (the status the client would get),
        or the client left while it ran (cancelled)."""
        if isinstance(error, UpstreamError):
            span.set_attributes(kept({"pdserve.member": error.failed_member, "http.response.status_code": error.status,
                                      "pdserve.failure": error.cause}))
            end(span, error=str(error))
        elif isinstance(error, asyncio.CancelledError | GeneratorExit):
            end(span, cancelled=True)
        else:
            end(span, error=f"{type(error).__name__}: {error}")

    def stream_broke(self, p: Prepared, cause: str, error: UpstreamError) -> None:
        """The decode stream broke mid-way (it may migrate: the next leg is a span of its own)."""
        span = p.decode_span
        if span is not None:
            span.set_attribute("pdserve.broken", cause)
            end(span, error=f"{cause}: {error}")
            p.decode_span = None

    def stream_ended(self, p: Prepared, completed: bool) -> None:
        """The relay of the decode stream ended: ``completed`` to its end (its last event sent), or not (the
        client left, the proxy cut it)."""
        span = p.decode_span
        if span is not None:
            if span.is_recording() and p.record.tokens is not None:
                span.set_attribute("gen_ai.usage.completion_tokens", p.record.tokens)
            end(span, cancelled=not completed)
            p.decode_span = None

    def stream_closed(self, p: Prepared, status: int) -> None:
        """The client's stream closed with ``status`` (499: the client left before ``[DONE]``): a decode span
        the relay never reached ends cancelled, and the request's span gets the status its HTTP 200 hides."""
        self.stream_ended(p, completed=False)
        request = current()
        if request is not None:
            request.outcome(status)

    @staticmethod
    def watch(scope: dict[str, Any], p: Prepared) -> None:
        """The request span's attributes from the record, read once the answer has been sent."""
        scope.setdefault("state", {})[TRACE_ATTRIBUTES_KEY] = lambda: request_attributes(p)


def request_attributes(p: Prepared) -> dict[str, Any]:
    """The client request's span: its prompt and output tokens, retries and migrations."""
    record = p.record
    return {"gen_ai.usage.prompt_tokens": len(p.rendered.get("token_ids") or ()),
            "gen_ai.usage.completion_tokens": record.tokens, "pdserve.stream": bool(p.body.get("stream")),
            "pdserve.retries": len(record.retries), "pdserve.migrations": len(record.migrations)}
