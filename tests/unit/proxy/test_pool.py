"""The less busy of two random healthy members, Retry-After respected, and the health check that moves members
out and back."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.proxy import pool as pool_module
from pdserve.proxy.pool import Pool, PoolUnavailable, check_pools

URLS = [f"http://m{i}" for i in range(4)]


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5)), min_size=1, max_size=len(URLS)).filter(lambda ms: any(h for h, _ in ms)),
       st.integers(0, 2**32))
def test_the_pick_is_healthy_and_never_the_busier_of_the_two_drawn(members: list[tuple[bool, int]], seed: int) -> None:
    pool = Pool("decode", URLS[: len(members)], rng=random.Random(seed))
    for member, (ok, in_flight) in zip(pool.members, members):
        (pool.mark_up if ok else lambda m: pool.mark_down(m, "down"))(member)
        member.in_flight = in_flight
    healthy = [m for m in pool.members if m.healthy]
    picked = pool.pick()
    assert picked.healthy
    if len(healthy) == 2:  # both are drawn: the less busy one wins
        assert picked.in_flight == min(m.in_flight for m in healthy)
    if len(healthy) > 1:  # never the one busiest member
        busiest = max(m.in_flight for m in healthy)
        assert picked.in_flight < busiest or sum(m.in_flight == busiest for m in healthy) > 1


def test_equal_loads_spread_over_every_member_and_a_slow_one_gets_less() -> None:
    pool = Pool("decode", URLS, rng=random.Random(7))
    for member in pool.members:
        pool.mark_up(member)
    picks = Counter(pool.pick().url for _ in range(400))
    assert set(picks) == set(URLS) and min(picks.values()) > 50
    # One member holds requests that do not finish (a slow host): the others share what comes next.
    slow = pool.members[0]
    for _ in range(3):
        pool.sent(slow)
    picks = Counter()
    for _ in range(300):
        member = pool.pick()
        picks[member.url] += 1
        if member is not slow:
            pool.sent(member)
            pool.answered(member)
    assert picks[slow.url] < 300 / len(URLS) / 3, picks


@given(st.lists(st.booleans(), min_size=1, max_size=len(URLS)).filter(any), st.integers(1, 20))
def test_round_robin_visits_every_healthy_member_in_turn_whatever_their_load(health: list[bool], picks: int) -> None:
    pool = Pool("decode", URLS[: len(health)], routing="round-robin")
    for member, ok in zip(pool.members, health):
        (pool.mark_up if ok else lambda m: pool.mark_down(m, "down"))(member)
        pool.sent(member)  # load does not steer round-robin
    healthy = [m.url for m, ok in zip(pool.members, health) if ok]
    assert [pool.pick().url for _ in range(picks)] == [healthy[i % len(healthy)] for i in range(picks)]


def test_an_unknown_routing_is_refused() -> None:
    with pytest.raises(ValueError, match="routing must be one of p2c, round-robin"):
        Pool("decode", URLS, routing="random")


def test_a_member_that_asked_to_be_left_alone_is_skipped_until_then(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(pool_module.time, "monotonic", lambda: now[0])
    pool = Pool("decode", URLS[:2], rng=random.Random(1))
    for member in pool.members:
        pool.mark_up(member)
    pool.back_off(pool.members[0], 5.0)
    assert {pool.pick().url for _ in range(20)} == {URLS[1]}
    pool.back_off(pool.members[1], 2.0)
    with pytest.raises(PoolUnavailable, match="asked to be retried later") as e:
        pool.pick()
    assert e.value.retry_after_s == pytest.approx(2.0)
    now[0] += 5.0
    assert {pool.pick().url for _ in range(20)} == set(URLS[:2])


def test_no_healthy_member_names_the_pool_and_why() -> None:
    pool = Pool("prefill", URLS[:2])
    pool.mark_up(pool.members[0])
    pool.mark_down(pool.members[1], "unreachable (ConnectError)")
    with pytest.raises(PoolUnavailable, match=r"prefill pool .*http://m1: unreachable \(ConnectError\)"):
        pool.pick(exclude={URLS[0]})
    pool.mark_down(pool.members[0], "/health answered 503")
    with pytest.raises(PoolUnavailable, match="http://m0: /health answered 503"):
        pool.pick()


def test_an_empty_pool_is_refused() -> None:
    with pytest.raises(ValueError, match="render pool needs at least one URL"):
        Pool("render", [])


def test_the_health_check_takes_members_out_and_back() -> None:
    status = {"http://m0": 200, "http://m1": 503}
    refused: set[str] = set()

    def handler(request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}"
        if base in refused:
            raise httpx.ConnectError("refused", request=request)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        return httpx.Response(status[base])

    changes: list[tuple[str, bool]] = []
    pool = Pool("decode", list(status), on_change=lambda p, m: changes.append((m.url, m.healthy)))

    async def check() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await check_pools([pool], client, 1.0)

    asyncio.run(check())
    assert [m.healthy for m in pool.members] == [True, False] and pool.model == "m"
    assert pool.members[1].reason == "/health answered 503"
    refused.add("http://m0")
    status["http://m1"] = 200
    asyncio.run(check())
    assert [m.healthy for m in pool.members] == [False, True]
    assert pool.members[0].reason == "unreachable (ConnectError)"
    assert [p.url for p in (pool.pick(), pool.pick())] == ["http://m1", "http://m1"]
    assert set(changes[-2:]) == {("http://m0", False), ("http://m1", True)}
