"""P/D on vLLM engines exchanging KV over vLLM's own NixlConnector, behind pdserve's proxy: the three fleets
of docs/pd.md ("vLLM engines in the P/D fleet"), on the qwen3-tiny model dir in float32.

* **pdserve over vLLM**: ``pdserve serve --engine vllm --kv-transfer nixl`` prefill (``--kv-role prefill
  --tokens-only``) and decode (``--kv-role decode``, qwen3 + hermes parsers), the proxy ``--mode inline``;
* **stock vLLM**: ``vllm serve --kv-transfer-config`` NixlConnector producer and consumer (the consumer with
  ``kv_load_failure_policy: recompute``), the proxy ``--mode derender-tier`` (vLLM 0.32 cannot derender
  inline: the proxy refuses ``--mode inline`` over it, naming the member and the fix);
* **the mixed fleet** (the RFC's deployment with today's vLLM): the stock prefill, the pdserve decode,
  the proxy ``--mode inline``.

The reference is the stock decode server's own coupled answer (one vLLM server, no hand-off). For each
fleet: the openai SDK's chat (batch and streamed, a tool offered) and completions equal it token for token
(greedy), and seeded sampled chats biased towards reasoning and tool markup give the same messages through
the parsers; the decode side pulled every prompt token over NIXL and computed none. Then the failures, on
a prefill server of their own: a lease nobody pulls is freed when it expires, and a prefill killed before
the pull gives a decode leg the ``fail`` policy's KV load error (pdserve's decode) or the recomputed right
answer (the stock decode under ``recompute``).

Every vLLM engine here runs with ``PDSERVE_PACE_NIXL=1`` (pdserve's vLLM plugin, pdserve/engine/runners/
vllm_plugin.py): vLLM's NIXL progress thread otherwise spins a core per engine, and five engines on a 2-core
host starve each other's handshakes and transfers. Each prefill -> decode pair is warmed once before the
checks (pdserve.topology.warmup, as ``pdserve up --engine vllm`` does): on such a host vLLM's first NIXL READ between two engines finished only once the
prefill engine went idle, at its lease's end (measured: every first pull took the lease, later ones ~1 s).
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.engine.runners.vllm_plugin import PACE_ENV
from pdserve.proxy.legs import decode_body, prefill_body
from pdserve.topology.process import free_port
from pdserve.topology.warmup import hand_off
from tests.interop.chats import WEATHER, client, folded_stream, markup_bias, message_of
from tests.interop.peers import MODEL_NAME, PARSER_ARGS, VllmPeer, pdserve
from tests.serverproc import ServerProcess, metric_sum
from tests.sse import stream_post

# Five vLLM engine cores start at once (minutes on a loaded 2-core host; pytest-timeout counts the fixture).
pytestmark = pytest.mark.timeout(1800)

LEASE_S = 30  # the fleets' prefill leases (vLLM's default)
SHORT_LEASE_S = 8  # the failure tests' prefill server: a lease nobody pulls runs out within the test
KV = ("--engine", "vllm", "--kv-transfer", "nixl", "--kv-host", "127.0.0.1")
# A prompt past a few of vLLM's KV blocks, so whole blocks move.
LONG = "Tell me about the history of Paris, its rivers, bridges, museums and parks. " * 8


def stock_vllm(model_dir: Path, role: str, *args: str, **extra: Any) -> VllmPeer:
    """``vllm serve`` with vLLM's NixlConnector in ``role`` (its side channel on a port of its own)."""
    config = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu", **extra}
    env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
           PACE_ENV: "1"}
    return VllmPeer(model_dir, "--kv-transfer-config", json.dumps(config), *args, env=env)


def pdserve_vllm(model_dir: Path, role: str, lease_s: int, *args: str) -> ServerProcess:
    return pdserve(model_dir, *KV, "--kv-role", role, "--kv-side-channel-port", str(free_port()),
                   "--kv-lease-s", str(lease_s), *args)


def proxy(render: ServerProcess, prefill: ServerProcess, decode: ServerProcess, mode: str) -> ServerProcess:
    return ServerProcess("proxy", "--render", render.url, "--prefill", prefill.url, "--decode", decode.url,
                         "--mode", mode, "--health-interval-s", "0.2", "--connect-timeout-s", "10")


