"""Wait for an observable condition instead of sleeping a fixed time.

A fixed ``sleep()`` is too short on a loaded machine (a flaky test) and too long
everywhere else (a slow one). These helpers poll a predicate until it holds. The
bound only turns a hang into a failure that names the condition; it is generous on
purpose and says nothing about speed (that is measured by the benchmarks).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

import pytest

from tests.serverproc import ServerProcess

T = TypeVar("T")

BOUND_S = 60.0  # the longest any condition is waited for before the test fails
POLL_S = 0.02


Description = str | Callable[[], str]


def _give_up(what: Description, bound_s: float) -> None:
    condition = what() if callable(what) else what
    pytest.fail(f"gave up after {bound_s:.0f}s waiting until {condition}")


def wait_until(predicate: Callable[[], T], what: Description, bound_s: float = BOUND_S) -> T:
    """Poll ``predicate`` until it returns a truthy value, and return that value.

    ``what`` names the condition for the failure message ("the engine runs 1 request");
    a callable is asked at failure time, so it can report the last value seen.
    """
    deadline = time.monotonic() + bound_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            _give_up(what, bound_s)
        time.sleep(POLL_S)
    return value


async def async_wait_until(predicate: Callable[[], T], what: Description, bound_s: float = BOUND_S) -> T:
    """:func:`wait_until` for code on an event loop (the loop keeps running while it waits)."""
    deadline = time.monotonic() + bound_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            _give_up(what, bound_s)
        await asyncio.sleep(POLL_S)
    return value


def wait_metric(srv: ServerProcess, name: str, value: float, missing: float | None = None) -> None:
    """Wait until the server's ``/metrics`` sample ``name`` equals ``value`` (see ``ServerProcess.metric``)."""
    wait_until(
        lambda: srv.metric(name, missing) == value,
        lambda: f"{name} == {value:g} (now {srv.metric(name, missing):g})",
    )
