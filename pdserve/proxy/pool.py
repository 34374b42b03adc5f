"""Pools of upstream servers: least-outstanding requests over two random choices among the healthy
members, and the health check that moves members out of rotation and back.

Why two random choices: round-robin sends a slow member (a loaded host, a slow link) its full share, so its
queue grows while the others idle; picking the member with fewer requests in flight of two drawn at random
steers away from it without every request herding to the one least-loaded member (the "power of two
choices"). A member that answered 503 with ``Retry-After`` (draining, overloaded) is left out until then.
``--routing round-robin`` keeps the old rotation, for comparison and for operators who want it.

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
import random
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass

import httpx

from pdserve.proxy.modes import ROUTINGS

logger = logging.getLogger("pdserve.proxy")


# How often a refused member (one that answers /health but cannot take the pool's requests) is asked again.
REFUSED_RECHECK_S = 30.0
# Bound on one admission question (a one-token request to a member that may be busy with others).
ADMIT_TIMEOUT_S = 60.0

# Asked of a joining member: why it cannot take the pool's requests, or None. An httpx.HTTPError means
# the member could not be asked (it is down, not refused).
Admission = Callable[[httpx.AsyncClient, "Member"], Awaitable[str | None]]


class PoolUnavailable(Exception):
    """No member of a pool can take a request (the client gets a 503 naming the pool; ``retry_after_s``:
    when the first member that asked to be left alone takes requests again, if that is why)."""

    def __init__(self, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class Member:
    url: str
    healthy: bool = False
    reason: str = "not checked yet"
    model: str | None = None  # the model its /v1/models names, once known
    refusal: str | None = None  # why the pool's admission refused it (it answers /health, yet stays out)
    refused_at: float = 0.0
    in_flight: int = 0  # requests sent to it and not yet answered (a stream: until it is closed)
    retry_at: float = 0.0  # monotonic time before which it asked not to be sent requests (Retry-After)


class Pool:
    """One role's servers (render, prefill or decode): the less busy of two healthy members drawn at random
    (``routing="p2c"``), or each healthy member in turn (``"round-robin"``).

    ``on_change`` is told of every change of a member's health or requests in flight, ``on_error`` of every
    failed request with its cause (``unreachable``, ``dropped``, ``status_503``, ...): the proxy's metrics.
    """

    def __init__(self, name: str, urls: Sequence[str], on_change: Callable[[Pool, Member], None] | None = None,
                 admit: Admission | None = None, on_error: Callable[[Pool, Member, str], None] | None = None,
                 rng: random.Random | None = None, routing: str = "p2c"):
        if not urls:
            raise ValueError(f"the {name} pool needs at least one URL")
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, not {routing!r}")
        self.routing = routing
        self._next = 0  # round-robin: where the next turn starts
        self.name = name
        self.members = [Member(url.rstrip("/")) for url in urls]
        self._on_change = on_change
        self._on_error = on_error
        self._rng = rng or random.Random()
        self.admit = admit

    def pick(self, exclude: Collection[str] = ()) -> Member:
        """Of two healthy members drawn at random (skipping ``exclude``d URLs and members inside their
        ``Retry-After``), the one with fewer requests in flight; the first drawn on a tie."""
        healthy = [m for m in self.members if m.healthy and m.url not in exclude]
        now = time.monotonic()
        ready = [m for m in healthy if m.retry_at <= now]
        if not ready:
            if healthy:
                wait = min(m.retry_at for m in healthy) - now
                raise PoolUnavailable(f"every server in the {self.name} pool asked to be retried later "
                                      f"(Retry-After; the first in {wait:.1f}s)", retry_after_s=wait)
            raise PoolUnavailable(self.unavailable_message())
        if self.routing == "round-robin":
            return self._next_in_turn(ready)
        drawn = self._rng.sample(ready, 2) if len(ready) > 1 else ready
        return min(drawn, key=lambda m: m.in_flight)

    def _next_in_turn(self, ready: list[Member]) -> Member:
        """Round-robin: the first ready member at or after the turn's position in the pool's order."""
        count = len(self.members)
        for step in range(count):
            member = self.members[(self._next + step) % count]
            if member in ready:
                self._next = (self._next + step + 1) % count
                return member
        raise AssertionError("ready members are pool members")

    def sent(self, member: Member) -> None:
        """A request went to ``member`` (:meth:`answered` when it is over)."""
        member.in_flight += 1
        self._changed(member)

    def answered(self, member: Member) -> None:
        member.in_flight -= 1
        self._changed(member)

    def failed(self, member: Member, cause: str) -> None:
        """A request to ``member`` failed (counted by cause)."""
        if self._on_error is not None:
            self._on_error(self, member, cause)

    def back_off(self, member: Member, seconds: float) -> None:
        """``member`` asked not to be sent requests for ``seconds`` (503 with Retry-After)."""
        member.retry_at = time.monotonic() + seconds

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
        self._changed(member)

    def _changed(self, member: Member) -> None:
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
