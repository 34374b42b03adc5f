"""Round-robin over healthy members, and the health check that moves members out and back."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.proxy.pool import Pool, PoolUnavailable, check_pools

URLS = [f"http://m{i}" for i in range(4)]


@given(st.lists(st.booleans(), min_size=1, max_size=4).filter(any), st.integers(1, 20))
def test_round_robin_visits_every_healthy_member_in_turn(health: list[bool], picks: int) -> None:
    pool = Pool("decode", URLS[: len(health)])
    for member, ok in zip(pool.members, health):
        (pool.mark_up if ok else lambda m: pool.mark_down(m, "down"))(member)
    healthy = [m.url for m, ok in zip(pool.members, health) if ok]
    got = [pool.pick().url for _ in range(picks)]
    assert got == [healthy[i % len(healthy)] for i in range(picks)]


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
