"""``pdserve proxy`` over real servers on loopback: qwen3-tiny on the torch engine with the KV hand-off on,
reasoning and tool parsers on the render and decode servers.

The reference for every answer is the coupled ``/v1/chat/completions`` (``/v1/completions``) of a decode
server itself: the same model and parsers in one process, greedy. Events are compared whole (only the
response id and the creation time may differ), so the proxy's OpenAI shapes are the coupled ones.
Tests that kill a server run last, in file order.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from pdserve.checkpoints.resolve import resolve_model
from tests.serverproc import ServerProcess
from tests.sse import parse_sse
from tests.waiting import wait_metric, wait_until

MODEL = "qwen3-tiny"
PARSERS = ("--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--enable-auto-tool-choice")
KV = ("--kv-transfer", "nixl")
# The engine servers run float32: a decode leg computes its first token in a decode step over the pulled KV,
# the coupled server in its prefill's last row, and in bfloat16 those two kernels round the logits
# differently (by up to one bf16 step, seen ~4e-3 on qwen3-tiny's near-uniform logits): enough to flip a
# near-tied greedy token on some CPUs (tests/e2e/test_kv_handoff.py's docstring). In float32 they agree.
EXACT = ("--dtype", "float32")
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [WEATHER_TOOL], "max_tokens": 12, "temperature": 0, "return_token_ids": True}
COMPLETION = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0,
              "logprobs": 2, "return_token_ids": True}
GENERATED_200 = 'pdserve_requests_total{endpoint="generate",output_mode="%s",status="200"}'


def _proxy(render: ServerProcess, prefill: ServerProcess, decode: list[ServerProcess], mode: str) -> ServerProcess:
    return ServerProcess("proxy", "--render", render.url, "--prefill", prefill.url,
                         "--decode", ",".join(s.url for s in decode), "--mode", mode, "--health-interval-s", "0.2")


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, Any]]:
    """render, a --tokens-only prefill server, two decode servers, one proxy per mode over them."""
    started: list[ServerProcess] = []

    def start(*srvs: ServerProcess) -> list[ServerProcess]:
        started.extend(srvs)
        for srv in srvs:
            srv.spawn()  # all load at once, then wait
        for srv in srvs:
            srv.wait_healthy(120)
        return list(srvs)

    try:
        render, prefill, *decodes = start(
            ServerProcess("launch", "render", "--tokenizer", str(resolve_model(MODEL)), *PARSERS),
            ServerProcess("serve", MODEL, "--tokens-only", *KV, *EXACT),
            ServerProcess("serve", MODEL, *KV, *PARSERS, *EXACT),
            ServerProcess("serve", MODEL, *KV, *PARSERS, *EXACT),
        )
        inline, tier = start(_proxy(render, prefill, decodes, "inline"), _proxy(render, prefill, decodes, "derender-tier"))
        yield {"render": render, "prefill": prefill, "decodes": decodes, "inline": inline, "derender-tier": tier}
    finally:
        for srv in reversed(started):
            srv.stop()


def _events(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A stream's events without what may differ between two answers (id, creation time)."""
    with httpx.stream("POST", url, json=body | {"stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        events, done = parse_sse(list(r.iter_lines()))
    assert done
    return [_same_parts(e) for e in events]


def _same_parts(answer: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in answer.items() if k not in ("id", "created")}


def assert_same(got: Any, want: Any, where: str = "answer") -> None:
    """Equal, except that logprobs may differ by rounding: with the KV hand-off the decode server
    runs the prompt's last position on KV another engine computed, not in its own prompt pass (seen
    in bf16: up to ~4e-3 on qwen3-tiny's near-uniform logits; the servers here run float32, EXACT,
    which keeps the tokens equal). Tokens, text and shapes may not differ."""
    if isinstance(want, float) and isinstance(got, float):
        assert abs(got - want) < 0.05, f"{where}: {got} != {want}"
    elif isinstance(want, dict) and isinstance(got, dict):
        assert got.keys() == want.keys(), f"{where}: keys {sorted(got)} != {sorted(want)}"
        for key in want:
            assert_same(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list) and isinstance(got, list):
        assert len(got) == len(want), f"{where}: {len(got)} items != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def _batch(url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return _same_parts(r.json())


@pytest.mark.parametrize("mode", ["inline", "derender-tier"])
@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)],
                         ids=["chat", "completions"])
def test_answers_equal_the_coupled_server(servers: dict[str, Any], mode: str, path: str, body: dict[str, Any]) -> None:
    proxy, coupled = servers[mode].url + path, servers["decodes"][0].url + path
    want = _batch(coupled, body)
    assert want["choices"][0]["token_ids"] and want["usage"]["completion_tokens"] == 12
    assert_same(_batch(proxy, body), want)
    with_usage = body | {"stream_options": {"include_usage": True}}
    assert_same(_events(proxy, with_usage), _events(coupled, with_usage))


