"""Server-side timing of one request, returned as ``metrics`` with ``--enable-per-request-metrics``.

vLLM fills its ``PerRequestMetrics`` only on chat/completions; pdserve fills the same fields on
generate (every output mode, batch and stream) and the coupled endpoints, so a client can tell
queueing and network time from generation. The frontend stamps three instants with
``time.monotonic()``: the request's arrival (when its request state is created, after parsing
and validation), the first engine output that carries a token, and the last one; the engine
stamps when the request first ran in a step (``EngineOutput.scheduled_at``, the same monotonic
clock: engine and frontend run on one host).

* ``time_to_first_token_ms``: arrival → first token.
* ``queue_time_ms``: arrival → first scheduled by the engine (null from an engine that does not say).
* ``generation_time_ms``: first token → last token (the decode phase).
* ``mean_itl_ms``: ``generation_time_ms / (tokens − 1)``; null below two tokens.
* ``tokens_per_second``: output tokens / (arrival → last token).
* ``kv_pull_ms``, ``kv_pull_bytes``: a P/D decode leg's KV pull (the READ, and the bytes it brought), as its
  engine reported it; absent on every other request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestTiming:
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    scheduled: float | None = None
    kv_pull: tuple[float, int] | None = None  # a decode leg's KV pull as its engine reported it: seconds, bytes

    def scheduled_at(self, when: float | None) -> None:
        """The engine says when the request first ran (the first such stamp counts)."""
        if when is not None and self.scheduled is None:
            self.scheduled = when

    def tokens(self, count: int, now: float | None = None) -> None:
        """``count`` output tokens arrived from the engine (stamps only when count > 0)."""
        if count <= 0:
            return
        now = time.monotonic() if now is None else now
        if self.first_token is None:
            self.first_token = now
        self.last_token = now

    def ttft_and_tpot_s(self, output_tokens: int) -> tuple[float | None, float | None]:
        """Seconds to the first token, and per output token after it (None below two tokens): what
        ``/metrics`` histograms (vLLM's time_to_first_token / request_time_per_output_token)."""
        if self.first_token is None or self.last_token is None:
            return None, None
        tpot = (self.last_token - self.first_token) / (output_tokens - 1) if output_tokens > 1 else None
        return self.first_token - self.arrival, tpot

    def metrics(self, output_tokens: int) -> dict[str, Any]:
        """The ``metrics`` object (vLLM's field names, milliseconds); nulls where nothing was measured."""
        ttft = gen = itl = rate = None
        ttft_s, tpot_s = self.ttft_and_tpot_s(output_tokens)
        if self.first_token is not None and self.last_token is not None and ttft_s is not None:
            ttft = ttft_s * 1000
            gen = (self.last_token - self.first_token) * 1000
            itl = tpot_s * 1000 if tpot_s is not None else None
            total = self.last_token - self.arrival
            rate = output_tokens / total if total > 0 else None
        queue = None if self.scheduled is None else max(0.0, self.scheduled - self.arrival) * 1000
        metrics: dict[str, Any] = {"time_to_first_token_ms": ttft, "queue_time_ms": queue, "generation_time_ms": gen,
                                   "mean_itl_ms": itl, "tokens_per_second": rate}
        if self.kv_pull is not None:  # a P/D decode leg only: the proxy's per-request record reads them
            metrics["kv_pull_ms"], metrics["kv_pull_bytes"] = self.kv_pull[0] * 1000, self.kv_pull[1]
        return metrics
