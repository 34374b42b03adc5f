"""W3C trace context and the ``--otlp-traces-endpoint`` flag, with no OpenTelemetry import.

What every process reads whether tracing is on or off: the ``traceparent`` header (its trace id also names a
request in ``--log-format json`` lines, :mod:`pdserve.web.logs`) and the endpoint the flag resolves to. The
spans themselves are :mod:`pdserve.web.tracing`'s, imported only when the flag is set. With the flag unset
nothing here runs on a request: the tracing middleware is not installed and the handlers' one ``if`` finds no
tracing configured.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

# A W3C traceparent: version-traceid-parentid-flags, lowercase hex; neither id all zeros, version ff invalid.
_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
# Where an OTLP/HTTP collector takes traces (the OTLP spec's default path; Jaeger, Tempo, the otel-collector).
TRACES_PATH = "/v1/traces"


@dataclass(frozen=True)
class TraceParent:
    """A well-formed ``traceparent``: the trace, the caller's span in it, and whether the caller samples it."""

    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits: the parent of the span the receiver starts
    flags: int

    @property
    def sampled(self) -> bool:
        return bool(self.flags & 0x01)


def parse_traceparent(header: str | None) -> TraceParent | None:
    """The W3C ``traceparent`` header's parts, or None when there is none or it is malformed (an all-zero id,
    version ``ff``, upper-case hex, a field missing): the receiver then starts a trace of its own."""
    match = _TRACEPARENT.match(header or "")
    if match is None:
        return None
    version, trace, span, flags = match.groups()
    if version == "ff" or trace == "0" * 32 or span == "0" * 16:
        return None
    return TraceParent(trace, span, int(flags, 16))


def format_traceparent(trace_id: int, span_id: int, flags: int) -> str:
    """The ``traceparent`` a leg carries: version 00, its trace, the span that sent it as its parent."""
    return f"00-{trace_id:032x}-{span_id:016x}-{flags & 0xff:02x}"


def unsampled_traceparent() -> str:
    """A ``traceparent`` of a new trace that its receiver does not record (sampled flag off): what the proxy's
    probes of its members carry, so a traced member writes no trace for them (they are health checks)."""
    return format_traceparent(int.from_bytes(os.urandom(16)) | 1, int.from_bytes(os.urandom(8)) | 1, 0)


def traces_url(endpoint: str) -> str:
    """The URL spans are POSTed to, from ``--otlp-traces-endpoint``: a collector's base URL
    (``http://host:4318``) gets the OTLP path ``/v1/traces`` appended; a URL with a path is used as it is
    (``http://host:4318/v1/traces``, or a collector behind a path of its own). Raises ValueError for what is
    not an http(s) URL."""
    parts = urlsplit(endpoint.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--otlp-traces-endpoint must be an http(s):// URL of an OTLP/HTTP collector (e.g. "
                         f"http://localhost:4318), got {endpoint!r}")
    if parts.path in ("", "/"):
        return parts._replace(path=TRACES_PATH).geturl()
    return parts.geturl()


def add_traces_arg(p: argparse.ArgumentParser, what: str) -> None:
    """``--otlp-traces-endpoint URL`` (vLLM's flag), off by default; ``what`` says which spans go there."""
    p.add_argument(
        "--otlp-traces-endpoint", default=None, metavar="URL",
        help=f"vLLM's flag: send OpenTelemetry spans ({what}) over OTLP/HTTP (protobuf) to this collector; a base "
        "URL (http://localhost:4318) gets /v1/traces appended, a URL with a path is used as it is. A request's W3C "
        "traceparent is continued. Off by default (docs/observability.md)",
    )


# The scope["state"] key under which a handler leaves a callable giving attributes for its request's server
# span, read when the answer has been sent (the proxy: what its request record knows by then).
TRACE_ATTRIBUTES_KEY = "pdserve_trace_attributes"
