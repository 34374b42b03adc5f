"""``pdserve serve MODEL_DIR --engine vllm``: pdserve's frontend on vLLM's AsyncLLM answers like vLLM's own
coupled endpoints on the same model dir, and passes the whole conformance kit (output_mode derender and
streaming derender included, which vLLM 0.32 itself lacks)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.interop.peers import MODEL_NAME, PARSER_ARGS, VllmPeer, engine_core_beside_its_worker, pdserve
from tests.interop.test_peer import CHATS
from tests.serverproc import ServerProcess
from tests.sse import stream_post


@pytest.fixture(scope="module")
def on_vllm(model_dir: Path) -> Iterator[ServerProcess]:
    with pdserve(model_dir, "--engine", "vllm", *PARSER_ARGS) as srv:
        engine_core_beside_its_worker(srv)
        yield srv


def answer(server: ServerProcess, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(server.url + path, json={"model": MODEL_NAME, **body}, timeout=120)
    assert r.status_code == 200, r.text[:500]
    return r.json()


def comparable(choice: dict[str, Any]) -> dict[str, Any]:
    """What both servers must agree on in a choice (vLLM adds always-null extras such as ``refusal``)."""
    message = choice.get("message") or {}
    keep = {k: message.get(k) for k in ("role", "content", "reasoning")}
    keep["tool_calls"] = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
    return {**keep, "index": choice["index"], "text": choice.get("text"), "finish_reason": choice["finish_reason"]}


def test_engine_vllm_chat_equals_vllm_chat(on_vllm: ServerProcess, vllm: VllmPeer) -> None:
    seeded_n2 = {"messages": CHATS[0]["messages"], "n": 2, "temperature": 1.0, "seed": 5}
    for chat in [*CHATS, seeded_n2]:
        body = {"max_tokens": 20, "temperature": 0, "logprobs": True, "top_logprobs": 2, **chat}
        ours, theirs = answer(on_vllm, "/v1/chat/completions", body), answer(vllm, "/v1/chat/completions", body)
        assert [comparable(c) for c in ours["choices"]] == [comparable(c) for c in theirs["choices"]], chat
        assert ours["usage"]["completion_tokens"] == theirs["usage"]["completion_tokens"]
        assert ours["usage"]["prompt_tokens"] == theirs["usage"]["prompt_tokens"]
        ours_lp = [e["token"] for e in ours["choices"][0]["logprobs"]["content"]]
        assert ours_lp == [e["token"] for e in theirs["choices"][0]["logprobs"]["content"]]


def test_engine_vllm_completions_equal_vllm_completions(on_vllm: ServerProcess, vllm: VllmPeer) -> None:
    for sampling in ({}, {"stop": [" Formats Formats"]}, {"seed": 7, "temperature": 1.0}):
        body = {"prompt": "The colours are", "max_tokens": 16, "temperature": 0, **sampling}
        ours, theirs = answer(on_vllm, "/v1/completions", body), answer(vllm, "/v1/completions", body)
        assert [comparable(c) for c in ours["choices"]] == [comparable(c) for c in theirs["choices"]], sampling


def test_engine_vllm_streams_like_vllm(on_vllm: ServerProcess, vllm: VllmPeer) -> None:
    body = {"model": MODEL_NAME, **CHATS[0], "max_tokens": 16, "temperature": 0, "stream": True}
    texts = []
    for server in (on_vllm, vllm):
        events, done = stream_post(server.url + "/v1/chat/completions", body)
        assert done
        deltas = [c["delta"] for ev in events for c in ev["choices"]]
        texts.append(
            ("".join(d.get("content") or "" for d in deltas), "".join(d.get("reasoning") or "" for d in deltas))
        )
    assert texts[0] == texts[1]
    # A stream interval goes to vLLM's own output processor: the same ids in the same chunks as vLLM's.
    rendered = answer(on_vllm, "/v1/chat/completions/render", {**CHATS[0], "max_tokens": 23, "temperature": 0})
    generate = {**rendered, "stream": True, "sampling_params": {**rendered["sampling_params"], "stream_interval": 4}}
    chunks = []
    for server in (on_vllm, vllm):
        events, done = stream_post(server.url + "/inference/v1/generate", generate)
        assert done
        chunks.append([e["choices"][0]["token_ids"] for e in events])
    assert chunks[0] == chunks[1] and [len(c) for c in chunks[0]] == [1, 4, 4, 4, 4, 4, 2]


def test_engine_vllm_passes_the_conformance_kit(on_vllm: ServerProcess) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "conformance", on_vllm.url, "--parsers", "qwen3", "hermes"],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 FAIL, 0 unsupported" in proc.stdout


def test_engine_vllm_refuses_what_vllm_refuses(on_vllm: ServerProcess) -> None:
    # vLLM's own request checks come back as the client's 400 with vLLM's reason, never a 500.
    r = httpx.post(
        on_vllm.url + "/v1/chat/completions",
        timeout=60,
        json={"model": MODEL_NAME, **CHATS[0], "n": 2, "temperature": 0, "max_tokens": 4},
    )
    assert r.status_code == 400, r.text
    assert "greedy" in r.json()["error"]["message"]
