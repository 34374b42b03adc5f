"""``--enable-per-request-metrics``: server-side timing as ``metrics`` on generate (every mode, batch and
stream) and the coupled endpoints, and nothing of it without the flag.

The scripted engine sleeps ``--step-ms`` between tokens, so a request of n tokens has spent at least
(n - 1) steps between its first and last token: a lower bound that holds however loaded the host is.
"""

from __future__ import annotations

import re
import time
from typing import Any

import httpx
import pytest

from tests.e2e.test_generate import PROMPT, SCRIPTS
from tests.serverproc import ServerProcess
from tests.sse import stream_post

STEP_MS = 5.0
MAX_TOKENS = 6
SERVER_ARGS = ("serve", "--engine", "scripted", "--tokenizer", "qwen3", "--script", str(SCRIPTS),
               "--step-ms", f"{STEP_MS:g}", "--reasoning-parser", "qwen3")
FIELDS = {"time_to_first_token_ms", "queue_time_ms", "generation_time_ms", "mean_itl_ms", "tokens_per_second"}


@pytest.fixture(scope="module")
def on():  # type: ignore[no-untyped-def]
    with ServerProcess(*SERVER_ARGS, "--enable-per-request-metrics") as srv:
        yield srv


@pytest.fixture(scope="module")
def off():  # type: ignore[no-untyped-def]
    with ServerProcess(*SERVER_ARGS) as srv:
        yield srv


def generate_body(mode: str, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"token_ids": PROMPT, "output_mode": mode, "stream": stream,
                            "sampling_params": {"max_tokens": MAX_TOKENS, "ignore_eos": True,
                                                "extra_args": {"script_index": 0}}}
    if mode == "derender":
        body["parse_context"] = {"chat_template_kwargs": {"enable_thinking": False}}
    return body


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_TOKENS, "ignore_eos": True,
        "vllm_xargs": {"script_index": 0}}
COMPLETION = {"prompt": "hi", "max_tokens": MAX_TOKENS, "ignore_eos": True, "vllm_xargs": {"script_index": 0}}
SURFACES = [("/inference/v1/generate", generate_body(m, False), generate_body(m, True)) for m in
            ("tokens", "text", "derender")] + [("/v1/chat/completions", CHAT, {**CHAT, "stream": True}),
                                               ("/v1/completions", COMPLETION, {**COMPLETION, "stream": True})]
IDS = ["generate-tokens", "generate-text", "generate-derender", "chat", "completions"]


def assert_sane(metrics: dict[str, Any], e2e_ms: float, tokens: int) -> None:
    assert set(metrics) == FIELDS
    ttft, gen = metrics["time_to_first_token_ms"], metrics["generation_time_ms"]
    assert 0 <= metrics["queue_time_ms"] <= ttft <= e2e_ms  # the engine's stamp: it ran before its first token
    assert ttft + gen <= e2e_ms
    # The engine sleeps a step between tokens; the frontend stamps each token when it takes it, so a first
    # token taken a little late on a loaded host shortens the span (a 1% margin failed by 0.1 ms once).
    assert gen >= (tokens - 1) * STEP_MS * 0.9
    assert metrics["mean_itl_ms"] == pytest.approx(gen / (tokens - 1))
    assert metrics["tokens_per_second"] == pytest.approx(tokens / ((ttft + gen) / 1000))


@pytest.mark.parametrize(("path", "batch", "stream"), SURFACES, ids=IDS)
def test_batch_response_carries_metrics(on, path: str, batch: dict, stream: dict) -> None:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    response = httpx.post(on.url + path, json=batch, timeout=30)
    e2e_ms = (time.perf_counter() - started) * 1000
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["completion_tokens"] == MAX_TOKENS
    assert_sane(body["metrics"], e2e_ms, MAX_TOKENS)


