"""Client metrics of ``pdserve bench serve``: vLLM ``bench serve``'s names and definitions.

Kept free of HTTP and processes so every definition can be checked on hand-built arrival
timelines. A request's tokens count as *arrived* when the client can use them (token ids, or
``usage`` when a surface sends no ids), never by visible text, which parsers hold back.

* TTFT: from sending the request to the first arrival that carries output tokens.
* TPOT: (last arrival − first arrival) / (output tokens − 1); requests with one token, or whose tokens
  all came in one arrival (batch), have none.
* ITL: the gaps between consecutive token-carrying arrivals, one sample per arrival after the
  first (vLLM's per-chunk definition: a chunk that releases k held-back tokens is one gap).
* E2EL: from sending the request to the end of its response (``[DONE]`` for a stream).
* Goodput: completed requests per second that met every SLO given (ttft, tpot, e2el in ms).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.bench.report import percentile

PERCENTILES = (50, 90, 99)
SLO_METRICS = ("ttft", "tpot", "e2el")
# How server CPU is split (pdserve.bench.cpu): processes listening on the server's port, and the rest.
SERVER_ROLES = ("api", "engine")
# The server-side per-request timing pdserve (and vLLM's chat/completions) return as ``metrics``.
SERVER_METRICS = ("time_to_first_token_ms", "queue_time_ms", "generation_time_ms", "mean_itl_ms",
                  "tokens_per_second")


@dataclass
class RequestResult:
    """One request as the client saw it; times are ``time.perf_counter()`` seconds."""

    start: float
    prompt_len: int = 0
    end: float = 0.0
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, output tokens made usable)
    success: bool = False
    error: str = ""
    mode: str = ""  # the output mode this request asked for (mixed arms)
    server_metrics: dict[str, Any] | None = None  # the response's ``metrics``, when the server sent it
    usage_output_tokens: int | None = None  # ``usage.completion_tokens`` of the response, when sent

    @property
    def output_tokens(self) -> int:
        """Counted arrivals; ``usage`` wins when the server reported it (vLLM's rule)."""
        counted = sum(n for _, n in self.arrivals)
        return self.usage_output_tokens if self.usage_output_tokens is not None else counted

    def _timed(self) -> list[tuple[float, int]]:
        return [(t, n) for t, n in self.arrivals if n > 0]

    @property
    def ttft(self) -> float:
        timed = self._timed()
        return timed[0][0] - self.start if timed else math.nan

    @property
    def tpot(self) -> float:
        """NaN below two tokens (vLLM leaves those out) and when every token came in one arrival (a batch
        response: no per-token timing was observable, where vLLM's formula would say 0)."""
        timed = self._timed()
        tokens = self.output_tokens
        if len(timed) < 2 or tokens < 2:
            return math.nan
        return (timed[-1][0] - timed[0][0]) / (tokens - 1)

    @property
    def itl(self) -> list[float]:
        timed = self._timed()
        return [b[0] - a[0] for a, b in itertools.pairwise(timed)]

    @property
    def e2el(self) -> float:
        return self.end - self.start


def parse_slo(text: str) -> dict[str, float]:
    """``ttft=500,tpot=50`` or vLLM's ``ttft:500 tpot:50`` → {metric: ms}; names are checked."""
    slo: dict[str, float] = {}
    for item in text.replace(",", " ").split():
        name, sep, value = item.replace("=", ":").partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"SLO item {item!r}: expected NAME=MS with NAME one of {', '.join(SLO_METRICS)}")
        try:
            slo[name] = float(value)
        except ValueError:
            raise ValueError(f"SLO item {item!r}: {value!r} is not a number of milliseconds") from None
        if slo[name] <= 0:
            raise ValueError(f"SLO item {item!r}: the bound must be positive")
    return slo


def meets_slo(result: RequestResult, slo: Mapping[str, float]) -> bool:
    """Every bound given holds (a request without a TPOT meets any TPOT bound, as in vLLM)."""
    values = {"ttft": result.ttft, "tpot": result.tpot, "e2el": result.e2el}
    return all((name == "tpot" and math.isnan(values[name])) or values[name] * 1000 <= bound
               for name, bound in slo.items())


def _stats(prefix: str, values_s: Sequence[float]) -> dict[str, float]:
    """mean/median/std/pXX of one metric in ms, vLLM's key names (NaN when nothing was measured)."""
    ms = [v * 1000 for v in values_s if not math.isnan(v)]
    out = {
        f"mean_{prefix}_ms": statistics.fmean(ms) if ms else math.nan,
        f"median_{prefix}_ms": percentile(ms, 50),
        f"std_{prefix}_ms": statistics.pstdev(ms) if ms else math.nan,
    }
    out.update({f"p{q}_{prefix}_ms": percentile(ms, q) for q in PERCENTILES if q != 50})
    return out


def summarize(results: Sequence[RequestResult], duration_s: float, slo: Mapping[str, float] | None = None
              ) -> dict[str, Any]:
    """vLLM ``bench serve``'s result fields over ``results`` run in ``duration_s`` seconds of wall time."""
    done = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    rate = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: math.nan)
    out: dict[str, Any] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": rate(len(done)),
        "output_throughput": rate(output_tokens),
        "total_token_throughput": rate(input_tokens + output_tokens),
    }
    if slo:
        out["request_goodput"] = rate(sum(meets_slo(r, slo) for r in done))
    out.update(_stats("ttft", [r.ttft for r in done]))
    out.update(_stats("tpot", [r.tpot for r in done]))
    out.update(_stats("itl", [gap for r in done for gap in r.itl]))
    out.update(_stats("e2el", [r.e2el for r in done]))
    out.update(server_summary(done))
    return out


def server_summary(results: Sequence[RequestResult]) -> dict[str, Any]:
    """Medians of the server's own per-request ``metrics`` (``median_server_<field>``), and the
    client TTFT minus the server's (``median_ttft_outside_server_ms``: network, HTTP, client)."""
    reported = [r for r in results if r.server_metrics]
    if not reported:
        return {}
    out: dict[str, Any] = {"server_metrics_requests": len(reported)}
    for name in SERVER_METRICS:
        values = [float(v) for r in reported if (v := r.server_metrics.get(name)) is not None]  # type: ignore[union-attr]
        out[f"median_server_{name}"] = percentile(values, 50)
    outside = [r.ttft * 1000 - float(r.server_metrics["time_to_first_token_ms"]) for r in reported  # type: ignore[index]
               if r.server_metrics.get("time_to_first_token_ms") is not None]  # type: ignore[union-attr]
    out["median_ttft_outside_server_ms"] = percentile(outside, 50)
    return out
