"""Pools of upstream servers: round-robin over healthy members, and the health check that moves
members out of rotation and back.

A member is out of rotation from the moment a leg cannot reach it (no request waits for the next
check to learn that) and back once ``GET /health`` answers 200 again. A pool may also ask a member
that joins (healthy for the first time, or again after it was out) whether it can take the pool's
requests at all (:attr:`Pool.admit`: the decode pool asks for the output modes the proxy's mode needs);
a member it refuses stays out of rotation with the refusal as its reason, asked again every
:data:`REFUSED_RECHECK_S` (a restart with the right flags brings it in). A pool with no healthy member
raises :class:`PoolUnavailable`, whose message names the pool and why each member is out, so a
client sees which part of the topology is down instead of waiting on it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass

import httpx

logger = logging.getLogger("pdserve.proxy")


# How often a refused member (one that answers /health but cannot take the pool's requests) is asked again.
REFUSED_RECHECK_S = 30.0
# Bound on one admission question (a one-token request to a member that may be busy with others).
ADMIT_TIMEOUT_S = 60.0

# Asked of a joining member: why it cannot take the pool's requests, or None. An httpx.HTTPError means
# the member could not be asked (it is down, not refused).
Admission = Callable[[httpx.AsyncClient, "Member"], Awaitable[str | None]]


class PoolUnavailable(Exception):
    """No member of a pool can take a request (the client gets a 503 naming the pool)."""


@dataclass
class Member:
    url: str
    healthy: bool = False
    reason: str = "not checked yet"
    model: str | None = None  # the model its /v1/models names, once known
    refusal: str | None = None  # why the pool's admission refused it (it answers /health, yet stays out)
    refused_at: float = 0.0


class Pool:
    """One role's servers (render, prefill or decode), picked round-robin among the healthy ones."""

    def __init__(self, name: str, urls: Sequence[str], on_change: Callable[[Pool, Member], None] | None = None,
                 admit: Admission | None = None):
        if not urls:
            raise ValueError(f"the {name} pool needs at least one URL")
        self.name = name
        self.members = [Member(url.rstrip("/")) for url in urls]
        self._next = 0
        self._on_change = on_change
        self.admit = admit

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

    @property
    def refusals(self) -> list[str]:
        """Why each refused member is out (see :attr:`admit`)."""
        return [f"{self.name} server {m.url}: {m.refusal}" for m in self.members if m.refusal is not None]

    def mark_down(self, member: Member, reason: str) -> None:
        member.refusal = None  # down: whatever answers next is asked again at once
        self._set(member, False, reason)

    def refuse(self, member: Member, reason: str) -> None:
        """Out of rotation although it answers /health: it cannot take this pool's requests."""
        if member.refusal != reason:
            logger.error("pdserve proxy: %s server %s is refused: %s", self.name, member.url, reason)
        member.refusal, member.refused_at = reason, time.monotonic()
        self._set(member, False, f"refused: {reason}")

    def mark_up(self, member: Member) -> None:
        member.refusal = None
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
    """One ``GET /health`` (and, the first time it is up, ``GET /v1/models`` for the model name); a
    member that joins is asked the pool's admission question first."""
    try:
        response = await client.get(member.url + "/health", timeout=timeout_s)
        if response.status_code != 200:
            pool.mark_down(member, f"/health answered {response.status_code}")
            return
        if not member.healthy and pool.admit is not None:
            if member.refusal is not None and time.monotonic() - member.refused_at < REFUSED_RECHECK_S:
                return
            refusal = await pool.admit(client, member)
            if refusal is not None:
                pool.refuse(member, refusal)
                return
    except httpx.HTTPError as e:
        pool.mark_down(member, f"unreachable ({type(e).__name__})")
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
