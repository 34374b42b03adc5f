"""Each request's legs through the proxy's app over mocked members (httpx.MockTransport): the Server-Timing
header, ``metrics`` with and without ``--enable-per-request-metrics``, the phase histograms, and a
migration in the record. Real servers: tests/e2e/test_proxy_leg_metrics.py."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import httpx

from pdserve.proxy.app import create_app
from pdserve.proxy.flow import Orchestrator
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.pool import Pool
from tests.unit.proxy.test_flow import IN_ORDER, KV, RENDERED, RESUMABLE, Upstreams, chunk, payloads, sse

PREFILL_REPORT = {"time_to_first_token_ms": 7.0, "queue_time_ms": 2.0, "generation_time_ms": 0.0,
                  "mean_itl_ms": None, "tokens_per_second": 100.0}
DECODE_REPORT = {"time_to_first_token_ms": 5.0, "queue_time_ms": 1.0, "generation_time_ms": 4.0,
                 "mean_itl_ms": 2.0, "tokens_per_second": 300.0}
USAGE = {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
STREAM = sse(chunk(delta={"role": "assistant", "content": "a"}, token_ids=[7]),
             chunk(delta={"content": "b"}, token_ids=[8]),
             chunk(delta={"content": "c"}, token_ids=[9], finish_reason="stop") | {"metrics": DECODE_REPORT})
BATCH = {"request_id": "x", "output_mode": "derender", "usage": USAGE, "metrics": DECODE_REPORT,
         "choices": [{"index": 0, "message": {"role": "assistant", "content": "abc"}, "finish_reason": "stop",
                      "token_ids": [7, 8, 9]}]}


class Reporting(Upstreams):
    """Members run with --enable-per-request-metrics: the prefill and the decode answers carry ``metrics``; a
    batch decode leg gets a batch answer."""

    def __call__(self, request: httpx.Request) -> httpx.Response:
        response = super().__call__(request)
        body = json.loads(request.content) if request.content else {}
        if request.url.host.startswith("prefill"):
            return httpx.Response(200, json={"request_id": "x", "choices": [], "kv_transfer_params": KV,
                                             "metrics": PREFILL_REPORT})
        if request.url.host.startswith("d") and not body.get("stream"):
            return httpx.Response(200, json=BATCH)
        return response


def pools(metrics: ProxyMetrics, decode_hosts: tuple[str, ...] = ("decode",),
          prefill_hosts: tuple[str, ...] = ("prefill",)) -> list[Pool]:
    made = [Pool(name, [f"http://{h}" for h in hosts], on_change=metrics.member_changed,
                 on_error=metrics.member_failed, rng=random.Random(IN_ORDER))
            for name, hosts in (("render", ("render",)), ("prefill", prefill_hosts), ("decode", decode_hosts))]
    for pool in made:
        for member in pool.members:
            pool.mark_up(member)
    return made


def ask(body: dict[str, Any], per_request_metrics: bool, metrics: ProxyMetrics | None = None,
        rendered: dict[str, Any] = RENDERED) -> httpx.Response:
    """``body`` through the proxy's app; the response, read whole."""
    metrics = metrics or ProxyMetrics()

    async def go() -> httpx.Response:
        client = httpx.AsyncClient(transport=httpx.MockTransport(Reporting(STREAM, rendered=rendered)))
        orch = Orchestrator(client, *pools(metrics), "inline", metrics, per_request_metrics=per_request_metrics)
        transport = httpx.ASGITransport(app=create_app(orch))
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as front:
            response = await front.post("/v1/chat/completions", json=body)
            await response.aread()
        await client.aclose()
        return response

    return asyncio.run(go())


def timings(header: str) -> dict[str, float]:
    return {name: float(dur) for name, dur in (entry.split(";dur=") for entry in header.split(", "))}


def test_a_batch_answer_has_server_timing_and_no_metrics_without_the_flag() -> None:
    r = ask(CHAT, per_request_metrics=False, rendered=RENDERED | {"stream": False})
    assert r.status_code == 200
    assert list(timings(r.headers["server-timing"])) == ["render", "prefill", "decode"]
    assert r.json()["metrics"] is None  # the decode member's metrics do not leak through