@pytest.mark.parametrize(("path", "batch", "stream"), SURFACES, ids=IDS)
def test_only_the_final_stream_chunk_carries_metrics(on, path: str, batch: dict, stream: dict) -> None:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    events, done = stream_post(on.url + path, stream)
    e2e_ms = (time.perf_counter() - started) * 1000
    assert done
    with_metrics = [i for i, ev in enumerate(events) if ev.get("metrics") is not None]
    finishing = [i for i, ev in enumerate(events) if ev["choices"] and ev["choices"][0].get("finish_reason")]
    assert with_metrics == finishing and len(finishing) == 1
    assert_sane(events[with_metrics[0]]["metrics"], e2e_ms, MAX_TOKENS)


@pytest.mark.parametrize(("path", "batch", "stream"), SURFACES, ids=IDS)
def test_no_metrics_without_the_flag(off, path: str, batch: dict, stream: dict) -> None:  # type: ignore[no-untyped-def]
    response = httpx.post(off.url + path, json=batch, timeout=30)
    assert response.status_code == 200
    assert response.json().get("metrics") is None
    events, _ = stream_post(off.url + path, stream)
    assert all(ev.get("metrics") is None for ev in events)
    if path == "/inference/v1/generate":  # generate chunks omit the key when null, as vLLM does
        assert all("metrics" not in ev for ev in events)


def test_derender_passes_metrics_through(on) -> None:  # type: ignore[no-untyped-def]
    # vLLM's derender copies the generate response's (chunk's) metrics into its OpenAI answer.
    gen = httpx.post(on.url + "/inference/v1/generate", json=generate_body("tokens", False), timeout=30).json()
    batch = httpx.post(on.url + "/v1/completions/derender", timeout=30,
                       json={"generate_responses": [gen], "prompt_token_ids": [PROMPT]}).json()
    assert batch["metrics"] == gen["metrics"] and gen["metrics"]["generation_time_ms"] > 0
    events, _ = stream_post(on.url + "/inference/v1/generate", generate_body("tokens", True))
    final = next(ev for ev in events if ev.get("metrics"))
    answer = httpx.post(on.url + "/v1/chat/completions/derender", timeout=30, json={
        "stream": True, "generate_chunk": final, "stream_state": None, "prompt_token_ids": PROMPT,
        "chat_request": {"messages": [{"role": "user", "content": "hi"}],
                         "chat_template_kwargs": {"enable_thinking": False}}}).json()
    assert answer["chunk"]["metrics"] == final["metrics"]


def _histogram(url: str, name: str) -> tuple[float, float, dict[str, float]]:
    """count, sum and cumulative buckets (le -> count) of an unlabelled histogram in /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    buckets = {m.group(1): float(m.group(2)) for m in re.finditer(rf'^{name}_bucket{{le="([^"]+)"}} (\S+)$', text, re.MULTILINE)}
    count = float(re.search(rf"^{name}_count (\S+)$", text, re.MULTILINE).group(1))  # type: ignore[union-attr]
    total = float(re.search(rf"^{name}_sum (\S+)$", text, re.MULTILINE).group(1))  # type: ignore[union-attr]
    return count, total, buckets


def test_ttft_and_tpot_histograms_count_every_finished_request_with_or_without_the_flag(off) -> None:  # type: ignore[no-untyped-def]
    """vLLM's time_to_first_token_seconds and request_time_per_output_token_seconds, as pdserve_*: one
    observation per finished request on every surface, batch and stream (pdserve top and the dashboard read
    them)."""
    ttft_before, _, _ = _histogram(off.url, "pdserve_time_to_first_token_seconds")
    tpot_before, tpot_sum_before, _ = _histogram(off.url, "pdserve_time_per_output_token_seconds")
    for path, batch, stream in SURFACES:
        assert httpx.post(off.url + path, json=batch, timeout=30).status_code == 200
        assert stream_post(off.url + path, stream)[1]
    ttft_count, _, buckets = _histogram(off.url, "pdserve_time_to_first_token_seconds")
    tpot_count, tpot_sum, _ = _histogram(off.url, "pdserve_time_per_output_token_seconds")
    assert ttft_count - ttft_before == tpot_count - tpot_before == 2 * len(SURFACES)
    assert buckets["+Inf"] == ttft_count
    # Each request spent at least a step between tokens (the scripted engine's --step-ms): its TPOT too.
    assert (tpot_sum - tpot_sum_before) / (tpot_count - tpot_before) >= STEP_MS / 1000 * 0.9