def test_a_stream_interval_reaches_the_decode_leg(servers: dict[str, Any]) -> None:
    # The decode server chunks the stream (the first token, then 4 per chunk) under both proxy modes.
    body = CHAT | {"stream_interval": 4, "max_tokens": 12}
    coupled = _events(servers["decodes"][0].url + "/v1/chat/completions", body)
    assert len([e for e in coupled if e["choices"]]) <= 1 + 1 + 3  # the role, the first token, chunks of 4
    for mode in ("inline", "derender-tier"):
        assert_same(_events(servers[mode].url + "/v1/chat/completions", body), coupled)


def test_n_choices_in_both_modes(servers: dict[str, Any]) -> None:
    body = CHAT | {"n": 2, "max_tokens": 4}
    coupled = servers["decodes"][0].url + "/v1/chat/completions"
    for mode in ("inline", "derender-tier"):
        proxy = servers[mode].url + "/v1/chat/completions"
        assert_same(_batch(proxy, body), _batch(coupled, body))
        assert_same(_events(proxy, body), _events(coupled, body))


def test_openai_sdk_chat_with_tools_and_completions(servers: dict[str, Any]) -> None:
    """The official client, batch and streamed with usage: the same message as the coupled endpoint."""
    clients = [openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
               for url in (servers["inline"].url, servers["decodes"][0].url)]
    kwargs: dict[str, Any] = {"model": MODEL, "messages": CHAT["messages"], "tools": [WEATHER_TOOL],
                              "max_tokens": 12, "temperature": 0}
    messages = [c.chat.completions.create(**kwargs).choices[0].message for c in clients]
    assert messages[0].model_dump() == messages[1].model_dump()
    folded = []
    for client in clients:
        content, reasoning, calls, usage = "", "", [], None
        for chunk in client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
            usage = chunk.usage or usage
            for c in chunk.choices:
                content += c.delta.content or ""
                reasoning += (c.delta.model_extra or {}).get("reasoning") or ""
                calls += [(t.index, t.function and t.function.model_dump()) for t in c.delta.tool_calls or []]
        folded.append((content, reasoning, calls, usage))
    assert folded[0] == folded[1] and folded[0][3] is not None and folded[0][3].completion_tokens == 12
    assert (folded[0][0] or None, folded[0][1] or None) == (messages[0].content, messages[0].model_extra["reasoning"])
    texts = [c.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0).choices[0].text
             for c in clients]
    assert texts[0] == texts[1] != ""


