"""A server's traces (``--otlp-traces-endpoint``): its service name, and the spans of each engine request it
answered, under the request's ``SERVER`` span (:mod:`pdserve.web.tracing`).

An engine request's phases are known from its :class:`~pdserve.output.timing.RequestTiming` (the frontend's
and the engine's stamps, one monotonic clock on one host), so its spans are written when it is answered, with
their start and end converted to wall-clock time; nothing is added to the request path but the one ``if`` of
:func:`pdserve.serve.responses._answered`:

* ``queue``: arrival (the request parsed and admitted) → the engine first ran it. A decode leg waits here for
  its KV pull too: the engine schedules it once the pull is done.
* ``kv_pull``: a P/D decode leg's pull of the prompt's KV (NIXL READ), its duration and bytes as the engine
  measured them; placed to end when the leg was scheduled (its start within the queue is not stamped).
* ``prefill``: scheduled → the first token: the prompt's forward pass (past any cached prefix), or on a decode
  leg whose KV was pulled the copy of that KV and the first step.
* ``decode``: the first → the last token (two tokens or more).
* ``derender``: output mode ``derender`` (a chat answer's message parsed inline): on a batch answer the last
  token → the answer built, on a stream the first token → the stream's end (each step's tokens are parsed as
  they come, so it overlaps ``decode``).

A request that did not finish ends its open phase at that moment: one the client left (499, or a stream closed
as it was sent) marks that span and the server span :data:`~pdserve.web.tracing.CANCELLED`, one that failed (the
error's status: the engine died, a KV pull failed, a shutdown) gives them an ERROR status naming it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pdserve.serve.config import ServerConfig

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from pdserve.output.request_state import RequestState
    from pdserve.serve.inflight import Prepared
    from pdserve.web.tracing import RequestSpan, Tracing

logger = logging.getLogger("pdserve")

# The child span, from the body read to the answer's start, of the render server's requests (any server that
# serves these paths).
PHASE_PATHS = {
    "/v1/chat/completions/render": "render", "/v1/completions/render": "render",
    "/v1/chat/completions/derender": "derender", "/v1/completions/derender": "derender",
}


def role(config: ServerConfig) -> str:
    """``render`` (no engine), ``prefill`` / ``decode`` (its ``--kv-role``), else ``serve``."""
    if config.engine is None:
        return "render"
    kv = config.engine.kv_transfer
    return kv.role if kv is not None and kv.role in ("prefill", "decode") else "serve"


def service_name(config: ServerConfig) -> str:
    return f"pdserve-{role(config)}"


def configure_tracing(config: ServerConfig, url: str) -> Tracing | None:
    """This server's tracer (its process's), or None without ``--otlp-traces-endpoint``: the SDK is imported
    only then."""
    if config.otlp_traces_endpoint is None:
        return None
    from pdserve.web.tracing import Tracing

    who = role(config)
    return Tracing(config.otlp_traces_endpoint, service_name(config),
                   {"service.instance.id": url, "pdserve.member": url, "pdserve.role": who})


def record_engine_requests(prepared: Sequence[Prepared], status: str) -> None:
    """The spans of a client request's engine requests, answered with ``status`` (``"200"``, ``"499"`` when
    the client left, an error's code), under the request's server span; its totals go on that span. Called
    only where this server traces (the SDK is loaded by then)."""
    from pdserve.web.tracing import current

    request = current()
    if request is None:  # not a traced request (the middleware traces POSTs)
        return
    try:
        _record(request, prepared, status)
    except Exception:  # a tracing bug must not fail an answer: say it, once per request
        logger.exception("pdserve: tracing the request's spans failed")


def _record(request: RequestSpan, prepared: Sequence[Prepared], status: str) -> None:
    now = time.monotonic()
    offset_ns = time.time_ns() - time.monotonic_ns()
    # A request that did not finish was cut short: by its client (499, or a stream closed as it was sent), or
    # by a failure (the error's status: the engine died, a KV pull failed, the server shut down).
    error = None if status in ("200", "499") else f"status {status}"
    cancelled = error is None and (status == "499" or any(not rstate.finished for _, rstate in prepared))
    totals = {"gen_ai.usage.prompt_tokens": 0, "gen_ai.usage.completion_tokens": 0, "pdserve.cached_tokens": 0}
    pulled = 0
    for ereq, rstate in prepared:
        _engine_request_spans(request.tracing, request.span, ereq.request_id, rstate, now, offset_ns, error)
        totals["gen_ai.usage.prompt_tokens"] += len(rstate.config.prompt_token_ids)
        totals["gen_ai.usage.completion_tokens"] += rstate.completion_tokens
        totals["pdserve.cached_tokens"] += rstate.num_cached_tokens
        pulled += rstate.timing.kv_pull[1] if rstate.timing.kv_pull is not None else 0
    span = request.span
    if span.is_recording():
        span.set_attributes(totals)
        span.set_attribute("pdserve.output_mode", prepared[0][1].config.mode)
        span.set_attribute("pdserve.engine_request_id", prepared[0][0].request_id)
        if any(rstate.timing.kv_pull is not None for _, rstate in prepared):
            span.set_attribute("pdserve.kv_pull.bytes", pulled)
    if cancelled:
        request.cancelled = True
    elif error is not None:
        request.error = error


def _engine_request_spans(tracing: Tracing, parent: Span, request_id: str, rstate: RequestState, now: float,
                          offset_ns: int, error: str | None) -> None:
    """``error``: the request failed (else an unfinished one was cancelled)."""
    timing = rstate.timing
    arrival, scheduled, first, last = timing.arrival, timing.scheduled, timing.first_token, timing.last_token
    left = not rstate.finished  # its open phase ends now, cut short

    def ns(t: float) -> int:
        return offset_ns + int(t * 1e9)

    def interval(name: str, start: float, end: float, attributes: dict[str, Any], cut: bool = False) -> None:
        tracing.interval(parent, name, ns(start), ns(end), {"pdserve.engine_request_id": request_id, **attributes},
                         cancelled=cut and error is None, error=error if cut else None)

    prompt = len(rstate.config.prompt_token_ids)
    if scheduled is not None:
        interval("queue", arrival, scheduled, {})
    elif first is None and left:
        interval("queue", arrival, now, {}, cut=True)
    if timing.kv_pull is not None:
        seconds, pulled = timing.kv_pull
        until = scheduled if scheduled is not None else first if first is not None else now
        interval("kv_pull", max(arrival, until - seconds), until,
                 {"pdserve.kv_pull.bytes": pulled, "pdserve.kv_pull.ms": seconds * 1000})
    started = scheduled if scheduled is not None else arrival
    prefill = {"gen_ai.usage.prompt_tokens": prompt, "pdserve.cached_tokens": rstate.num_cached_tokens,
               "pdserve.kv_pulled": timing.kv_pull is not None}
    if first is not None:
        interval("prefill", started, first, prefill)
    elif left and scheduled is not None:
        interval("prefill", started, now, prefill, cut=True)
    if first is not None and last is not None:
        tokens = {"gen_ai.usage.completion_tokens": rstate.completion_tokens}
        if left:
            interval("decode", first, now, tokens, cut=True)
        elif last > first:
            interval("decode", first, last, tokens)
    if rstate.config.mode == "derender" and first is not None:
        start = first if rstate.config.streaming or last is None else last
        interval("derender", start, now, {"pdserve.streaming": rstate.config.streaming}, cut=left)
