"""Does a decode member serve the output modes the proxy's ``--mode`` sends it?

Why: generate servers differ. vLLM 0.32 serves ``tokens`` and ``text`` and refuses ``derender`` (400); a
generate server older than 0.32 takes ``output_mode`` as an unknown field and answers ``tokens``; a
``--tokens-only`` pdserve refuses every mode but ``tokens``. In ``--mode inline`` every chat decode leg is
``derender`` and every completions leg ``text``, so a member that cannot serve them would fail (or,
worse, answer in another shape) on every request. The proxy asks each decode member once, when it joins
the pool, with a one-token batch request per mode; a member that refuses stays out of rotation with a
reason naming the fix, and at start the proxy stops with that reason (:func:`pdserve.proxy.server.serve_proxy`),
never falling back to another mode silently.

:func:`mode_refusal` reads one answer; ``pdserve bench serve``'s preflight reads its probes with it too.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import httpx

from pdserve.protocol.generate import OutputMode, decodes_text, parses_message
from pdserve.web.trace_context import unsampled_traceparent

GENERATE_PATH = "/inference/v1/generate"
# One token id every vocabulary has; the probe asks for one new token, so it costs one engine step.
PROBE_TOKEN_IDS = [0]


def mode_refusal(url: str, mode: str, status: int, content: bytes) -> str | None:
    """Why the server at ``url`` does not serve ``mode`` (None when it does), from its answer to a batch
    generate request in that mode: a 200 whose body echoes the mode. A body without ``output_mode`` is a
    ``tokens`` answer (docs/protocol.md), so a server that ignores the field is told apart."""
    text = content.decode(errors="replace")[:300]
    if status != 200:
        return f"{url} answered {status} to output_mode={mode!r}: {text}"
    try:
        echoed = json.loads(content).get("output_mode", "tokens")
    except (ValueError, AttributeError):
        return f"{url} answered output_mode={mode!r} with a body that is not a JSON object: {text}"
    if echoed != mode:
        return f"{url} ignores output_mode={mode!r}: it answered a {echoed!r} response"
    return None


def probe_body(mode: OutputMode) -> dict[str, object]:
    """A one-token batch request in ``mode`` (a parsed mode with an empty parse context: a server with
    parsers needs one, and the probe has no chat to carry)."""
    body: dict[str, object] = {"token_ids": PROBE_TOKEN_IDS, "sampling_params": {"max_tokens": 1},
                               "output_mode": mode, "stream": False}
    if parses_message(mode):
        body["parse_context"] = {}
    return body


async def member_refusal(client: httpx.AsyncClient, url: str, modes: Sequence[OutputMode], timeout_s: float
                         ) -> str | None:
    """Why the decode member at ``url`` cannot take the proxy's decode legs (None when it serves every one
    of ``modes``; ids only, every generate server's default, is not asked). A member that cannot
    be reached raises ``httpx.HTTPError``: that is its health check's to report, not a refusal."""
    for mode in modes:
        if not decodes_text(mode):
            continue
        # An unsampled traceparent: a member with --otlp-traces-endpoint records no trace of a probe.
        response = await client.post(url + GENERATE_PATH, json=probe_body(mode), timeout=timeout_s,
                                     headers={"traceparent": unsampled_traceparent()})
        refusal = mode_refusal(url + GENERATE_PATH, mode, response.status_code, response.content)
        if refusal is not None:
            return refusal
    return None
