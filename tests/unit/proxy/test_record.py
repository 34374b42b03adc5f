"""One request's record (pdserve.proxy.record) on a clock the test moves: what the Server-Timing header,
the phase histograms and the ``metrics`` object say, from the proxy's stamps and the members' reports."""

from __future__ import annotations

import re
from typing import Any

import pytest

from pdserve.proxy import record as record_module
from pdserve.proxy.record import Leg, RequestRecord, server_timing

# RFC 8941-ish shape of a W3C Server-Timing value: `name;dur=NUMBER` entries separated by ", ".
SERVER_TIMING = re.compile(r"^[a-z_]+;dur=\d+\.\d(, [a-z_]+;dur=\d+\.\d)*$")
PREFILL_REPORT = {"time_to_first_token_ms": 7.0, "queue_time_ms": 2.0, "generation_time_ms": 0.0,
                  "mean_itl_ms": None, "tokens_per_second": 100.0}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(record_module, "time", fake)
    return fake


def chunk(*choices: dict[str, Any], metrics: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"request_id": "r", "choices": list(choices), "metrics": metrics}


def prepared(clock: Clock) -> RequestRecord:
    """Rendered in 10 ms, prefilled in 20 ms (its member reporting 2 ms queued, first token at 7 ms)."""
    rec = RequestRecord()
    rec.render = Leg("http://render", 0.010)
    rec.prefill_answered("http://prefill", 0.020, {"choices": [], "metrics": PREFILL_REPORT})
    clock.now = 0.100
    rec.decode_started()
    return rec


def test_server_timing_is_w3c_entries_in_milliseconds() -> None:
    value = server_timing([("render", 12.345), ("prefill", 5), ("decode", 1234.56)])
    assert value == "render;dur=12.3, prefill;dur=5.0, decode;dur=1234.6"
    assert SERVER_TIMING.match(value)
    assert server_timing([]) == ""


def test_a_stream_is_timed_by_the_proxy_and_the_members_reports_fill_in_the_rest(clock: Clock) -> None:
    rec = prepared(clock)
    assert rec.server_timing() == "render;dur=10.0, prefill;dur=20.0"  # what a stream's header can carry
    for now, ids, finish in ((0.200, [1], None), (0.300, [2, 3], None)):
        clock.now = now
        assert not rec.saw(chunk({"index": 0, "token_ids": ids, "finish_reason": finish}), "http://decode", 1)
    clock.now = 0.400
    decode_report = {"time_to_first_token_ms": 90.0, "queue_time_ms": 1.0}
    last = chunk({"index": 0, "token_ids": [4], "finish_reason": "stop"}, metrics=decode_report)
    assert rec.saw(last, "http://decode", 1)

    metrics = rec.metrics()
    assert metrics == {
        "time_to_first_token_ms": pytest.approx(200.0), "queue_time_ms": 3.0,
        "generation_time_ms": pytest.approx(200.0), "mean_itl_ms": pytest.approx(200.0 / 3),
        "tokens_per_second": pytest.approx(10.0),
        "legs": {
            "render": {"member": "http://render", "total_ms": pytest.approx(10.0)},
            "prefill": {"member": "http://prefill", "total_ms": pytest.approx(20.0), "queue_ms": 2.0,
                        "compute_ms": 5.0, "reported": PREFILL_REPORT},
            "decode": {"member": "http://decode", "total_ms": pytest.approx(300.0), "queue_ms": 1.0,
                       "ttft_ms": pytest.approx(100.0), "tpot_ms": pytest.approx(200.0 / 3), "tokens": 4,
                       "reported": decode_report},
        },
        "migrations": [], "retries": [],
    }
    assert rec.server_timing() == "render;dur=10.0, prefill;dur=20.0, decode;dur=300.0"
    assert rec.prefill_phases() == [("prefill", "queue", 0.002), ("prefill", "compute", 0.005)]
    assert rec.decode_phases() == [("decode", "queue", 0.001), ("decode", "ttft", pytest.approx(0.1)),
                                   ("decode", "tpot", pytest.approx(0.2 / 3))]


