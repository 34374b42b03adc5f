"""Client metric definitions of ``bench serve`` on hand-built arrival timelines (vLLM's names and rules)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.bench.loadgen import StreamTokenTally
from pdserve.bench.metrics import RequestResult, meets_slo, parse_slo, summarize
from pdserve.bench.report import percentile


def result(start: float, arrivals: list[tuple[float, int]], end: float, **kw: object) -> RequestResult:
    return RequestResult(start=start, arrivals=arrivals, end=end, success=True, **kw)  # type: ignore[arg-type]


def test_ttft_tpot_itl_e2el_of_one_timeline() -> None:
    # 1 token at 0.1 s, a held-back chunk releasing 2 at 0.3 s, a chunk with no tokens, 1 at 0.35 s.
    r = result(0.0, [(0.1, 1), (0.3, 2), (0.32, 0), (0.35, 1)], 0.4)
    assert r.ttft == pytest.approx(0.1)
    assert r.output_tokens == 4
    assert r.tpot == pytest.approx((0.35 - 0.1) / 3)  # (last - first) / (n - 1), per token
    assert r.itl == pytest.approx([0.2, 0.05])  # per token-carrying chunk, as vLLM
    assert r.e2el == pytest.approx(0.4)


def test_usage_wins_over_counted_arrivals_and_one_token_has_no_tpot() -> None:
    r = result(0.0, [(0.2, 3)], 0.3, usage_output_tokens=5)
    assert r.output_tokens == 5
    assert math.isnan(r.tpot)  # every token in one arrival (a batch response): no per-token timing
    single = result(0.0, [(0.2, 1)], 0.3)
    assert math.isnan(single.tpot) and single.itl == []
    assert math.isnan(result(0.0, [], 0.3).ttft)


def test_summary_has_vllm_names_and_values() -> None:
    rs = [result(0.0, [(0.1, 1), (0.2, 1), (0.3, 1)], 0.3, prompt_len=10),
          result(0.0, [(0.3, 1), (0.5, 1)], 0.6, prompt_len=20),
          RequestResult(start=0.0, end=0.1, error="boom")]
    s = summarize(rs, duration_s=2.0)
    assert s["completed"] == 2 and s["failed"] == 1
    assert s["total_input_tokens"] == 30 and s["total_output_tokens"] == 5
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(2.5)
    assert s["total_token_throughput"] == pytest.approx(17.5)
    assert s["median_ttft_ms"] == pytest.approx(200.0) and s["mean_ttft_ms"] == pytest.approx(200.0)
    assert s["p99_ttft_ms"] == pytest.approx(100 + 200 * 0.99)
    assert s["median_tpot_ms"] == pytest.approx(150.0)  # 100 and 200
    assert s["median_itl_ms"] == pytest.approx(100.0)  # gaps 100, 100, 200
    assert s["median_e2el_ms"] == pytest.approx(450.0)
    assert "request_goodput" not in s


def test_goodput_counts_requests_within_every_bound() -> None:
    fast = result(0.0, [(0.05, 1), (0.06, 1)], 0.07)
    slow_start = result(0.0, [(0.5, 1), (0.51, 1)], 0.52)
    slow_decode = result(0.0, [(0.05, 1), (0.45, 1)], 0.46)
    slo = parse_slo("ttft=100,tpot=50")
    assert [meets_slo(r, slo) for r in (fast, slow_start, slow_decode)] == [True, False, False]
    assert summarize([fast, slow_start, slow_decode], 1.0, slo)["request_goodput"] == pytest.approx(1.0)
    assert meets_slo(result(0.0, [(0.05, 1)], 0.06), slo)  # no TPOT: the TPOT bound does not apply


def test_slo_accepts_vllm_form_and_names_bad_items() -> None:
    assert parse_slo("ttft:500 tpot:50") == {"ttft": 500.0, "tpot": 50.0}
    assert parse_slo("e2el=2000") == {"e2el": 2000.0}
    for bad in ("itl=5", "ttft", "ttft=fast", "ttft=-1"):
        with pytest.raises(ValueError, match="SLO item"):
            parse_slo(bad)


def test_token_counter_prefers_ids_then_usage_then_content() -> None:
    counter = StreamTokenTally()
    assert counter.count({"choices": [{"token_ids": [1, 2]}]}) == 2
    usage_only = StreamTokenTally()
    assert usage_only.count({"choices": [{"delta": {"content": "a"}}], "usage": {"completion_tokens": 3}}) == 3
    assert usage_only.count({"choices": [{"delta": {"content": "b"}}], "usage": {"completion_tokens": 5}}) == 2
    assert usage_only.count({"choices": [], "usage": {"completion_tokens": 5}}) == 0  # the final usage chunk
    bare = StreamTokenTally()
    assert bare.count({"choices": [{"delta": {"reasoning": "x"}}]}) == 1
    assert bare.count({"choices": [{"delta": {}}]}) == 0


timelines = st.lists(
    st.tuples(st.floats(0.0, 5.0, allow_nan=False), st.integers(0, 4)), min_size=1, max_size=40
).map(lambda xs: sorted(xs))


@given(timelines)
def test_itl_gaps_sum_to_last_minus_first_and_tpot_is_their_per_token_mean(arrivals: list[tuple[float, int]]) -> None:
    r = result(0.0, arrivals, 6.0)
    timed = [(t, n) for t, n in arrivals if n > 0]
    if not timed:
        assert math.isnan(r.ttft) and r.itl == []
        return
    assert sum(r.itl) == pytest.approx(timed[-1][0] - timed[0][0], abs=1e-9)
    assert all(gap >= 0 for gap in r.itl) and len(r.itl) == len(timed) - 1
    if len(timed) >= 2:
        assert r.tpot == pytest.approx(sum(r.itl) / (r.output_tokens - 1), abs=1e-9)
    assert 0 <= r.ttft <= r.e2el


def test_percentile_interpolates_between_ranks_and_nothing_is_nan() -> None:
    values = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert [percentile(values, q) for q in (0, 50, 100)] == [1.0, 2.5, 4.0]
    assert percentile(values, 90) == pytest.approx(3.7)
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=50), st.floats(0, 100),
       st.floats(0, 100))
def test_percentile_is_monotone_and_bounded(values: list[float], q1: float, q2: float) -> None:
    low, high = sorted((q1, q2))
    assert min(values) <= percentile(values, low) <= percentile(values, high) <= max(values)
