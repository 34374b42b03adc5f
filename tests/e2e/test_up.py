"""``pdserve up``: a whole local topology (qwen3-tiny, reasoning and tool parsers) driven with the openai SDK,
against a plain coupled ``pdserve serve qwen3-tiny`` with the same parsers, its traces going to a small OTLP/HTTP
receiver (tests/otlp.py). Destructive tests run last."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from pdserve.proxy.flow import decode_modes
from pdserve.proxy.preflight import PROBE_TOKEN_IDS
from tests.otlp import Receiver, tree
from tests.serverproc import ServerProcess
from tests.upproc import Up, alive, start_up
from tests.waiting import wait_until

MODEL = "qwen3-tiny"
PARSERS = ("--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--enable-auto-tool-choice")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# float32 on every engine server (``pdserve up`` passes flags it does not know to its prefill and decode
# servers): the decode leg computes its first token in a decode step over pulled KV, the coupled server
# in its prefill, and in bfloat16 those kernels may round a near-tied greedy token apart on some CPUs
# (tests/e2e/test_kv_handoff.py's docstring); in float32 they agree.
EXACT = ("--dtype=float32",)
@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    with Receiver() as spans:
        yield spans


@pytest.fixture(scope="module")
def up(receiver: Receiver) -> Iterator[tuple[Up, str, ServerProcess]]:
    coupled = ServerProcess("serve", MODEL, *PARSERS, *EXACT)
    topology: Up | None = None
    try:
        coupled.spawn()  # loads while the topology starts
        with pytest.MonkeyPatch.context() as env:
            env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # the SDK's batch delay, 5 s by default
            topology, base_url = start_up(MODEL, "--port", "0", *PARSERS, *EXACT,
                                          "--otlp-traces-endpoint", receiver.url)
        coupled.wait_healthy(120)
        yield topology, base_url, coupled
    finally:
        if topology is not None:
            topology.stop()
        coupled.stop()


def _clients(up: tuple[Up, str, ServerProcess]) -> list[openai.OpenAI]:
    _, base_url, coupled = up
    return [openai.OpenAI(base_url=url, api_key="none", max_retries=0) for url in (base_url, coupled.url + "/v1")]


def test_it_prints_every_member_and_each_is_healthy(up: tuple[Up, str, ServerProcess]) -> None:
    topology, base_url, _ = up
    members = topology.members
    assert sorted(members) == ["decode-0", "prefill-0", "proxy", "render"]
    assert base_url == members["proxy"][0] + "/v1"
    for name, (url, pid) in members.items():
        assert alive(pid) and httpx.get(url + "/health", timeout=10).status_code == 200, name
        assert f"{name} healthy on {url}" in topology.output  # the startup progress


def test_sdk_chat_with_tools_equals_the_coupled_server(up: tuple[Up, str, ServerProcess]) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 16,
                              "temperature": 0, "extra_body": {"return_token_ids": True}}
    got, want = (c.chat.completions.create(**kwargs).choices[0] for c in _clients(up))
    assert got.model_extra["token_ids"] == want.model_extra["token_ids"] and len(got.model_extra["token_ids"]) == 16
    assert got.message.model_dump() == want.message.model_dump()  # content, reasoning, tool_calls
    assert got.finish_reason == want.finish_reason
    folded = []
    for client in _clients(up):
        ids: list[int] = []
        content, reasoning, calls, usage = "", "", [], None
        for chunk in client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
            usage = chunk.usage or usage
            for c in chunk.choices:
                ids += c.model_extra.get("token_ids") or []
                content += c.delta.content or ""
                reasoning += (c.delta.model_extra or {}).get("reasoning") or ""
                calls += [(t.index, t.function and t.function.model_dump()) for t in c.delta.tool_calls or []]
        folded.append((ids, content, reasoning, calls, usage))
    assert folded[0] == folded[1]
    assert folded[0][0] == want.model_extra["token_ids"] and folded[0][4].completion_tokens == 16


def test_sdk_completions_equal_the_coupled_server(up: tuple[Up, str, ServerProcess]) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 16,
                              "temperature": 0, "extra_body": {"return_token_ids": True}}
    got, want = (c.completions.create(**kwargs) for c in _clients(up))
    assert got.choices[0].text == want.choices[0].text
    assert got.choices[0].model_extra["token_ids"] == want.choices[0].model_extra["token_ids"]
    assert got.usage == want.usage
    streamed = ["".join(ch.choices[0].text for ch in c.completions.create(**kwargs, stream=True) if ch.choices)
                for c in _clients(up)]
    assert streamed == [want.choices[0].text] * 2


def metric(url: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(url + "/metrics", timeout=10).text, re.MULTILINE)
    assert found, f"{name} missing from {url}/metrics"
    return float(found.group(1))


def test_metrics_show_the_prefill_ran_the_prompts_and_the_decode_pulled_them(up: tuple[Up, str, ServerProcess]) -> None:
    """After the SDK tests above: every prompt was computed on the prefill server and its KV pulled by the decode
    server over NIXL, which computed no client prompt itself (no recompute): only the proxy's preflight
    probes, one one-token prompt per output mode it asked the member for."""
    members = up[0].members
    prefill, decode = members["prefill-0"][0], members["decode-0"][0]
    client = _clients(up)[0]
    client.completions.create(model=MODEL, prompt="One more prompt", max_tokens=2)  # at least one decode leg
    wait_until(lambda: metric(prefill, "pdserve_kv_exported_requests_total")
               == metric(decode, "pdserve_kv_pulls_ok_total") > 0, "every exported prompt pulled by the decode server")
    assert metric(prefill, "pdserve_engine_prompt_tokens_computed_total") > 0
    assert metric(decode, "pdserve_kv_pulled_bytes_total") > 0
    probes = len(PROBE_TOKEN_IDS) * len(decode_modes("inline"))
    assert metric(decode, "pdserve_engine_prompt_tokens_computed_total") == probes
    assert metric(decode, "pdserve_kv_recomputes_total") == 0 and metric(decode, "pdserve_kv_pulls_failed_total") == 0


def test_traces_of_one_request_come_from_every_process_up_started(
    up: tuple[Up, str, ServerProcess], receiver: Receiver
) -> None:
    """``up --otlp-traces-endpoint`` hands the flag to each process it starts: one chat is one trace with the
    proxy's, the render's, the prefill's and the decode's spans, each member's under the proxy's leg."""
    topology, base_url, _ = up
    r = httpx.post(base_url + "/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4},
                   headers={"x-request-id": "up-trace"}, timeout=60)
    assert r.status_code == 200, r.text
    (root,) = wait_until(lambda: receiver.find(lambda s: s.service == "pdserve-proxy" and s.kind == "server"
                                               and s.attributes.get("gen_ai.request.id") == "up-trace"),
                         "the proxy's span of the request", bound_s=30)
    services = {"pdserve-proxy", "pdserve-render", "pdserve-prefill", "pdserve-decode"}
    spans = receiver.wait_for_trace(root.trace_id, lambda got: {s.service for s in got} == services
                                    and any(s.name == "decode" and s.service == "pdserve-decode" for s in got))
    by_id = {s.span_id: s for s in spans}
    assert [s for s in spans if s.parent_id not in by_id] == [root], tree(spans)
    members = topology.members
    for leg, member, service in (("render", "render", "pdserve-render"), ("prefill", "prefill-0", "pdserve-prefill"),
                                 ("decode", "decode-0", "pdserve-decode")):
        (leg_span,) = [s for s in spans if s.parent_id == root.span_id and s.name == leg]
        assert leg_span.attributes["pdserve.member"] == members[member][0]
        (server,) = [s for s in spans if s.parent_id == leg_span.span_id]
        assert server.service == service and server.kind == "server", tree(spans)


def test_a_member_that_dies_is_reported_and_the_proxy_stops_routing_to_it(up: tuple[Up, str, ServerProcess]) -> None:
    topology = up[0]
    url, pid = topology.members["decode-0"]
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: f"decode-0 (pid {pid}, {url}) exited with code -9" in topology.output,
               lambda: f"pdserve up reports decode-0's exit; its output:\n{topology.output}")
    with pytest.raises(openai.InternalServerError, match="decode pool") as e:
        _clients(up)[0].chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert e.value.status_code == 503


def test_sigterm_stops_every_process(up: tuple[Up, str, ServerProcess]) -> None:
    topology = up[0]
    pids = [pid for _, pid in topology.members.values()]
    cores = []
    for name, (url, _) in topology.members.items():
        if name.startswith("prefill"):
            cores.append(int(httpx.get(url + "/health", timeout=10).headers["x-pdserve-core-pid"]))
    assert cores and all(alive(p) for p in cores)
    os.kill(topology.proc.pid, signal.SIGTERM)
    assert topology.proc.wait(timeout=60) == 0
    assert "stopped" in topology.output
    assert [p for p in pids + cores if alive(p)] == []
