"""The one client-disconnect race (pdserve.web.disconnect), as the server and the proxy use it."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.web.disconnect import ClientGone, unless_disconnected, until_disconnect


def _receive(messages: list[dict], then_wait: bool = False):  # type: ignore[no-untyped-def]
    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        if then_wait:
            await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    return receive


def test_until_disconnect_reads_past_the_request_messages() -> None:
    msgs = [{"type": "http.request", "body": b"x", "more_body": False}]
    asyncio.run(until_disconnect(_receive(msgs)))
    assert msgs == []


def test_work_that_finishes_first_gives_its_result() -> None:
    async def work() -> int:
        return 7

    assert asyncio.run(unless_disconnected(_receive([], then_wait=True), work())) == 7


def test_work_errors_propagate() -> None:
    async def work() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError):
        asyncio.run(unless_disconnected(_receive([], then_wait=True), work()))


def test_a_client_that_leaves_cancels_the_work_and_raises_client_gone() -> None:
    cleaned: list[str] = []

    async def work() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            cleaned.append("aborted")

    with pytest.raises(ClientGone):
        asyncio.run(unless_disconnected(_receive([]), work()))
    assert cleaned == ["aborted"]  # the work's cleanup ran before ClientGone was raised