@dataclass
class Fleet:
    prefill: ServerProcess
    decode: ServerProcess
    proxy: ServerProcess


@dataclass
class Servers:
    render: ServerProcess
    reference: VllmPeer  # the stock decode server: its coupled answers are one vLLM server's
    fleets: dict[str, Fleet]
    spare_prefill: ServerProcess  # the failure tests' own prefill server (short lease; killed last)


def render(servers: Servers, kind: str, body: dict[str, Any]) -> dict[str, Any]:
    path = "/v1/chat/completions/render" if kind == "chat" else "/v1/completions/render"
    r = httpx.post(servers.render.url + path, json={"model": MODEL_NAME, **body}, timeout=60)
    assert r.status_code == 200, r.text
    rendered = r.json()
    return rendered if kind == "chat" else rendered[0]


def prefill_leg(prefill: ServerProcess, rendered: dict[str, Any]) -> dict[str, Any]:
    """The proxy's prefill leg, sent by hand; the ``kv_transfer_params`` it returns."""
    r = httpx.post(prefill.url + "/inference/v1/generate", json=prefill_body(rendered), timeout=300)
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_engine_id"]
    return params


@pytest.fixture(scope="module")
def servers(model_dir: Path) -> Iterator[Servers]:
    started: list[ServerProcess] = []

    def start(*members: ServerProcess) -> None:
        started.extend(members)
        for member in members:
            member.spawn()
        for member in members:
            member.wait_healthy(1200)

    try:
        ours_prefill = pdserve_vllm(model_dir, "prefill", LEASE_S, "--tokens-only")
        ours_decode = pdserve_vllm(model_dir, "decode", LEASE_S, *PARSER_ARGS)
        spare_prefill = pdserve_vllm(model_dir, "prefill", SHORT_LEASE_S, "--tokens-only")
        stock_prefill = stock_vllm(model_dir, "kv_producer", kv_connector_extra_config={"kv_lease_duration": LEASE_S})
        stock_decode = stock_vllm(model_dir, "kv_consumer", *PARSER_ARGS, kv_load_failure_policy="recompute")
        render_server = ServerProcess("launch", "render", "--tokenizer", str(model_dir), *PARSER_ARGS,
                                      "--served-model-name", MODEL_NAME)
        start(ours_prefill, ours_decode, spare_prefill, stock_prefill, stock_decode, render_server)
        pairs = {"pdserve-over-vllm": (ours_prefill, ours_decode, "inline"),
                 "stock-vllm": (stock_prefill, stock_decode, "derender-tier"),
                 "mixed": (stock_prefill, ours_decode, "inline")}
        proxies = {name: proxy(render_server, p, d, mode) for name, (p, d, mode) in pairs.items()}
        start(*proxies.values())
        with ThreadPoolExecutor(len(pairs)) as pool:  # pdserve up --engine vllm's warm-up, pair by pair
            list(pool.map(lambda pair: hand_off(pair[0].url, pair[1].url, 600), pairs.values()))
        # The spare's lease is short: its hand-offs wait until both decode engines are warm and idle, one at a
        # time, or a decode leg still busy with its first pulls can start this one past the lease (seen in CI).
        for decode in (ours_decode, stock_decode):
            hand_off(spare_prefill.url, decode.url, 600)
        fleets = {name: Fleet(p, d, proxies[name]) for name, (p, d, _) in pairs.items()}
        yield Servers(render_server, stock_decode, fleets, spare_prefill)
    finally:
        for member in reversed(started):
            member.stop()


FLEETS = ("pdserve-over-vllm", "stock-vllm", "mixed")


def test_inline_over_a_stock_vllm_decode_is_refused_naming_the_member_and_the_fix(servers: Servers) -> None:
    stock = servers.fleets["stock-vllm"]
    code, log = proxy(servers.render, stock.prefill, stock.decode, "inline").run_to_exit(120)
    assert code == 2, log
    assert f"decode server {stock.decode.url}: {stock.decode.url}/inference/v1/generate answered 400 to " \
        "output_mode='derender'" in log
    assert "run the proxy with --mode derender-tier" in log


