"""Clients reuse request ids (retries, RL pipelines): two requests with one id both complete, each answers
with the client's id, and neither one's cleanup aborts the other; an abort by the id reaches both."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from tests.serverproc import ServerProcess
from tests.sse import parse_sse
from tests.waiting import wait_metric, wait_until

PROMPT = [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]
GENERATE = "/inference/v1/generate"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess("serve", "--engine", "scripted", "--step-ms", "20", "--max-num-seqs", "8") as srv:
        yield srv


def body(max_tokens: int, stream: bool) -> dict:
    return {"token_ids": PROMPT, "stream": stream,
            "sampling_params": {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}}


async def stream(client: httpx.AsyncClient, url: str, payload: dict, headers: dict) -> tuple[list[dict], bool]:
    async with client.stream("POST", url + GENERATE, json=payload, headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        return parse_sse([line async for line in r.aiter_lines()])


@pytest.mark.parametrize("header", [True, False])
def test_two_requests_with_one_id_both_complete(server: ServerProcess, header: bool) -> None:
    async def go() -> None:
        rid = "reused-" + str(header)
        headers = {"x-request-id": rid} if header else {}
        short = {**body(5, stream=True), **({} if header else {"request_id": rid})}
        long = {**body(30, stream=True), **({} if header else {"request_id": rid})}
        batch = {**body(12, stream=False), **({} if header else {"request_id": rid})}
        async with httpx.AsyncClient(timeout=60) as client:
            (a, a_done), (b, b_done), c = await asyncio.gather(
                stream(client, server.url, long, headers), stream(client, server.url, short, headers),
                client.post(server.url + GENERATE, json=batch, headers=headers),
            )
        assert a_done and b_done and c.status_code == 200, c.text
        for events, n in ((a, 30), (b, 5)):
            assert sum(len(ch["token_ids"]) for e in events for ch in e["choices"]) == n
            assert events[-1]["choices"][0]["finish_reason"] == "length"
            assert {e["request_id"] for e in events} == {"generate-tokens-" + rid}
        assert c.json()["request_id"] == "generate-tokens-" + rid
        assert len(c.json()["choices"][0]["token_ids"]) == 12

    asyncio.run(go())


def test_an_abort_by_the_client_id_reaches_every_request_carrying_it(server: ServerProcess) -> None:
    async def go() -> list[tuple[list[dict], bool]]:
        async with httpx.AsyncClient(timeout=60) as client:
            payload = {**body(2000, stream=True), "request_id": "both"}
            streams = [asyncio.ensure_future(stream(client, server.url, payload, {})) for _ in range(2)]
            await asyncio.to_thread(wait_until, lambda: server.metric("pdserve_engine_running_requests") == 2,
                                    "both requests running")
            r = await client.post(server.url + "/abort_requests", json={"request_ids": ["generate-tokens-both"]})
            assert r.status_code == 200
            return await asyncio.gather(*streams)

    for events, done in asyncio.run(go()):
        assert done and events[-1]["choices"][0]["finish_reason"] == "abort"
    wait_metric(server, "pdserve_engine_running_requests", 0)
