"""One client request's legs as the proxy saw them: the record behind the ``Server-Timing`` header, the
``pdserve_proxy_leg_phase_seconds`` histograms and, with ``--enable-per-request-metrics``, the ``metrics``
object of a batch answer or of a stream's finishing chunk.

Why per request: a leg histogram says that decode is slow somewhere; one slow answer's record says which
leg, on which member, and whether it waited in a queue, computed, or moved to another member.

Two sources, each named for what it is:

* the proxy's own clock: every leg's wall time as the proxy sees it (sent → answered; a decode stream:
  sent → its finishing chunk), and on a stream the first and last chunk that carried tokens;
* the ``metrics`` object a member returns when it runs with ``--enable-per-request-metrics``
  (:mod:`pdserve.output.timing`), kept verbatim as ``reported`` and read for what the proxy cannot see: a
  prefill's queue and compute, a batch decode's time to first token and per-token time, and the decode
  member's KV pull (``kv_pull_bytes``, ``kv_pull_ms``) when it reports one.

With the flag off the proxy keeps only these stamps (the header and the histograms need them); the
``metrics`` dict is built only when asked for.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

# (leg, phase, seconds): one observation of pdserve_proxy_leg_phase_seconds.
Phase = tuple[str, str, float]


def server_timing(entries: Iterable[tuple[str, float]]) -> str:
    """A W3C ``Server-Timing`` value: ``name;dur=MS`` entries (milliseconds, one decimal), comma-separated."""
    return ", ".join(f"{name};dur={ms:.1f}" for name, ms in entries)


@dataclass
class Leg:
    """One leg's member and wall time as the proxy saw it, and the member's own ``metrics`` if it sent them."""

    member: str
    seconds: float
    reported: dict[str, Any] | None = None

    def reported_ms(self, name: str) -> float | None:
        """A number the member reported (milliseconds, vLLM's names), None when it did not."""
        value = (self.reported or {}).get(name)
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None

    def view(self, **fields: Any) -> dict[str, Any]:
        out = {"member": self.member, "total_ms": self.seconds * 1000, **fields}
        if self.reported:
            out["reported"] = self.reported
        return out


def _reported(value: Any) -> dict[str, Any] | None:
    return value if isinstance(value, dict) and value else None


@dataclass
class RequestRecord:
    """Filled by :class:`pdserve.proxy.flow.Orchestrator` as the request goes through its legs."""

    arrival: float = field(default_factory=lambda: time.perf_counter())  # the proxy starts on the request
    render: Leg | None = None
    prefill: Leg | None = None
    decode: Leg | None = None  # set once the decode leg answered (batch) or sent its finishing chunk (stream)
    derender_calls: int = 0
    derender_s: float = 0.0
    decode_sent: float | None = None  # the first decode leg went out
    first_token: float | None = None  # stream chunks that carried output, as they arrived
    last_token: float | None = None
    tokens: int | None = 0  # output ids; None once a chunk withheld its ids (hidden reasoning)
    finished_choices: int = 0
    retries: list[dict[str, str]] = field(default_factory=list)
    migrations: list[dict[str, str]] = field(default_factory=list)

    # ---------------------------------------------------------------- filled by the flow

    def retried(self, leg: str, cause: str, from_member: str, to_member: str) -> None:
        self.retries.append({"leg": leg, "cause": cause, "from": from_member, "to": to_member})

    def migrated(self, cause: str, from_member: str, to_member: str) -> None:
        self.migrations.append({"cause": cause, "from": from_member, "to": to_member})

    def derendered(self, seconds: float) -> None:
        self.derender_calls += 1
        self.derender_s += seconds

    def decode_started(self) -> None:
        self.decode_sent = time.perf_counter()

    def prefill_answered(self, member: str, seconds: float, response: Any) -> None:
        """The prefill leg's answer (its ``metrics`` are the member's, when it sent them)."""
        self.prefill = Leg(member, seconds, _reported(response.get("metrics") if isinstance(response, dict) else None))

    def decode_answered(self, member: str, seconds: float, response: dict[str, Any]) -> None:
        """A batch decode leg's answer: its usage counts the tokens, its ``metrics`` are the member's."""
        self.tokens = (response.get("usage") or {}).get("completion_tokens")
        self.decode = Leg(member, seconds, _reported(response.get("metrics")))

    def saw(self, chunk: dict[str, Any], member: str, choices: int) -> bool:
        """A decode stream chunk with choices; True when it finished the last of ``choices`` (the decode
        leg is then recorded: ``member`` answered it, the chunk's ``metrics`` are that member's)."""
        now = time.perf_counter()
        carried = False
        for choice in chunk["choices"]:
            ids = choice.get("token_ids")
            if ids is None:
                self.tokens, carried = None, True
            elif ids:
                carried = True
                if self.tokens is not None:
                    self.tokens += len(ids)
            if choice.get("finish_reason") is not None:
                self.finished_choices += 1
        if carried:
            if self.first_token is None:
                self.first_token = now
            self.last_token = now
        if self.finished_choices < choices:
            return False
        self.decode = Leg(member, now - (self.decode_sent or now), _reported(chunk.get("metrics")))
        return True

    # ---------------------------------------------------------------- read

    def prefill_phases(self) -> list[Phase]:
        """The prefill member's queue and compute (scheduled → its one token), when it reported them."""
        if self.prefill is None:
            return []
        queue, ttft = self.prefill.reported_ms("queue_time_ms"), self.prefill.reported_ms("time_to_first_token_ms")
        phases = []
        if queue is not None:
            phases.append(("prefill", "queue", queue / 1000))
            if ttft is not None:
                phases.append(("prefill", "compute", max(0.0, ttft - queue) / 1000))
        return phases

    def decode_phases(self) -> list[Phase]:
        """The finished decode leg's queue (the member's), time to first token and per output token."""
        if self.decode is None:
            return []
        queue, ttft, tpot = self.decode.reported_ms("queue_time_ms"), self._decode_ttft_ms(), self._decode_tpot_ms()
        return [("decode", phase, ms / 1000) for phase, ms in (("queue", queue), ("ttft", ttft), ("tpot", tpot))
                if ms is not None]

    def _stream_span(self) -> tuple[float, float] | None:
        """The first and last chunk that carried output, on a stream; None on a batch answer."""
        if self.first_token is None or self.last_token is None:
            return None
        return self.first_token, self.last_token

    def _decode_ttft_ms(self) -> float | None:
        """Decode leg sent → first output, the proxy's own on a stream; a batch answer shows no first token,
        so there it is the member's."""
        span = self._stream_span()
        if span is not None and self.decode_sent is not None:
            return (span[0] - self.decode_sent) * 1000
        return None if self.decode is None else self.decode.reported_ms("time_to_first_token_ms")

    def _decode_tpot_ms(self) -> float | None:
        """Per output token after the first: the proxy's own on a stream (None below two tokens, or when the
        ids were withheld), the member's ``mean_itl_ms`` on a batch answer."""
        span = self._stream_span()
        if span is not None:
            if self.tokens is None or self.tokens < 2:
                return None
            return (span[1] - span[0]) / (self.tokens - 1) * 1000
        return None if self.decode is None else self.decode.reported_ms("mean_itl_ms")

    def _kv_pull(self) -> dict[str, Any] | None:
        """The decode member's KV pull for this request, when it reports one."""
        if self.decode is None:
            return None
        pulled, ms = self.decode.reported_ms("kv_pull_bytes"), self.decode.reported_ms("kv_pull_ms")
        if ms is None:
            return None
        return {"member": self.decode.member, "bytes": None if pulled is None else int(pulled), "ms": ms}

    def timings_ms(self) -> list[tuple[str, float]]:
        """Each leg recorded so far and its milliseconds: render, prefill, decode, the KV pull the decode
        member reported, every derender call together (``--mode derender-tier``)."""
        out = [(name, leg.seconds * 1000) for name, leg in
               (("render", self.render), ("prefill", self.prefill), ("decode", self.decode)) if leg is not None]
        kv = self._kv_pull()
        if kv is not None:
            out.append(("kv", kv["ms"]))
        if self.derender_calls:
            out.append(("derender", self.derender_s * 1000))
        return out

    def server_timing(self) -> str:
        return server_timing(self.timings_ms())

    def metrics(self) -> dict[str, Any]:
        """The client's ``metrics``: vLLM's per-request fields for the whole request as the proxy served
        it (from when the proxy started on it), then every leg, migration and retry."""
        return {**self._summary(), "legs": self._legs(), "migrations": self.migrations, "retries": self.retries}

    def _summary(self) -> dict[str, Any]:
        ttft = gen = end = rate = None
        span, decode = self._stream_span(), self.decode
        if span is not None:
            first, end = span
            ttft, gen = (first - self.arrival) * 1000, (end - first) * 1000
        elif decode is not None and self.decode_sent is not None:
            member_ttft = decode.reported_ms("time_to_first_token_ms")
            if member_ttft is not None:
                ttft = (self.decode_sent - self.arrival) * 1000 + member_ttft
            gen = decode.reported_ms("generation_time_ms")
            end = self.decode_sent + decode.seconds
        if end is not None and self.tokens is not None and end > self.arrival:
            rate = self.tokens / (end - self.arrival)
        queues = [q for leg in (self.prefill, decode) if leg is not None
                  and (q := leg.reported_ms("queue_time_ms")) is not None]
        return {"time_to_first_token_ms": ttft, "queue_time_ms": sum(queues) if queues else None,
                "generation_time_ms": gen, "mean_itl_ms": self._decode_tpot_ms(), "tokens_per_second": rate}

    def members(self) -> dict[str, Any]:
        """Which member served each leg (and where retries and migrations went): a JSON log's request line."""
        served: dict[str, Any] = {name: leg.member for name, leg in
                                  (("render", self.render), ("prefill", self.prefill), ("decode", self.decode))
                                  if leg is not None}
        if self.retries:
            served["retries"] = self.retries
        if self.migrations:
            served["migrations"] = self.migrations
        return served

    def _legs(self) -> dict[str, Any]:
        legs: dict[str, Any] = {}
        if self.render is not None:
            legs["render"] = self.render.view()
        if self.prefill is not None:
            phases = {phase: seconds * 1000 for _, phase, seconds in self.prefill_phases()}
            legs["prefill"] = self.prefill.view(queue_ms=phases.get("queue"), compute_ms=phases.get("compute"))
        if self.decode is not None:
            legs["decode"] = self.decode.view(queue_ms=self.decode.reported_ms("queue_time_ms"),
                                              ttft_ms=self._decode_ttft_ms(), tpot_ms=self._decode_tpot_ms(),
                                              tokens=self.tokens)
        kv = self._kv_pull()
        if kv is not None:
            legs["kv_pull"] = kv
        if self.derender_calls:
            legs["derender"] = {"calls": self.derender_calls, "total_ms": self.derender_s * 1000}
        return legs