def test_the_request_id_is_kept(servers: dict[str, Any]) -> None:
    url = servers["inline"].url + "/v1/chat/completions"
    r = httpx.post(url, json=CHAT | {"max_tokens": 2}, headers={"x-request-id": "abc-1"}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "abc-1" and r.json()["id"] == "chatcmpl-abc-1"
    r = httpx.post(url, json=CHAT | {"max_tokens": 2}, timeout=60)
    assert r.json()["id"] == "chatcmpl-" + r.headers["x-request-id"]


def test_upstream_client_errors_keep_their_status_and_message(servers: dict[str, Any]) -> None:
    client = openai.OpenAI(base_url=servers["inline"].url + "/v1", api_key="none", max_retries=0)
    named = {"type": "function", "function": {"name": "nope"}}
    with pytest.raises(openai.BadRequestError, match="tool_choice"):  # the render server's 400
        client.chat.completions.create(model=MODEL, messages=CHAT["messages"], tools=[WEATHER_TOOL], tool_choice=named)
    with pytest.raises(openai.NotFoundError, match="'other' is not served here"):  # the prefill server's 404
        client.chat.completions.create(model="other", messages=CHAT["messages"], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="one prompt per completions request"):
        client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=2)
    r = httpx.post(servers["inline"].url + "/v1/chat/completions", content=b"[1]",
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    deep = b'{"messages": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"
    r = httpx.post(servers["inline"].url + "/v1/chat/completions", content=deep,
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]

    def huge():  # type: ignore[no-untyped-def]  # chunked: no Content-Length to refuse it by
        for _ in range(40):
            yield b" " * (1 << 20)

    r = httpx.post(servers["inline"].url + "/v1/chat/completions", content=huge(),
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400 and "over" in r.json()["error"]["message"]


def test_derender_tier_refuses_streamed_stop_strings(servers: dict[str, Any]) -> None:
    r = httpx.post(servers["derender-tier"].url + "/v1/chat/completions", json=CHAT | {"stream": True, "stop": ["x"]},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"


def test_models_health_and_metrics(servers: dict[str, Any]) -> None:
    proxy = servers["inline"]
    models = httpx.get(proxy.url + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert httpx.get(proxy.url + "/health", timeout=10).status_code == 200
    for decode in servers["decodes"]:
        assert proxy.metric(f'pdserve_proxy_member_healthy{{pool="decode",url="{decode.url}"}}') == 1
    assert proxy.metric('pdserve_proxy_requests_total{endpoint="chat",mode="inline",status="200"}') >= 1
    assert proxy.metric('pdserve_proxy_requests_total{endpoint="chat",mode="inline",status="400"}') >= 1
    assert proxy.metric('pdserve_proxy_leg_seconds_count{leg="prefill"}') >= 1
    assert servers["derender-tier"].metric('pdserve_proxy_leg_seconds_count{leg="derender"}') >= 1


def test_inline_over_a_decode_member_that_cannot_derender_stops_naming_it_and_the_fix(
        servers: dict[str, Any]) -> None:
    lean = servers["prefill"]  # --tokens-only: it serves output_mode tokens and refuses text and derender
    code, log = _proxy(servers["render"], servers["prefill"], [lean], "inline").run_to_exit(60)
    assert code == 2, log
    assert f"decode server {lean.url}: {lean.url}/inference/v1/generate answered 400 to output_mode='derender'" in log
    assert "run the proxy with --mode derender-tier" in log and "ready" not in log
    # The tier's decode legs are tokens, which the same member serves: that proxy starts and answers (its
    # prefill leg on another server: a pdserve engine does not pull KV from itself).
    with _proxy(servers["render"], servers["decodes"][0], [lean], "derender-tier") as tier:
        r = httpx.post(tier.url + "/v1/chat/completions", json=CHAT, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["message"], r.text


def _long_stream(max_tokens: int = 4000) -> dict[str, Any]:
    return CHAT | {"stream": True, "max_tokens": max_tokens, "ignore_eos": True}


def _serving(decodes: list[ServerProcess]) -> ServerProcess:
    """The decode server that runs the one request in flight."""
    running = wait_until(lambda: [d for d in decodes if d.metric("pdserve_running_requests") == 1],
                         "a decode server runs the request")
    assert len(running) == 1
    return running[0]


def test_client_disconnect_aborts_the_decode_leg(servers: dict[str, Any]) -> None:
    proxy = servers["inline"]
    left = proxy.metric('pdserve_proxy_requests_total{endpoint="chat",mode="inline",status="499"}', missing=0)
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=_long_stream(), timeout=60) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        decode = _serving(servers["decodes"])
    # Closing the client's stream closed the decode leg: the decode server aborted the request.
    wait_metric(decode, "pdserve_running_requests", 0)
    wait_metric(decode, "pdserve_engine_running_requests", 0)
    wait_metric(proxy, "pdserve_proxy_running_requests", 0)
    assert proxy.metric('pdserve_proxy_requests_total{endpoint="chat",mode="inline",status="499"}') == left + 1


def _kill(srv: ServerProcess) -> None:
    assert srv.proc is not None
    os.kill(srv.pid, signal.SIGKILL)
    srv.proc.wait()


def test_a_decode_server_dying_mid_stream_then_leaving_rotation(servers: dict[str, Any]) -> None:
    """The stream it served goes on on the other decode member (tests/e2e/test_migration.py checks the
    answer); requests keep going to the other until the dead one is back."""
    proxy, decodes = servers["inline"], servers["decodes"]
    # Still running when the member dies (it dies at the first event); the other member then decodes the rest.
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=_long_stream(1200), timeout=60) as r:
        lines = r.iter_lines()
        head = [next(line for line in lines if line.startswith("data: {"))]
        dead = _serving(decodes)
        _kill(dead)
        events, done = parse_sse(head + list(lines))
    assert done and not any("error" in e for e in events), events[-1]
    assert [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")] == ["length"]
    assert proxy.metric('pdserve_proxy_migrations_total{cause="dropped",outcome="moved"}') == 1
    live = next(d for d in decodes if d is not dead)
    served = live.metric(GENERATED_200 % "derender", missing=0)
    for _ in range(4):  # the routing may pick the dead member unless the health check took it out already
        assert _batch(proxy.url + "/v1/chat/completions", CHAT | {"max_tokens": 2})["choices"][0]["finish_reason"]
    assert live.metric(GENERATED_200 % "derender") == served + 4
    wait_metric(proxy, f'pdserve_proxy_member_healthy{{pool="decode",url="{dead.url}"}}', 0)


def test_a_dead_prefill_pool_is_a_503_naming_it(servers: dict[str, Any]) -> None:
    prefill = servers["prefill"]
    _kill(prefill)
    for mode in ("inline", "derender-tier"):
        proxy = servers[mode]
        for stream in (False, True):
            r = httpx.post(proxy.url + "/v1/chat/completions", json=CHAT | {"stream": stream}, timeout=60)
            assert r.status_code == 503, r.text
            message = r.json()["error"]["message"]
            assert "prefill pool" in message and prefill.url in message
        health = proxy.url + "/health"
        wait_until(lambda url=health: httpx.get(url, timeout=10).status_code == 503, "the proxy is unhealthy")
        assert "prefill pool" in httpx.get(proxy.url + "/health", timeout=10).json()["error"]["message"]
