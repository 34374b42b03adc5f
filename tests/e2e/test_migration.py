"""Decode-leg migration through ``pdserve proxy`` on loopback: a decode member killed (SIGKILL) or hung
(SIGSTOP) mid-stream, and the client's stream goes on on the other decode member, assembled equal to the
uninterrupted answer, for decode legs in ``derender`` (chat, reasoning and tool parsers on), ``text``
(completions) and ``tokens`` (chat through ``--mode derender-tier``).

qwen3-tiny on the torch engine, float32, with the KV hand-off on (as tests/e2e/test_proxy.py). The resumed
leg prefills the prompt plus the ids already sent, where the first leg decoded them one step at a time; in
float32 the greedy continuation is the same (60 cuts of 200-token answers agreed, measured when this was
written). That the parser state survives the move exactly, reasoning and tool calls included, is
property-tested in tests/unit/output/test_resume.py; the real-model path across hosts is tests/fleet.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pdserve.checkpoints.resolve import resolve_model
from pdserve.topology.process import start_all, stop_all
from tests.broken_streams import WEATHER, assembled, carries_output, stream
from tests.serverproc import ServerProcess
from tests.sse import parse_sse
from tests.waiting import wait_metric, wait_until

MODEL = "qwen3-tiny"
PARSERS = ("--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--enable-auto-tool-choice")
ENGINE = (MODEL, "--kv-transfer", "nixl", "--dtype", "float32")
LONG = {"max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}, "return_token_ids": True}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER]} | LONG
COMPLETION = {"model": MODEL, "prompt": "Tell me about Paris."} | LONG
# (proxy mode, path, body): the decode legs run derender, text and tokens.
LEGS = {
    "derender": ("inline", "/v1/chat/completions", CHAT),
    "text": ("inline", "/v1/completions", COMPLETION),
    "tokens": ("derender-tier", "/v1/chat/completions", CHAT),
}


def _proxy(fleet: dict[str, Any], mode: str, *extra: str) -> ServerProcess:
    return ServerProcess("proxy", "--render", fleet["render"].url, "--prefill", fleet["prefill"].url,
                         "--decode", ",".join(d.url for d in fleet["decodes"]), "--mode", mode,
                         "--health-interval-s", "0.2", "--stall-timeout-s", "1.5", *extra)


@pytest.fixture(scope="module")
def fleet() -> Iterator[dict[str, Any]]:
    servers = [ServerProcess("launch", "render", "--tokenizer", str(resolve_model(MODEL)), *PARSERS),
               ServerProcess("serve", *ENGINE, "--tokens-only"),
               ServerProcess("serve", *ENGINE, *PARSERS), ServerProcess("serve", *ENGINE, *PARSERS)]
    render, prefill, *decodes = servers
    fleet: dict[str, Any] = {"render": render, "prefill": prefill, "decodes": decodes}
    try:
        start_all(servers)
        proxies = [_proxy(fleet, "inline"), _proxy(fleet, "derender-tier")]  # the members' URLs are final now
        servers += proxies
        start_all(proxies)
        fleet["inline"], fleet["derender-tier"] = proxies
        yield fleet
    finally:
        stop_all(servers)


def _serving(decodes: list[ServerProcess]) -> ServerProcess:
    running = wait_until(lambda: [d for d in decodes if d.metric("pdserve_running_requests") == 1],
                         "a decode server runs the request")
    assert len(running) == 1
    return running[0]


def _migrations(proxy: ServerProcess, cause: str, outcome: str = "moved") -> float:
    return proxy.metric(f'pdserve_proxy_migrations_total{{cause="{cause}",outcome="{outcome}"}}', missing=0)


def _restore(proxy: ServerProcess, member: ServerProcess, sig: signal.Signals) -> None:
    if sig == signal.SIGSTOP:
        os.kill(member.pid, signal.SIGCONT)
    else:
        assert member.proc is not None
        member.proc.wait()
        member.spawn()
        member.wait_healthy(60)
    wait_metric(member, "pdserve_running_requests", 0)
    wait_metric(proxy, f'pdserve_proxy_member_healthy{{pool="decode",url="{member.url}"}}', 1)


# One fault per leg here; every leg under both faults, across hosts: tests/fleet/test_faults.py (a), (b).
@pytest.mark.parametrize("leg, sig", [("derender", signal.SIGKILL), ("text", signal.SIGSTOP), ("tokens", signal.SIGKILL)],
                         ids=["derender-killed", "text-hung", "tokens-killed"])
def test_a_broken_decode_leg_moves_and_the_answer_is_whole(fleet: dict[str, Any], leg: str, sig: signal.Signals) -> None:
    mode, path, body = LEGS[leg]
    proxy, decodes = fleet[mode], fleet["decodes"]
    want = assembled(stream(proxy.url + path, body))
    assert want["usage"]["completion_tokens"] == 400 and len(want["ids"]) == 400
    cause = "dropped" if sig == signal.SIGKILL else "stalled"
    moved = _migrations(proxy, cause)
    broken: list[ServerProcess] = []

    def fault() -> None:
        broken.append(_serving(decodes))
        os.kill(broken[0].pid, sig)

    got = assembled(stream(proxy.url + path, body, fault))
    try:
        assert got == want
        assert _migrations(proxy, cause) == moved + 1
    finally:
        _restore(proxy, broken[0], sig)
    wait_metric(proxy, "pdserve_proxy_running_requests", 0)
    for member in decodes:
        wait_metric(member, "pdserve_running_requests", 0)


def test_with_migration_off_the_client_gets_an_error_naming_the_member(fleet: dict[str, Any]) -> None:
    """``--migration-limit 0``: the stream ends with an error event naming the failed member, then [DONE]."""
    decodes = fleet["decodes"]
    with _proxy(fleet, "inline", "--migration-limit", "0") as proxy:
        broken: list[ServerProcess] = []

        def fault() -> None:
            broken.append(_serving(decodes))
            os.kill(broken[0].pid, signal.SIGKILL)

        events = stream(proxy.url + "/v1/chat/completions", CHAT, fault)
        try:
            message = events[-1]["error"]["message"]
            assert broken[0].url in message and "--migration-limit 0" in message, message
            assert _migrations(proxy, "dropped", "not_moved") == 1
        finally:
            _restore(proxy, broken[0], signal.SIGKILL)



@pytest.mark.parametrize("fields, named", [
    ({"stream": False}, "stream=true"),
    ({"prior_output_chunks": [9]}, "leaves no prompt"),
    ({"prior_output_chunks": [0, 1]}, "prior_output_chunks"),
    ({"sampling_params": {"n": 2, "max_tokens": 3}}, "n=1"),
])
def test_a_resume_the_server_cannot_honour_is_a_400_naming_it(fleet: dict[str, Any], fields: dict[str, Any],
                                                               named: str) -> None:
    body = {"token_ids": [1, 2, 3, 4], "prior_output_chunks": [1, 1], "stream": True,
            "sampling_params": {"max_tokens": 3}, "output_mode": "text"} | fields
    r = httpx.post(fleet["decodes"][0].url + "/inference/v1/generate", json=body, timeout=30)
    assert r.status_code == 400 and named in r.json()["error"]["message"], r.text


def test_a_proxy_told_to_stop_drains_then_ends_open_streams_naming_it(fleet: dict[str, Any]) -> None:
    """SIGTERM: /health and new requests answer 503 at once; a stream still open after --shutdown-timeout
    ends with an error event naming the shutdown, then [DONE]; its decode leg is aborted; the proxy exits."""
    with _proxy(fleet, "inline", "--shutdown-timeout", "1") as proxy:
        long = CHAT | {"max_tokens": 3000}  # some 10 s of tokens: still running when the drain time is up
        with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=long, timeout=60) as r:
            assert r.status_code == 200, r.read()
            lines = r.iter_lines()
            head = [next(line for line in lines if line.startswith("data: {") and carries_output(line))]
            _serving(fleet["decodes"])
            os.kill(proxy.pid, signal.SIGTERM)
            wait_until(lambda: httpx.get(proxy.url + "/health", timeout=5).status_code == 503, "the proxy drains")
            refused = httpx.post(proxy.url + "/v1/chat/completions", json=CHAT, timeout=10)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            events, done = parse_sse(head + list(lines))
        assert done and "the proxy is shutting down" in events[-1]["error"]["message"], events[-1]
        assert events[-1]["error"]["code"] == 503
        # uvicorn ends by re-raising the signal it caught (the exit status says SIGTERM), as pdserve serve does.
        assert proxy.proc is not None and proxy.proc.wait(30) in (0, -signal.SIGTERM)
        for member in fleet["decodes"]:
            wait_metric(member, "pdserve_running_requests", 0)
