"""The interval p50 of ``pdserve top``: Prometheus' histogram_quantile over two scrapes' bucket differences."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.top.quantile import Bucket, bucket_deltas, counter_delta, histogram_quantile

INF = math.inf


def cumulative(bounds: list[float], counts: list[int]) -> list[Bucket]:
    total, out = 0, []
    for bound, count in zip([*bounds, INF], counts):
        total += count
        out.append((bound, float(total)))
    return out


def test_interpolates_within_the_bucket_holding_the_rank_like_prometheus() -> None:
    buckets = cumulative([0.1, 0.5, 1.0], [0, 10, 0, 0])
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.3)  # 0.1 + 0.4 × 5/10
    assert histogram_quantile(1.0, buckets) == pytest.approx(0.5)
    assert histogram_quantile(0.0, buckets) == pytest.approx(0.1)  # the start of the first bucket with observations
    first = cumulative([0.1, 0.5], [4, 4, 0])
    assert histogram_quantile(0.25, first) == pytest.approx(0.05)  # the first bucket starts at 0
    assert histogram_quantile(0.75, first) == pytest.approx(0.3)


def test_a_rank_in_the_inf_bucket_is_the_highest_finite_bound() -> None:
    assert histogram_quantile(0.5, cumulative([0.1, 0.5], [1, 0, 9])) == 0.5


def test_none_without_observations_or_without_a_finite_bucket() -> None:
    assert histogram_quantile(0.5, cumulative([0.1, 0.5], [0, 0, 0])) is None
    assert histogram_quantile(0.5, [(INF, 3.0)]) is None
    assert histogram_quantile(0.5, [(0.1, 1.0), (0.5, 2.0)]) is None  # no +Inf bucket: not a histogram
    assert histogram_quantile(0.5, []) is None
    with pytest.raises(ValueError):
        histogram_quantile(1.5, cumulative([0.1], [1, 0]))


def test_deltas_keep_only_the_interval_and_a_reset_counts_as_all_new() -> None:
    before = cumulative([0.1, 1.0], [0, 100, 0])  # history: slow
    after = cumulative([0.1, 1.0], [10, 100, 0])  # the interval: 10 fast
    assert bucket_deltas(before, after) == cumulative([0.1, 1.0], [10, 0, 0])
    assert histogram_quantile(0.5, bucket_deltas(before, after)) == pytest.approx(0.05)
    assert histogram_quantile(0.5, bucket_deltas(before, before)) is None  # nothing new
    restarted = cumulative([0.1, 1.0], [2, 0, 0])
    assert bucket_deltas(before, restarted) == restarted
    assert bucket_deltas(None, after) == after
    assert bucket_deltas(cumulative([0.2], [1, 0]), after) == after  # another layout: no difference to take
    assert counter_delta(5, 8) == 3
    assert counter_delta(8, 2) == 2  # reset
    assert counter_delta(None, 4) == 4


bounds_st = st.lists(st.floats(1e-6, 1e4, allow_nan=False), min_size=1, max_size=12, unique=True).map(sorted)


@st.composite
def histograms(draw: st.DrawFn) -> tuple[list[float], list[int]]:
    bounds = draw(bounds_st)
    counts = draw(st.lists(st.integers(0, 1000), min_size=len(bounds) + 1, max_size=len(bounds) + 1))
    return bounds, counts


@given(histograms(), st.floats(0, 1), st.floats(0, 1))
def test_monotone_in_q_and_within_a_bucket_that_got_observations(
    histogram: tuple[list[float], list[int]], q1: float, q2: float
) -> None:
    bounds, counts = histogram
    buckets = cumulative(bounds, counts)
    low, high = sorted((q1, q2))
    a, b = histogram_quantile(low, buckets), histogram_quantile(high, buckets)
    if sum(counts) == 0:
        assert a is None and b is None
        return
    assert a is not None and b is not None
    assert a <= b
    for value in (a, b):
        assert 0.0 <= value <= bounds[-1]
        edges = [0.0, *bounds]
        # inside [start, end] of a finite bucket with observations, or the highest bound (a rank in +Inf)
        assert any(edges[i] <= value <= edges[i + 1] and counts[i] > 0 for i in range(len(bounds))) or (
            value == bounds[-1] and counts[-1] > 0
        )


@given(histograms(), st.lists(st.integers(0, 1000), min_size=13, max_size=13), st.floats(0, 1))
def test_the_quantile_of_deltas_is_the_quantile_of_the_new_observations_alone(
    histogram: tuple[list[float], list[int]], new: list[int], q: float
) -> None:
    bounds, old = histogram
    new = new[: len(old)]
    before = cumulative(bounds, old)
    after = cumulative(bounds, [o + n for o, n in zip(old, new)])
    assert histogram_quantile(q, bucket_deltas(before, after)) == histogram_quantile(q, cumulative(bounds, new))