def test_a_batch_answer_takes_the_decode_members_ttft_tpot_and_kv_pull(clock: Clock) -> None:
    rec = prepared(clock)
    clock.now = 0.350
    report = {"time_to_first_token_ms": 50.0, "generation_time_ms": 40.0, "mean_itl_ms": 10.0,
              "queue_time_ms": 3.0, "kv_pull_bytes": 1024, "kv_pull_ms": 4.5}
    rec.decode_answered("http://decode", 0.250, {"usage": {"completion_tokens": 5}, "metrics": report})

    assert rec.server_timing() == "render;dur=10.0, prefill;dur=20.0, decode;dur=250.0, kv;dur=4.5"
    metrics = rec.metrics()
    assert metrics["time_to_first_token_ms"] == pytest.approx(100.0 + 50.0)  # before the decode leg + its TTFT
    assert (metrics["generation_time_ms"], metrics["mean_itl_ms"], metrics["queue_time_ms"]) == (40.0, 10.0, 5.0)
    assert metrics["tokens_per_second"] == pytest.approx(5 / 0.350)
    assert metrics["legs"]["kv_pull"] == {"member": "http://decode", "bytes": 1024, "ms": 4.5}
    decode = metrics["legs"]["decode"]
    assert (decode["ttft_ms"], decode["tpot_ms"], decode["tokens"]) == (50.0, 10.0, 5)
    assert [phase for _, phase, _ in rec.decode_phases()] == ["queue", "ttft", "tpot"]


def test_members_that_report_nothing_leave_only_the_proxys_own_figures(clock: Clock) -> None:
    rec = RequestRecord()
    rec.render = Leg("http://render", 0.010)
    rec.prefill_answered("http://prefill", 0.020, {"choices": []})
    rec.decode_started()
    rec.decode_answered("http://decode", 0.250, {"usage": {"completion_tokens": 5}})

    assert rec.prefill_phases() == [] and rec.decode_phases() == []
    assert rec.server_timing() == "render;dur=10.0, prefill;dur=20.0, decode;dur=250.0"  # no kv
    metrics = rec.metrics()
    assert {k: metrics[k] for k in ("time_to_first_token_ms", "queue_time_ms", "generation_time_ms",
                                    "mean_itl_ms")} == dict.fromkeys(("time_to_first_token_ms", "queue_time_ms",
                                                                      "generation_time_ms", "mean_itl_ms"))
    assert metrics["legs"]["prefill"] == {"member": "http://prefill", "total_ms": 20.0, "queue_ms": None,
                                          "compute_ms": None}
    assert "kv_pull" not in metrics["legs"] and "reported" not in metrics["legs"]["decode"]


def test_a_request_finishes_with_its_last_choice_and_withheld_ids_leave_tpot_unknown(clock: Clock) -> None:
    rec = prepared(clock)
    clock.now = 0.2
    assert not rec.saw(chunk({"index": 0, "token_ids": None, "finish_reason": "stop"},
                             {"index": 1, "token_ids": [5]}), "http://decode", 2)
    clock.now = 0.3
    assert rec.saw(chunk({"index": 1, "token_ids": [6], "finish_reason": "length"}), "http://decode", 2)
    assert rec.tokens is None
    decode = rec.metrics()["legs"]["decode"]
    assert decode["tpot_ms"] is None and decode["ttft_ms"] == pytest.approx(100.0)
    assert [phase for _, phase, _ in rec.decode_phases()] == ["ttft"]


def test_retries_migrations_and_derender_calls_are_listed(clock: Clock) -> None:
    rec = prepared(clock)
    rec.retried("prefill", "dropped", "http://p0", "http://p1")
    rec.migrated("stalled", "http://d0", "http://d1")
    rec.derendered(0.002)
    rec.derendered(0.003)
    clock.now = 0.2
    rec.saw(chunk({"index": 0, "token_ids": [1], "finish_reason": "stop"}), "http://d1", 1)
    metrics = rec.metrics()
    assert metrics["retries"] == [{"leg": "prefill", "cause": "dropped", "from": "http://p0", "to": "http://p1"}]
    assert metrics["migrations"] == [{"cause": "stalled", "from": "http://d0", "to": "http://d1"}]
    assert metrics["legs"]["derender"] == {"calls": 2, "total_ms": pytest.approx(5.0)}
    assert metrics["legs"]["decode"]["member"] == "http://d1"
    assert rec.server_timing().endswith(", derender;dur=5.0")
