"""Pools of upstream servers: round-robin over healthy members, and the health check that moves
members out of rotation and back.

A member is out of rotation from the moment a leg cannot reach it (no request waits for the next
check to learn that) and back once ``GET /health`` answers 200 again. A pool with no healthy member
raises :class:`PoolUnavailable`, whose message names the pool and why each member is out, so a
client sees which part of the topology is down instead of waiting on it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import httpx

logger = logging.getLogger("pdserve.proxy")


class PoolUnavailable(Exception):
    """No member of a pool can take a request (the client gets a 503 naming the pool)."""


@dataclass
class Member:
    url: str
    healthy: bool = False
    reason: str = "not checked yet"
    model: str | None = None  # the model its /v1/models names, once known


class Pool:
    """One role's servers (render, prefill or decode), picked round-robin among the healthy ones."""

    def __init__(self, name: str, urls: Sequence[str], on_change: Callable[[Pool, Member], None] | None = None):
        if not urls:
            raise ValueError(f"the {name} pool needs at least one URL")
        self.name = name
        self.members = [Member(url.rstrip("/")) for url in urls]
        self._next = 0
        self._on_change = on_change

    def pick(self, exclude: Collection[str] = ()) -> Member:
        """The next healthy member after the last one picked (skipping ``exclude``d URLs)."""
        count = len(self.members)
        for step in range(count):
            k = (self._next + step) % count
            member = self.members[k]
            if member.healthy and member.url not in exclude:
                self._next = k + 1
                return member
        raise PoolUnavailable(self.unavailable_message())

    def unavailable_message(self) -> str:
        states = "; ".join(f"{m.url}: {m.reason}" for m in self.members)
        return f"no healthy server in the {self.name} pool ({states})"

    @property
    def any_healthy(self) -> bool:
        return any(m.healthy for m in self.members)

    @property
    def model(self) -> str | None:
        return next((m.model for m in self.members if m.model is not None), None)

    def mark_down(self, member: Member, reason: str) -> None:
        self._set(member, False, reason)

    def mark_up(self, member: Member) -> None:
        self._set(member, True, "healthy")

    def _set(self, member: Member, healthy: bool, reason: str) -> None:
        changed = member.healthy != healthy
        member.healthy, member.reason = healthy, reason
        if changed:
            if healthy:
                logger.warning("pdserve proxy: %s server %s is in rotation", self.name, member.url)
            else:
                logger.warning("pdserve proxy: %s server %s is out of rotation: %s", self.name, member.url, reason)
        if self._on_change is not None:
            self._on_change(self, member)


async def check_member(pool: Pool, member: Member, client: httpx.AsyncClient, timeout_s: float) -> None:
    """One ``GET /health`` (and, the first time it is up, ``GET /v1/models`` for the model name)."""
    try:
        response = await client.get(member.url + "/health", timeout=timeout_s)
    except httpx.HTTPError as e:
        pool.mark_down(member, f"unreachable ({type(e).__name__})")
        return
    if response.status_code != 200:
        pool.mark_down(member, f"/health answered {response.status_code}")
        return
    if member.model is None:
        member.model = await _model_name(client, member.url, timeout_s)
    pool.mark_up(member)


async def _model_name(client: httpx.AsyncClient, url: str, timeout_s: float) -> str | None:
    try:
        data = (await client.get(url + "/v1/models", timeout=timeout_s)).json()["data"]
        return str(data[0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None  # asked again at the next check


async def check_pools(pools: Sequence[Pool], client: httpx.AsyncClient, timeout_s: float) -> None:
    await asyncio.gather(*(check_member(p, m, client, timeout_s) for p in pools for m in p.members))


async def health_loop(pools: Sequence[Pool], client: httpx.AsyncClient, interval_s: float, timeout_s: float) -> None:
    """Check every member every ``interval_s`` until cancelled."""
    while True:
        await asyncio.sleep(interval_s)
        await check_pools(pools, client, timeout_s)
