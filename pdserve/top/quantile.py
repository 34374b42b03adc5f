"""Histogram arithmetic for ``pdserve top``: quantiles of the observations made between two scrapes.

A Prometheus histogram's buckets are cumulative since the process started, so a p50 read from one scrape
is dominated by history. The difference of two scrapes' buckets holds only the observations of the
interval; the quantile is then estimated as Prometheus' ``histogram_quantile`` does, so the figures
``pdserve top`` shows match what a dashboard over the same series shows.

Pure functions over plain tuples: unit and property tested without any server.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Bucket = tuple[float, float]
"""One histogram bucket: (upper bound ``le``, cumulative count of observations ≤ that bound)."""


def counter_delta(before: float | None, after: float) -> float:
    """The increase of a counter between two scrapes. A counter that went down was reset (its process
    restarted), so everything it counts now is new, as Prometheus' ``rate()`` assumes; no earlier scrape:
    its total."""
    if before is None or after < before:
        return after
    return after - before


def bucket_deltas(before: Sequence[Bucket] | None, after: Sequence[Bucket]) -> list[Bucket]:
    """The buckets of the observations made between two scrapes of one histogram.

    ``after`` alone when there is no earlier scrape, when the layout changed, or when any cumulative
    count went down (the process restarted: its counts start again from zero, so all of them are new).
    """
    if before is None or [b for b, _ in before] != [b for b, _ in after]:
        return list(after)
    if any(new < old for (_, old), (_, new) in zip(before, after)):
        return list(after)
    return [(bound, new - old) for (bound, old), (_, new) in zip(before, after)]


def histogram_quantile(q: float, buckets: Sequence[Bucket]) -> float | None:
    """The ``q``-quantile (0 ≤ q ≤ 1) of a histogram's cumulative ``buckets``, as Prometheus'
    ``histogram_quantile`` estimates it: find the bucket holding the rank ``q × count``, interpolate
    linearly within it (the first bucket starts at 0); a rank in the +Inf bucket gives the highest finite
    bound. None when there is nothing to estimate from: no observations, or no finite bucket.

    Unlike Prometheus (which returns NaN), the answer is clamped to its bucket's bounds, so rounding never
    makes it step outside them, and it never decreases as ``q`` grows.
    """
    if not 0.0 <= q <= 1.0 or math.isnan(q):
        raise ValueError(f"quantile must be within [0, 1], got {q}")
    merged: dict[float, float] = {}
    for bound, count in buckets:  # the same bound twice (several label sets summed by the caller) adds up
        merged[bound] = merged.get(bound, 0.0) + count
    ordered = sorted(merged.items())
    if len(ordered) < 2 or not math.isinf(ordered[-1][0]) or ordered[-1][0] < 0:
        return None
    # Cumulative counts never go down; scrapes taken mid-update can say otherwise (Prometheus fixes it so too).
    fixed: list[Bucket] = []
    highest = 0.0
    for bound, count in ordered:
        highest = max(highest, count)
        fixed.append((bound, highest))
    observations = fixed[-1][1]
    if observations <= 0:
        return None
    rank = q * observations
    # The first bucket reaching the rank; for q = 0, the first holding any observation (where Prometheus
    # divides 0 by 0 when that is not the first bucket).
    index = next(i for i, (_, count) in enumerate(fixed) if i == len(fixed) - 1 or (count >= rank and count > 0))
    if index == len(fixed) - 1:  # in the +Inf bucket: the highest finite bound is all that is known
        return fixed[-2][0]
    end, count = fixed[index]
    if index == 0 and end <= 0:
        return end
    start = 0.0
    if index > 0:
        start, below = fixed[index - 1]
        count -= below
        rank -= below
    if count <= 0:  # not reached (the bucket holds observations); kept against division by zero
        return start
    return min(max(start + (end - start) * (rank / count), start), end)
