"""The decode pool's admission: a member joins only when it serves the output modes the proxy's mode sends
it, and a refusal names the member and the fix.

The members here are stand-ins (``httpx.MockTransport``) answering as real servers do: pdserve echoes the
mode, vLLM 0.32 serves ``text`` and answers ``derender`` with a 400, a generate server older than 0.32
ignores the field and answers ``tokens``. tests/e2e/test_proxy.py starts the proxy against a real server
that refuses.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from pdserve.proxy import pool as pool_module
from pdserve.proxy.flow import decode_modes
from pdserve.proxy.pool import Pool, check_pools
from pdserve.proxy.server import decode_admission

PDSERVE, VLLM_032, OLD = "http://pdserve", "http://vllm032", "http://old"


class Members:
    """Stand-in members, counting the probes each gets."""

    def __init__(self) -> None:
        self.probes: list[tuple[str, str]] = []
        self.down: set[str] = set()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host = f"http://{request.url.host}"
        if host in self.down:
            raise httpx.ConnectError("refused", request=request)
        if request.url.path == "/health":
            return httpx.Response(200)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        body = json.loads(request.content)
        mode = body["output_mode"]
        self.probes.append((host, mode))
        assert body["sampling_params"] == {"max_tokens": 1} and body["stream"] is False
        choice = {"index": 0, "token_ids": [7], "finish_reason": "length"}
        if host == VLLM_032 and mode == "derender":
            return httpx.Response(400, json={"error": {"message": "output_mode 'derender' is not supported"}})
        if host == OLD:
            return httpx.Response(200, json={"request_id": "x", "choices": [choice]})
        return httpx.Response(200, json={"request_id": "x", "output_mode": mode, "choices": [choice]})

    def check(self, pool: Pool) -> None:
        async def run() -> None:
            async with httpx.AsyncClient(transport=httpx.MockTransport(self)) as client:
                await check_pools([pool], client, 1.0)

        asyncio.run(run())


def test_inline_needs_derender_and_text_and_the_tier_only_tokens() -> None:
    assert decode_modes("inline") == ("derender", "text")
    assert decode_modes("derender-tier") == ("tokens",)


def test_inline_admits_only_members_that_serve_its_modes_and_names_the_fix() -> None:
    members = Members()
    pool = Pool("decode", [PDSERVE, VLLM_032, OLD], admit=decode_admission("inline"))
    members.check(pool)
    assert [m.healthy for m in pool.members] == [True, False, False]
    assert [pool.pick().url for _ in range(2)] == [PDSERVE, PDSERVE]
    refused = dict(zip([VLLM_032, OLD], pool.refusals))
    assert f"decode server {VLLM_032}: {VLLM_032}/inference/v1/generate answered 400 to output_mode='derender'" \
        in refused[VLLM_032]
    assert "ignores output_mode='derender'" in refused[OLD]
    for line in refused.values():
        assert "--mode derender-tier" in line and "--mode inline sends decode legs in output_mode derender and text" \
            in line
    assert pool.members[1].reason.startswith("refused: ")


def test_derender_tier_asks_nothing_of_its_members() -> None:
    members = Members()
    pool = Pool("decode", [VLLM_032, OLD], admit=decode_admission("derender-tier"))
    members.check(pool)
    assert all(m.healthy for m in pool.members) and members.probes == []


def test_a_member_is_asked_when_it_joins_not_at_every_check() -> None:
    members = Members()
    pool = Pool("decode", [PDSERVE], admit=decode_admission("inline"))
    for _ in range(3):
        members.check(pool)
    assert members.probes == [(PDSERVE, "derender"), (PDSERVE, "text")]
    members.down.add(PDSERVE)  # it went away; whatever answers at its address next is asked again
    members.check(pool)
    members.down.clear()
    members.check(pool)
    assert members.probes == [(PDSERVE, "derender"), (PDSERVE, "text")] * 2 and pool.members[0].healthy


def test_a_refused_member_is_asked_again_only_after_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(pool_module.time, "monotonic", lambda: now[0])
    members = Members()
    pool = Pool("decode", [VLLM_032], admit=decode_admission("inline"))
    members.check(pool)
    members.check(pool)
    assert members.probes == [(VLLM_032, "derender")] and not pool.members[0].healthy
    now[0] += pool_module.REFUSED_RECHECK_S
    members.check(pool)
    assert members.probes == [(VLLM_032, "derender")] * 2 and not pool.members[0].healthy