@pytest.mark.parametrize("fleet", FLEETS)
def test_greedy_answers_equal_one_coupled_vllm_server_token_for_token(servers: Servers, fleet: str) -> None:
    proxied, coupled = client(servers.fleets[fleet].proxy.url), client(servers.reference.url)
    for content in ("What is the weather in Paris?", LONG):
        kwargs = {"model": MODEL_NAME, "messages": [{"role": "user", "content": f"{fleet}: {content}"}],
                  "tools": [WEATHER], "max_tokens": 16, "temperature": 0, "extra_body": {"return_token_ids": True}}
        ours, theirs = message_of(proxied, kwargs), message_of(coupled, kwargs)
        assert ours == theirs and len(ours[1]) == 16
        streams = [folded_stream(c, kwargs) for c in (proxied, coupled)]
        assert streams[0] == streams[1] and streams[0][4] == 16 and streams[0][3] == ours[1]
    completion = {"model": MODEL_NAME, "prompt": f"{fleet}: {LONG}", "max_tokens": 12, "temperature": 0,
                  "extra_body": {"return_token_ids": True}}
    answers = [c.completions.create(**completion).choices[0] for c in (proxied, coupled)]
    assert [a.text for a in answers] == [answers[1].text] * 2 and answers[0].text != ""
    assert [(a.model_extra or {})["token_ids"] for a in answers] == [(answers[1].model_extra or {})["token_ids"]] * 2


@pytest.mark.parametrize("fleet", FLEETS)
def test_reasoning_and_tool_markup_parse_the_same_as_on_one_coupled_vllm_server(servers: Servers, fleet: str) -> None:
    """Seeded sampling over markup-heavy answers: the parsed messages equal vLLM's own (batch). Streamed,
    they fold to the same message: vLLM 0.32's own streamed hermes parser drops content after a
    ``<tool_call>`` that never parses (its stream and batch differ), so streams are held to the batch."""
    proxied, coupled = client(servers.fleets[fleet].proxy.url), client(servers.reference.url)
    bias = markup_bias()
    parsed = {"reasoning": 0, "content": 0}
    for seed in range(3):
        kwargs = {"model": MODEL_NAME, "messages": [{"role": "user", "content": f"Weather in Paris? ({fleet})"}],
                  "tools": [WEATHER], "max_tokens": 24, "temperature": 1.0, "seed": seed, "logit_bias": bias,
                  "extra_body": {"return_token_ids": True}}
        (ours, ids), (theirs, their_ids) = message_of(proxied, kwargs), message_of(coupled, kwargs)
        assert (ours, ids) == (theirs, their_ids)
        content, reasoning, calls, streamed_ids, _ = folded_stream(proxied, kwargs)
        assert (content or None, reasoning or None, streamed_ids) == (ours["content"], ours["reasoning"], ids)
        assert calls == [] and ours["tool_calls"] in (None, [])
        parsed["reasoning"] += bool(ours["reasoning"])
        parsed["content"] += bool(ours["content"])
    assert parsed["reasoning"] and parsed["content"], parsed  # the markup reached both sides of the parser


PULLED = ("vllm:prompt_tokens_by_source_total", 'source="external_kv_transfer"')
COMPUTED = ("vllm:prompt_tokens_by_source_total", 'source="local_compute"')
TRANSFERS = ("vllm:nixl_xfer_time_seconds_count", "")


@pytest.mark.parametrize("fleet", FLEETS)
def test_the_decode_side_pulled_every_prompt_token_and_computed_none(servers: Servers, fleet: str) -> None:
    decode = servers.fleets[fleet].decode
    ours = not isinstance(decode, VllmPeer)
    counters = [PULLED, COMPUTED, TRANSFERS]
    if ours:  # pdserve's own counters, filled from vLLM's stats
        counters += [("pdserve_kv_pulled_tokens_total", ""), ("pdserve_engine_prompt_tokens_computed_total", ""),
                     ("pdserve_kv_pulls_ok_total", "")]
    before = [metric_sum(decode.url, *c) for c in counters]
    # A prompt no server has seen (a decode server's prefix cache would serve a repeated one locally).
    prompt = f"Request {uuid.uuid4().hex}. {LONG}"
    r = httpx.post(servers.fleets[fleet].proxy.url + "/v1/completions", timeout=300,
                   json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    grown = [metric_sum(decode.url, *c) - b for c, b in zip(counters, before)]
    assert grown[:3] == [prompt_tokens, 0, 1]  # every prompt token came over NIXL, in one transfer
    if ours:
        assert grown[3:] == [prompt_tokens, 0, 1]


def test_a_leg_of_the_other_pool_is_refused_naming_the_role(servers: Servers) -> None:
    body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 1}, "kv_transfer_params": {"do_remote_decode": True}}
    r = httpx.post(servers.fleets["mixed"].decode.url + "/inference/v1/generate", json=body, timeout=60)
    assert r.status_code == 400 and "--kv-role decode" in r.json()["error"]["message"]