def test_with_the_flag_a_batch_answers_metrics_name_each_leg_and_its_member() -> None:
    r = ask(CHAT, per_request_metrics=True, rendered=RENDERED | {"stream": False})
    metrics = r.json()["metrics"]
    legs = metrics["legs"]
    assert {name: leg["member"] for name, leg in legs.items()} == \
        {"render": "http://render", "prefill": "http://prefill", "decode": "http://decode"}
    assert (legs["prefill"]["queue_ms"], legs["prefill"]["compute_ms"]) == (2.0, 5.0)
    assert legs["decode"]["reported"] == DECODE_REPORT and legs["decode"]["ttft_ms"] == 5.0
    assert metrics["queue_time_ms"] == 3.0 and metrics["mean_itl_ms"] == 2.0
    header = timings(r.headers["server-timing"])
    assert header == {name: round(legs[name]["total_ms"], 1) for name in ("render", "prefill", "decode")}


def test_a_stream_carries_the_record_on_its_finishing_chunk_and_the_early_legs_in_its_header() -> None:
    r = ask(CHAT | {"stream": True}, per_request_metrics=True)
    assert list(timings(r.headers["server-timing"])) == ["render", "prefill"]
    events = payloads([f"{line}\n\n" for line in r.text.split("\n\n") if line])
    assert [e["metrics"] is not None for e in events] == [False, False, False, True]
    legs = events[-1]["metrics"]["legs"]
    assert legs["decode"]["member"] == "http://decode" and legs["decode"]["tokens"] == 3
    assert legs["decode"]["reported"] == DECODE_REPORT


def test_the_phase_histograms_count_each_reported_or_measured_phase_once_per_request() -> None:
    metrics = ProxyMetrics()
    ask(CHAT | {"stream": True}, per_request_metrics=False, metrics=metrics)
    ask(CHAT, per_request_metrics=False, metrics=metrics, rendered=RENDERED | {"stream": False})

    def count(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, labels)

    for leg in ("render", "prefill", "decode"):
        assert count("pdserve_proxy_leg_seconds_count", leg=leg) == 2
    for leg, phase in (("prefill", "queue"), ("prefill", "compute"), ("decode", "queue"), ("decode", "ttft"),
                       ("decode", "tpot")):
        assert count("pdserve_proxy_leg_phase_seconds_count", leg=leg, phase=phase) == 2, (leg, phase)
    assert count("pdserve_proxy_leg_phase_seconds_sum", leg="prefill", phase="compute") == 2 * 0.005


def streamed_metrics(upstreams: Upstreams, decode_hosts: tuple[str, ...], prefill_hosts: tuple[str, ...] = ("prefill",)
                     ) -> dict[str, Any]:
    """The ``metrics`` of a stream's finishing chunk, with the flag on."""

    async def go() -> list[str]:
        client = httpx.AsyncClient(transport=httpx.MockTransport(upstreams))
        metrics = ProxyMetrics()
        orch = Orchestrator(client, *pools(metrics, decode_hosts, prefill_hosts), "inline", metrics,
                            per_request_metrics=True)
        prepared = await orch.prepare("chat", CHAT | {"stream": True}, "rid")
        events = [e async for e in orch.events(prepared, await orch.open_stream(prepared))]
        await client.aclose()
        return events

    return payloads(asyncio.run(go()))[-1]["metrics"]


def test_a_migration_is_in_the_record_with_the_member_it_moved_to() -> None:
    first = sse(chunk(delta={"role": "assistant", "content": "a"}, token_ids=[7]), done=False)
    rest = sse(chunk(delta={"content": "b"}, token_ids=[8], finish_reason="length"))
    metrics = streamed_metrics(Upstreams(b"", streams={"d0": first, "d1": rest}, rendered=RESUMABLE), ("d0", "d1"))
    assert metrics["migrations"] == [{"cause": "truncated", "from": "http://d0", "to": "http://d1"}]
    assert metrics["legs"]["decode"]["member"] == "http://d1" and metrics["legs"]["decode"]["tokens"] == 2
    assert metrics["retries"] == []


def test_retries_name_the_leg_the_cause_and_both_members() -> None:
    upstreams = Upstreams(STREAM, dropping={"prefill0", "d0"}, rendered=RESUMABLE)
    metrics = streamed_metrics(upstreams, ("d0", "d1"), ("prefill0", "prefill1"))
    assert metrics["retries"] == [
        {"leg": "prefill", "cause": "dropped", "from": "http://prefill0", "to": "http://prefill1"},
        {"leg": "decode", "cause": "dropped", "from": "http://d0", "to": "http://d1"},
    ]
    assert metrics["legs"]["prefill"]["member"] == "http://prefill1" and metrics["migrations"] == []
