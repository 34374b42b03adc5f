"""Automatic prefix caching on a real server, through the official OpenAI client: a second conversation
with the same system prompt reads its blocks (``usage.prompt_tokens_details.cached_tokens`` with
``--enable-prompt-tokens-details``, and ``/metrics``) and answers exactly as a server without the cache
(float32, --batch-invariant: the same bits); a ``cache_salt`` shares blocks only with its own salt;
``skip_reading_prefix_cache`` reads none; a P/D decode leg pulls only the blocks its own cache lacks, and
answers as a coupled server; the banner says it; a scripted server refuses the flag."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from pdserve.topology.process import start_all, stop_all
from tests.serverproc import ServerProcess, metric_sum
from tests.waiting import wait_until

ENGINE = ("serve", "qwen3-tiny", "--dtype", "float32", "--batch-invariant", "--max-num-seqs", "4",
          "--enable-prompt-tokens-details", "--kv-transfer", "nixl")
GENERATE = "/inference/v1/generate"
SYSTEM = "You are a terse assistant for a railway timetable office. " + " ".join(
    f"Rule {i}: answer with the platform number first." for i in range(30))
MODEL = "qwen3-tiny"


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, ServerProcess]]:
    servers = {"cached": ServerProcess(*ENGINE), "uncached": ServerProcess(*ENGINE, "--no-enable-prefix-caching")}
    try:
        start_all(list(servers.values()), timeout_s=300)
        yield servers
    finally:
        stop_all(list(servers.values()))


def chat(server: ServerProcess, question: str, **extra: Any) -> tuple[str, int, int]:
    """The answer, the prompt's length and its cached positions."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    answer = client.chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        extra_body=extra or None,
    )
    usage = answer.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    return answer.choices[0].message.content or "", usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0


def test_a_shared_system_prompt_is_read_from_the_cache_and_answers_the_same(servers) -> None:  # type: ignore[no-untyped-def]
    cached, uncached = servers["cached"], servers["uncached"]
    hits_before = metric_sum(cached.url, "pdserve_prefix_cache_hits_total")
    first = chat(cached, "Which platform for Leeds?")
    second = chat(cached, "Which platform for York?")
    assert first[2] == 0 and second[2] > len(SYSTEM) // 8 and second[2] % 16 == 0
    assert second[2] < second[1]  # the question itself was computed
    wait_until(lambda: metric_sum(cached.url, "pdserve_prefix_cache_hits_total") - hits_before == second[2],
               "/metrics counts the hits (the engine core's next heartbeat)")
    assert (first[0], second[0]) == (chat(uncached, "Which platform for Leeds?")[0],
                                     chat(uncached, "Which platform for York?")[0])
    assert chat(uncached, "Which platform for Hull?")[2] == 0
    assert "pdserve_prefix_cache_hits" not in httpx.get(uncached.url + "/metrics").text


def test_a_salt_shares_blocks_only_with_its_own_salt(servers) -> None:  # type: ignore[no-untyped-def]
    cached = servers["cached"]
    chat(cached, "Which platform for Bath?")
    assert chat(cached, "Which platform for Bath?", cache_salt="tenant-a")[2] == 0
    assert chat(cached, "Which platform for Ely?", cache_salt="tenant-b")[2] == 0
    assert chat(cached, "Which platform for Ely?", cache_salt="tenant-a")[2] > 0


def test_skip_reading_prefix_cache_computes_the_whole_prompt(servers) -> None:  # type: ignore[no-untyped-def]
    cached = servers["cached"]
    prompt = list(range(1000, 1100))
    body = {"token_ids": prompt, "sampling_params": {"max_tokens": 2, "temperature": 0}}
    usage = [httpx.post(cached.url + "/inference/v1/generate", json=b, timeout=60).json()["usage"]
             for b in (body, body, body | {"sampling_params": body["sampling_params"] | {"skip_reading_prefix_cache": True}})]
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in usage] == [0, 96, 0]


def generate(server: ServerProcess, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(server.url + GENERATE, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_a_decode_leg_pulls_only_the_blocks_its_cache_lacks(servers) -> None:  # type: ignore[no-untyped-def]
    prefill, decode = servers["uncached"], servers["cached"]
    system = list(range(3000, 3160))  # 10 blocks shared by both prompts
    sampling = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    pulled_before = metric_sum(decode.url, "pdserve_kv_pulled_blocks_total")
    pulls = metric_sum(decode.url, "pdserve_kv_pulls_ok_total")
    answers = []
    for question in ([7, 8, 9], [11, 12, 13, 14]):
        prompt = system + question
        leg = generate(prefill, {"token_ids": prompt, "sampling_params": {"max_tokens": 1, "temperature": 0},
                                 "kv_transfer_params": {"do_remote_decode": True}})
        decoded = generate(decode, {"token_ids": prompt, "sampling_params": sampling,
                                    "kv_transfer_params": leg["kv_transfer_params"]})
        coupled = generate(prefill, {"token_ids": prompt, "sampling_params": sampling})
        assert decoded["choices"][0]["token_ids"] == coupled["choices"][0]["token_ids"]
        answers.append(decoded)
        pulls += 1
        wait_until(lambda: metric_sum(decode.url, "pdserve_kv_pulls_ok_total") == pulls,  # noqa: B023
                   "/metrics counts the pull (the engine core's next heartbeat)")
        pulled = metric_sum(decode.url, "pdserve_kv_pulled_blocks_total")
        answers[-1]["pulled"], pulled_before = pulled - pulled_before, pulled
    assert answers[0]["pulled"] == 11  # 163 positions: 11 blocks, none cached yet
    assert answers[1]["pulled"] == 1  # the 10 system blocks were kept when the first leg finished
    assert answers[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 160
    assert metric_sum(decode.url, "pdserve_kv_local_prefix_blocks_total") >= 10


def test_the_banner_says_it_and_a_scripted_server_refuses_it(servers) -> None:  # type: ignore[no-untyped-def]
    assert "prefix caching on (" in servers["cached"].log() and "blocks of 16 tokens, up to " in servers["cached"].log()
    assert "prefix caching off" in servers["uncached"].log()
    refused = subprocess.run([sys.executable, "-m", "pdserve.cli", "serve", "--engine", "scripted",
                              "--enable-prefix-caching"], capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "--enable-prefix-caching" in refused.stderr + refused.stdout
