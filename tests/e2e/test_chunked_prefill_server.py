"""`--max-num-batched-tokens` on a real server: a prompt far longer than the step budget, prefilled in chunks,
answers exactly as a server that prefills it whole (float32, --batch-invariant: the same bits), through the
generate endpoint with logprobs and prompt logprobs and as a P/D prefill leg whose KV another server decodes;
the ready banner says the budget; a scripted server refuses the flag."""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from pdserve.topology.process import start_all, stop_all
from tests.serverproc import ServerProcess

ENGINE = ("serve", "qwen3-tiny", "--dtype", "float32", "--batch-invariant", "--max-num-seqs", "4",
          "--kv-transfer", "nixl")
# 400 tokens: 25 chunks of what a 16-token budget leaves.
_RNG = random.Random(3)
PROMPT = [_RNG.randrange(100, 50000) for _ in range(400)]
GENERATE = "/inference/v1/generate"


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, ServerProcess]]:
    servers = {"chunked": ServerProcess(*ENGINE, "--max-num-batched-tokens", "16"), "whole": ServerProcess(*ENGINE)}
    try:
        start_all(list(servers.values()), timeout_s=300)
        yield servers
    finally:
        stop_all(list(servers.values()))


def generate(server: ServerProcess, body: dict) -> dict:  # type: ignore[type-arg]
    r = httpx.post(server.url + GENERATE, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_a_chunked_prompt_answers_as_a_whole_one(servers) -> None:  # type: ignore[no-untyped-def]
    # Seeded sampling: equal logits give equal draws (qwen3-tiny's greedy answers repeat one token).
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 12, "temperature": 0.8, "seed": 1, "logprobs": 3,
                                                      "prompt_logprobs": 2, "ignore_eos": True}}
    chunked, whole = generate(servers["chunked"], body), generate(servers["whole"], body)
    for answer in (chunked, whole):
        answer.pop("request_id", None)
    assert chunked["choices"] == whole["choices"] and chunked["prompt_logprobs"] == whole["prompt_logprobs"]
    assert len(set(chunked["choices"][0]["token_ids"])) > 1


def test_a_chunked_prefill_leg_hands_off_the_kv_of_the_whole_prompt(servers) -> None:  # type: ignore[no-untyped-def]
    leg = generate(servers["chunked"], {"token_ids": PROMPT, "sampling_params": {"max_tokens": 1, "temperature": 0},
                                        "kv_transfer_params": {"do_remote_decode": True}})
    params = leg["kv_transfer_params"]
    assert params["remote_num_tokens"] == len(PROMPT)
    sampling = {"max_tokens": 12, "temperature": 0.8, "seed": 1, "ignore_eos": True}
    pulled = generate(servers["whole"], {"token_ids": PROMPT, "sampling_params": sampling, "kv_transfer_params": params})
    computed = generate(servers["whole"], {"token_ids": PROMPT, "sampling_params": sampling})
    assert pulled["choices"][0]["token_ids"] == computed["choices"][0]["token_ids"]


def test_the_banner_says_the_budget_and_a_scripted_server_refuses_it(servers) -> None:  # type: ignore[no-untyped-def]
    assert "16 tokens per step (longer prompts prefill in chunks)" in servers["chunked"].log()
    assert "2048 tokens per step" in servers["whole"].log()
    refused = subprocess.run([sys.executable, "-m", "pdserve.cli", "serve", "--engine", "scripted",
                              "--max-num-batched-tokens", "64"], capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "--max-num-batched-tokens" in refused.stderr + refused.stdout
