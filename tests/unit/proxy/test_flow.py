"""The orchestration over mocked servers (httpx.MockTransport): what each leg receives, and how upstream
failures reach the client. Real servers: tests/e2e/test_proxy.py."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import httpx
import pytest

from pdserve.proxy.flow import Orchestrator
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.pool import Pool
from pdserve.proxy.upstream import UpstreamError

RENDERED = {
    "request_id": "chatcmpl-rid", "token_ids": [1, 2, 3], "model": None, "stream": True,
    "sampling_params": {"max_tokens": 5, "min_tokens": 2, "stop": ["x"], "logprobs": 1},
    "parse_context": {"tools": None, "tool_choice": "none"}, "stream_options": {"include_usage": True},
}
KV = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_block_ids": [[4, 5]], "remote_request_id": "r"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def sse(*events: Any, done: bool = True) -> bytes:
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events)
    return (body + ("data: [DONE]\n\n" if done else "")).encode()


def chunk(**choice: Any) -> dict[str, Any]:
    return {"request_id": "generate-tokens-rid", "output_mode": "derender", "choices": [{"index": 0, **choice}]}


class Upstreams:
    """Mock render/prefill/decode servers that record what each received (``busy``: hosts that answer 503
    with ``Retry-After: 3``, as a draining or overloaded server does)."""

    def __init__(self, decode_stream: bytes, refused: set[str] = frozenset(),  # type: ignore[assignment]
                 busy: set[str] = frozenset(), streams: dict[str, bytes] | None = None,  # type: ignore[assignment]
                 rendered: dict[str, Any] = RENDERED, dropping: set[str] = frozenset()):  # type: ignore[assignment]
        self.seen: list[tuple[str, dict[str, str], Any]] = []
        self.decode_stream = decode_stream
        self.streams = streams or {}  # a decode host's own stream, else decode_stream
        self.rendered = rendered
        self.dropping = dropping  # hosts that take the request, then drop the connection (they died)
        self.refused = refused
        self.busy = busy

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host in self.refused:
            raise httpx.ConnectError("refused", request=request)
        if host in self.busy:
            self.seen.append((host, dict(request.headers), None))
            error = {"error": {"message": "draining", "type": "ServiceUnavailableError", "param": None, "code": 503}}
            return httpx.Response(503, json=error, headers={"retry-after": "3"})
        body = json.loads(request.content) if request.content else None
        self.seen.append((host, dict(request.headers), body))
        if host in self.dropping:
            raise httpx.RemoteProtocolError("peer closed connection", request=request)
        if request.url.path.endswith("/render"):
            return httpx.Response(200, json=self.rendered)
        if host.startswith("prefill"):
            return httpx.Response(200, json={"request_id": "x", "choices": [], "kv_transfer_params": KV})
        stream = self.streams.get(host, self.decode_stream)
        return httpx.Response(200, content=stream, headers={"content-type": "text/event-stream"})


# A seed whose first draw of two members is the first member: the pool tries the members in their order.
IN_ORDER = next(seed for seed in range(100) if random.Random(seed).sample([0, 1], 2)[0] == 0)


def run(upstreams: Upstreams, decode_hosts: tuple[str, ...] = ("decode",),
        metrics: ProxyMetrics | None = None, prefill_hosts: tuple[str, ...] = ("prefill",)
        ) -> tuple[list[str], Orchestrator]:
    metrics = metrics or ProxyMetrics()

    async def go() -> tuple[list[str], Orchestrator]:
        client = httpx.AsyncClient(transport=httpx.MockTransport(upstreams))
        pools = [Pool(name, [f"http://{h}" for h in hosts], on_change=metrics.member_changed,
                      on_error=metrics.member_failed, rng=random.Random(IN_ORDER))
                 for name, hosts in (("render", ("render",)), ("prefill", prefill_hosts), ("decode", decode_hosts))]
        for pool in pools:
            for member in pool.members:
                pool.mark_up(member)
        orch = Orchestrator(client, *pools, "inline", metrics)
        prepared = await orch.prepare("chat", CHAT, "rid")
        stream = await orch.open_stream(prepared)
        events = [e async for e in orch.events(prepared, stream)]
        await client.aclose()
        assert all(m.in_flight == 0 for pool in pools for m in pool.members)  # every leg answered or closed
        return events, orch

    return asyncio.run(go())


def present(delta: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in delta.items() if v is not None}


def payloads(events: list[str]) -> list[Any]:
    assert events[-1] == "data: [DONE]\n\n"
    return [json.loads(e[len("data: "):]) for e in events[:-1]]


def test_every_leg_carries_the_request_id_and_the_decode_leg_the_prefills_params() -> None:
    upstreams = Upstreams(sse(chunk(delta={"role": "assistant", "content": "hi"}), chunk(delta={}, token_ids=[7]),
                              chunk(delta={"content": "!"}, finish_reason="stop")))
    events = payloads(run(upstreams)[0])
    assert [(host, headers["x-request-id"]) for host, headers, _ in upstreams.seen] == \
        [("render", "rid"), ("prefill", "rid"), ("decode", "rid")]
    prefill, decode = upstreams.seen[1][2], upstreams.seen[2][2]
    assert prefill["kv_transfer_params"] == {"do_remote_decode": True} and prefill["sampling_params"]["max_tokens"] == 1
    assert decode["kv_transfer_params"] == KV and decode["output_mode"] == "derender"
    assert decode["sampling_params"] == RENDERED["sampling_params"] and decode["parse_context"] == RENDERED["parse_context"]
    # The role opens the stream on its own; the step with nothing for the client is left out.
    assert [present(e["choices"][0]["delta"]) for e in events] == [{"role": "assistant", "content": ""}, {"content": "hi"},
                                                           {"content": "!"}]
    assert {e["id"] for e in events} == {"chatcmpl-rid"} and events[-1]["choices"][0]["finish_reason"] == "stop"


def test_tool_call_deltas_and_usage_are_relayed() -> None:
    call = {"index": 0, "id": "call-1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    upstreams = Upstreams(sse(chunk(delta={"role": "assistant", "tool_calls": [call]}, finish_reason="tool_calls"),
                              {"request_id": "x", "output_mode": "derender", "choices": [], "usage": usage}))
    events = payloads(run(upstreams)[0])
    assert present(events[1]["choices"][0]["delta"]) == {"tool_calls": [call]}
    assert events[-1]["choices"] == [] and events[-1]["usage"] == usage
    assert events[-1]["object"] == "chat.completion.chunk"


def test_an_upstream_error_event_is_relayed_then_done() -> None:
    """A 5xx error event of a stream that cannot move (RENDERED has stop strings) says why it did not."""
    error = {"error": {"message": "engine error: boom", "type": "InternalServerError", "param": None, "code": 500}}
    events = payloads(run(Upstreams(sse(chunk(delta={"content": "a"}, token_ids=[7]), error)))[0])
    assert len(events) == 3 and events[-1]["error"]["code"] == 500
    assert events[-1]["error"]["message"] == ("engine error: boom (not moved to another decode member: it cannot be "
                                              "resumed exactly: stop strings (the text sent runs ahead of the ids sent))")


def test_a_4xx_error_event_is_about_the_request_and_relayed_as_it_is() -> None:
    error = {"error": {"message": "no", "type": "BadRequestError", "param": "x", "code": 400}}
    events = payloads(run(Upstreams(b"", streams={"d0": sse(error)}, rendered=RESUMABLE), ("d0", "d1"))[0])
    assert events[-1] == error


RESUMABLE = RENDERED | {"sampling_params": {"max_tokens": 5, "min_tokens": 2, "logprobs": 1, "prompt_logprobs": 1}}


def test_a_broken_decode_leg_moves_to_another_member_with_the_output_so_far() -> None:
    metrics = ProxyMetrics()
    first = sse(chunk(delta={"role": "assistant", "content": "a"}, token_ids=[7]),
                chunk(delta={"content": "bc"}, token_ids=[8, 9]), done=False)
    rest = sse(chunk(delta={"content": "d"}, token_ids=[10], finish_reason="length"))
    upstreams = Upstreams(b"", streams={"d0": first, "d1": rest}, rendered=RESUMABLE)
    events = payloads(run(upstreams, ("d0", "d1"), metrics)[0])
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == "abcd"
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    host, _, body = upstreams.seen[-1]
    assert host == "d1" and body["token_ids"] == [1, 2, 3, 7, 8, 9] and body["prior_output_chunks"] == [1, 2]
    assert body["kv_transfer_params"] is None and body["output_mode"] == "derender"
    assert body["sampling_params"] == {"max_tokens": 2, "min_tokens": 0, "logprobs": 1, "prompt_logprobs": None}
    assert metrics.registry.get_sample_value(
        "pdserve_proxy_migrations_total", {"cause": "truncated", "outcome": "moved"}) == 1


def test_a_stream_moves_at_most_migration_limit_times() -> None:
    broken = sse(chunk(delta={"content": "a"}, token_ids=[7]), done=False)
    upstreams = Upstreams(b"", streams={"d0": broken, "d1": broken}, rendered=RESUMABLE)
    events = payloads(run(upstreams, ("d0", "d1"))[0])
    message = events[-1]["error"]["message"]
    assert "http://d1 ended the stream without [DONE]" in message and "--migration-limit 1" in message


def test_with_no_other_member_the_error_says_the_move_failed() -> None:
    upstreams = Upstreams(b"", streams={"d0": sse(chunk(delta={"content": "a"}, token_ids=[7]), done=False)},
                          rendered=RESUMABLE)
    message = payloads(run(upstreams, ("d0",))[0])[-1]["error"]["message"]
    assert "ended the stream without [DONE]" in message and "moving it to another decode member failed" in message


def test_a_stream_that_breaks_off_is_an_error_event_naming_the_member() -> None:
    events, _ = run(Upstreams(sse(chunk(delta={"content": "a"}), done=False)))
    message = payloads(events)[-1]["error"]["message"]
    assert "decode server http://decode ended the stream without [DONE]" in message


def test_a_prefill_member_that_dies_mid_request_is_replaced_once() -> None:
    metrics = ProxyMetrics()
    upstreams = Upstreams(sse(chunk(delta={"content": "a"}, finish_reason="stop")), dropping={"prefill0"})
    events, _ = run(upstreams, metrics=metrics, prefill_hosts=("prefill0", "prefill1"))
    assert payloads(events)[-1]["choices"][0]["finish_reason"] == "stop"
    assert [host for host, _, _ in upstreams.seen][1:3] == ["prefill0", "prefill1"]
    assert metrics.registry.get_sample_value("pdserve_proxy_retries_total", {"leg": "prefill"}) == 1


def test_a_decode_member_that_dies_before_the_first_byte_is_replaced_without_the_kv() -> None:
    metrics = ProxyMetrics()
    upstreams = Upstreams(sse(chunk(delta={"content": "a"}, finish_reason="stop")), dropping={"d0"},
                          rendered=RESUMABLE)
    events, _ = run(upstreams, ("d0", "d1"), metrics)
    assert payloads(events)[-1]["choices"][0]["finish_reason"] == "stop"
    (first, _, sent), (second, _, resent) = upstreams.seen[-2:]
    assert (first, second) == ("d0", "d1") and sent["kv_transfer_params"] == KV
    assert resent["kv_transfer_params"] is None and "prior_output_chunks" not in resent
    assert metrics.registry.get_sample_value("pdserve_proxy_retries_total", {"leg": "decode"}) == 1


def test_a_refused_member_is_skipped_and_taken_out_of_rotation() -> None:
    metrics = ProxyMetrics()
    upstreams = Upstreams(sse(chunk(delta={"content": "a"}, finish_reason="stop")), refused={"d0"})
    events, orch = run(upstreams, ("d0", "d1"), metrics)
    assert payloads(events)[-1]["choices"][0]["finish_reason"] == "stop"
    assert [host for host, _, _ in upstreams.seen][-1] == "d1"
    assert [(m.url, m.healthy) for m in orch.decode.members] == [("http://d0", False), ("http://d1", True)]
    assert metrics.registry.get_sample_value(
        "pdserve_proxy_member_errors_total", {"pool": "decode", "url": "http://d0", "cause": "unreachable"}) == 1


def test_a_503_goes_to_another_member_which_is_left_alone_for_its_retry_after() -> None:
    metrics = ProxyMetrics()
    upstreams = Upstreams(sse(chunk(delta={"content": "a"}, finish_reason="stop")), busy={"d0"})
    events, orch = run(upstreams, ("d0", "d1"), metrics)
    assert payloads(events)[-1]["choices"][0]["finish_reason"] == "stop"
    assert [host for host, _, _ in upstreams.seen][-2:] == ["d0", "d1"]
    d0 = orch.decode.members[0]
    assert d0.healthy and d0.retry_at > 0  # in rotation, but not asked again for 3 s
    assert orch.decode.pick().url == "http://d1"
    errors = metrics.registry.get_sample_value(
        "pdserve_proxy_member_errors_total", {"pool": "decode", "url": "http://d0", "cause": "status_503"})
    assert errors == 1


def test_when_every_member_is_busy_the_last_503_is_relayed_with_its_retry_after() -> None:
    with pytest.raises(UpstreamError) as e:
        run(Upstreams(b"", busy={"d0", "d1"}), ("d0", "d1"))
    assert e.value.status == 503 and e.value.body["error"]["message"] == "draining"
    assert e.value.headers == {"retry-after": "3"}


def test_a_dead_pool_is_a_503_naming_it() -> None:
    upstreams = Upstreams(b"", refused={"prefill"})
    with pytest.raises(UpstreamError) as e:
        run(upstreams)
    assert e.value.status == 503
    assert e.value.body["error"]["message"] == \
        "no healthy server in the prefill pool (http://prefill: unreachable (ConnectError))"


def test_an_upstream_4xx_keeps_its_status_and_body() -> None:
    error = {"error": {"message": "bad tool_choice", "type": "BadRequestError", "param": "tool_choice", "code": 400}}

    class Refusing(Upstreams):
        def __call__(self, request: httpx.Request) -> httpx.Response:
            return httpx.Response(400, json=error)

    with pytest.raises(UpstreamError) as e:
        run(Refusing(b""))
    assert (e.value.status, e.value.body) == (400, error)


def test_a_bug_in_the_proxy_is_an_error_object_naming_it_not_a_bare_page() -> None:
    """The fleet soak once got Starlette's bare ``Internal Server Error`` text from a proxy; whatever raises
    unexpectedly is now an OpenAI error object naming the exception (and the traceback is logged)."""
    from pdserve.proxy.app import create_app

    class Broken(Upstreams):
        def __call__(self, request: httpx.Request) -> httpx.Response:
            if request.url.path.endswith("/render"):
                return httpx.Response(200, json=["not", "a", "rendered", "request"])
            return super().__call__(request)

    async def go() -> httpx.Response:
        client = httpx.AsyncClient(transport=httpx.MockTransport(Broken(sse())))
        pools = [Pool(name, [f"http://{name}"]) for name in ("render", "prefill", "decode")]
        for pool in pools:
            pool.mark_up(pool.members[0])
        app = create_app(Orchestrator(client, *pools, "inline", ProxyMetrics()))
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as front:
            return await front.post("/v1/chat/completions", json=CHAT)

    r = asyncio.run(go())
    assert r.status_code == 500
    error = r.json()["error"]
    assert error["type"] == "InternalServerError" and "pdserve proxy internal error" in error["message"]
