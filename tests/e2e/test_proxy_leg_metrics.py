"""One request's legs through ``pdserve proxy`` on loopback (docs/observability.md, "One request's legs"): the
``Server-Timing`` header of a batch answer, the ``metrics`` object with ``--enable-per-request-metrics``
(batch, and a stream's finishing chunk) naming the members that served each leg, nothing of it without the
flag, and the proxy's leg and phase histograms; with ``--log-format json`` every process writes one JSON line
per answered request, and one request id finds the request's lines in all four logs.

qwen3-tiny on the torch engine with the KV hand-off on (the scripted engine has no KV to hand off); the prefill
and decode members run ``--enable-per-request-metrics`` too, so their own figures (queue, compute) reach the
record and the phase histograms.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pdserve.checkpoints.resolve import resolve_model
from pdserve.topology.process import start_all, stop_all
from tests.serverproc import ServerProcess
from tests.sse import stream_post
from tests.waiting import wait_until

MODEL = "qwen3-tiny"
JSON_LOGS = ("--log-format", "json")
ENGINE = (MODEL, "--kv-transfer", "nixl", "--enable-per-request-metrics", *JSON_LOGS)
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 6, "ignore_eos": True, "temperature": 0}
LEGS = ("render", "prefill", "decode")
PHASES = (("prefill", "queue"), ("prefill", "compute"), ("decode", "queue"), ("decode", "ttft"), ("decode", "tpot"))


@pytest.fixture(scope="module")
def fleet() -> Iterator[dict[str, ServerProcess]]:
    """A render, a prefill and a decode member; one proxy with --enable-per-request-metrics, one without."""
    render = ServerProcess("launch", "render", "--tokenizer", str(resolve_model(MODEL)), *JSON_LOGS)
    prefill = ServerProcess("serve", *ENGINE, "--tokens-only", "--kv-role", "prefill")
    decode = ServerProcess("serve", *ENGINE, "--kv-role", "decode")
    servers = [render, prefill, decode]
    try:
        start_all(servers)

        def proxy(*extra: str) -> ServerProcess:
            return ServerProcess("proxy", "--render", render.url, "--prefill", prefill.url, "--decode", decode.url,
                                 *extra)

        proxies = [proxy("--enable-per-request-metrics"), proxy(), proxy(*JSON_LOGS)]
        servers += proxies
        start_all(proxies)
        yield {"render": render, "prefill": prefill, "decode": decode, "on": proxies[0], "off": proxies[1],
               "json": proxies[2]}
    finally:
        stop_all(servers)


def _server_timing(header: str) -> dict[str, float]:
    """``name;dur=MS, ...`` as a dict (each entry exactly one name and one dur)."""
    entries = [entry.split(";") for entry in header.split(", ")]
    assert all(len(e) == 2 and e[1].startswith("dur=") for e in entries), header
    return {name: float(dur[len("dur="):]) for name, dur in entries}


def _chat(proxy: ServerProcess) -> tuple[httpx.Response, float]:
    """A batch chat answer and the client's latency for it, in ms."""
    start = time.perf_counter()
    r = httpx.post(proxy.url + "/v1/chat/completions", json=CHAT, timeout=60)
    latency_ms = (time.perf_counter() - start) * 1000
    assert r.status_code == 200, r.text
    return r, latency_ms


def _members(metrics: dict[str, Any]) -> dict[str, str]:
    return {leg: metrics["legs"][leg]["member"] for leg in LEGS}


def test_a_batch_answer_times_its_legs_in_server_timing_and_without_the_flag_has_no_metrics(fleet) -> None:  # type: ignore[no-untyped-def]
    r, latency_ms = _chat(fleet["off"])
    timing = _server_timing(r.headers["server-timing"])
    assert list(timing) == [*LEGS, "kv"]  # the decode member reports its pull (its --enable-per-request-metrics)
    assert all(ms > 0 for ms in timing.values()), timing
    assert sum(timing[leg] for leg in LEGS) <= latency_ms and timing["kv"] <= timing["decode"]
    assert r.json()["metrics"] is None
    events, done = stream_post(fleet["off"].url + "/v1/chat/completions", CHAT | {"stream": True})
    assert done and all(e["metrics"] is None for e in events)