def test_the_banner_names_vllms_connector(servers: Servers) -> None:
    log = servers.fleets["mixed"].decode.log()
    assert "vLLM NixlConnector (decode legs only), NIXL side channel 127.0.0.1:" in log


def test_an_unpulled_lease_is_freed_when_it_expires(servers: Servers) -> None:
    prefill = servers.spare_prefill
    expired = metric_sum(prefill.url, "pdserve_kv_leases_expired_total")
    vllm_expired = metric_sum(prefill.url, "vllm:nixl_num_kv_expired_reqs_total")
    rendered = render(servers, "completions", {"prompt": f"Lease {uuid.uuid4().hex}. {LONG}", "max_tokens": 4})
    prefill_leg(prefill, rendered)
    assert metric_sum(prefill.url, "vllm:kv_cache_usage_perc") > 0  # held for the pull that never comes
    deadline = time.monotonic() + SHORT_LEASE_S + 60
    while metric_sum(prefill.url, "pdserve_kv_leases_expired_total") == expired:
        assert time.monotonic() < deadline, f"the {SHORT_LEASE_S} s lease was not freed"
        time.sleep(0.5)
    assert metric_sum(prefill.url, "pdserve_kv_leases_expired_total") == expired + 1
    assert metric_sum(prefill.url, "vllm:nixl_num_kv_expired_reqs_total") == vllm_expired + 1
    assert metric_sum(prefill.url, "vllm:kv_cache_usage_perc") == 0


def test_a_prefill_killed_before_the_pull_fails_the_decode_leg_or_is_recomputed(servers: Servers) -> None:
    """Last: it kills the spare prefill server."""
    prefill, ours, stock = servers.spare_prefill, servers.fleets["mixed"].decode, servers.reference
    chat = {"messages": [{"role": "user", "content": f"Killed {uuid.uuid4().hex}. {LONG}"}], "max_tokens": 8,
            "temperature": 0}
    rendered = render(servers, "chat", chat)
    legs = [prefill_leg(prefill, rendered) for _ in range(3)]
    assert prefill.proc is not None
    os.killpg(prefill.proc.pid, signal.SIGKILL)
    prefill.proc.wait(timeout=30)
    failed = metric_sum(ours.url, "pdserve_kv_pulls_failed_total")
    # pdserve's decode (kv_load_failure_policy fail): a 502 naming the KV load and the prefill engine.
    r = httpx.post(ours.url + "/inference/v1/generate", json=decode_body(rendered, "derender", legs[0]), timeout=300)
    assert r.status_code == 502, r.text
    error = r.json()["error"]
    assert error["type"] == "KVLoadError" and legs[0]["remote_engine_id"] in error["message"]
    events, done = stream_post(ours.url + "/inference/v1/generate",
                               decode_body(rendered, "derender", legs[1]) | {"stream": True}, timeout=300)
    assert done and events[-1]["error"]["type"] == "KVLoadError" and events[-1]["error"]["code"] == 502
    assert metric_sum(ours.url, "pdserve_kv_pulls_failed_total") >= failed + 2
    # The stock decode under kv_load_failure_policy recompute: the right answer, the prompt computed there.
    recomputed = httpx.post(stock.url + "/inference/v1/generate", json=decode_body(rendered, "tokens", legs[2]),
                            timeout=300)
    coupled = httpx.post(stock.url + "/inference/v1/generate", json=decode_body(rendered, "tokens", None), timeout=300)
    assert recomputed.status_code == coupled.status_code == 200, recomputed.text
    ids = [r.json()["choices"][0]["token_ids"] for r in (recomputed, coupled)]
    assert ids[0] == ids[1] and len(ids[0]) == 8