def test_with_the_flag_the_metrics_name_the_members_that_served_each_leg(fleet) -> None:  # type: ignore[no-untyped-def]
    members = {leg: fleet[leg].url for leg in LEGS}
    r, latency_ms = _chat(fleet["on"])
    metrics = r.json()["metrics"]
    assert _members(metrics) == members
    legs = metrics["legs"]
    assert legs["prefill"]["queue_ms"] is not None and legs["prefill"]["compute_ms"] > 0  # the member's report
    assert legs["decode"]["tokens"] == CHAT["max_tokens"] and legs["decode"]["reported"]["mean_itl_ms"] > 0
    assert 0 < metrics["time_to_first_token_ms"] < latency_ms
    assert metrics["migrations"] == [] and metrics["retries"] == []
    pull = legs["kv_pull"]  # as the decode member's engine reported it: the READ's time and bytes
    assert pull["member"] == members["decode"] and pull["bytes"] > 0 and 0 < pull["ms"] < legs["decode"]["total_ms"]
    assert _server_timing(r.headers["server-timing"]) == {leg: round(legs[leg]["total_ms"], 1) for leg in LEGS} | {
        "kv": round(pull["ms"], 1)}

    events, done = stream_post(fleet["on"].url + "/v1/chat/completions", CHAT | {"stream": True})
    assert done and all(e["metrics"] is None for e in events[:-1])
    final = events[-1]
    assert final["choices"][0]["finish_reason"] == "length"
    assert _members(final["metrics"]) == members
    decode = final["metrics"]["legs"]["decode"]
    assert decode["ttft_ms"] > 0 and decode["tpot_ms"] > 0 and decode["tokens"] == CHAT["max_tokens"]


def _count(proxy: ServerProcess, name: str, **labels: str) -> float:
    selector = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return proxy.metric(f"{name}_count{{{selector}}}", missing=0)


def test_the_histograms_count_one_observation_per_leg_and_phase_per_request(fleet) -> None:  # type: ignore[no-untyped-def]
    proxy = fleet["on"]

    def counts() -> dict[tuple[str, ...], float]:
        out = {(leg,): _count(proxy, "pdserve_proxy_leg_seconds", leg=leg) for leg in LEGS}
        out |= {(leg, phase): _count(proxy, "pdserve_proxy_leg_phase_seconds", leg=leg, phase=phase)
                for leg, phase in PHASES}
        return out

    before = counts()
    _chat(proxy)
    stream_post(proxy.url + "/v1/chat/completions", CHAT | {"stream": True})
    after = counts()
    assert {key: after[key] - before[key] for key in after} == dict.fromkeys(after, 2)


def _request_lines(server: ServerProcess, request_id: str) -> list[dict[str, Any]]:
    """The JSON log's request lines of ``request_id`` (the ready banner is printed, not logged: not JSON)."""
    logged = [line for line in server.log().splitlines() if line.startswith("{")]
    records = [json.loads(line) for line in logged]
    return [r for r in records if r.get("logger") == "pdserve.request" and r.get("request_id") == request_id]


def test_json_logs_find_one_requests_lines_in_every_process(fleet) -> None:  # type: ignore[no-untyped-def]
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    headers = {"x-request-id": "json-log-1", "traceparent": f"00-{trace}-00f067aa0ba902b7-01"}
    assert httpx.post(fleet["json"].url + "/v1/chat/completions", json=CHAT, headers=headers, timeout=60).status_code == 200
    proxy_line = wait_until(lambda: _request_lines(fleet["json"], "json-log-1"), "the proxy's request line")[0]
    assert proxy_line["trace_id"] == trace and proxy_line["status"] == 200 and proxy_line["path"] == "/v1/chat/completions"
    legs = proxy_line["legs"]
    assert (legs["render"], legs["prefill"], legs["decode"]) == (fleet["render"].url, fleet["prefill"].url,
                                                                 fleet["decode"].url)
    for role in ("render", "prefill", "decode"):  # each leg carried the request id to its member's log
        lines = wait_until(lambda r=role: _request_lines(fleet[r], "json-log-1"), f"the {role} member's request line")
        assert all(line["member"] == fleet[role].url and line["status"] == 200 for line in lines), lines
