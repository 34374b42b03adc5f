"""``--stream-interval`` and ``stream_interval`` on real servers (scripted engine, one token per step, Qwen3
tokenizer): a chunk per N tokens of a sequence, the first token and the end at once, the same answer as a
chunk per step, the request's value raised to the server's, 400 below 1."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.e2e.test_generate import PROMPT, SCRIPTS, body, gen, script_texts, scripted  # noqa: F401
from tests.e2e.test_ready_banner import banner
from tests.serverproc import ServerProcess
from tests.sse import stream_post

SERVER_INTERVAL = 3


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with scripted("--stream-interval", str(SERVER_INTERVAL), "--reasoning-parser", "qwen3") as srv:
        yield srv


def chunk_sizes(events: list[dict]) -> list[int]:
    return [len(ev["choices"][0]["token_ids"]) for ev in events]


def assert_chunked_by(sizes: list[int], interval: int) -> None:
    """The first chunk is the first token; then full chunks; the last holds what was left."""
    assert sizes[0] == 1, sizes
    assert all(size == interval for size in sizes[1:-1]), sizes
    assert 1 <= sizes[-1] <= interval, sizes


@pytest.mark.parametrize(("asked", "interval"), [(None, SERVER_INTERVAL), (2, SERVER_INTERVAL), (5, 5)])
def test_tokens_come_in_chunks_of_the_larger_interval(server: ServerProcess, asked: int | None, interval: int) -> None:
    sampling = {"max_tokens": 20, "extra_args": {"script_index": 0}} | ({"stream_interval": asked} if asked else {})
    batch = gen(server, {"token_ids": PROMPT, "sampling_params": sampling})["choices"][0]
    events, done = stream_post(server.url + "/inference/v1/generate",
                               {"token_ids": PROMPT, "stream": True, "sampling_params": sampling})
    assert done
    assert_chunked_by(chunk_sizes(events), interval)
    assert [t for ev in events for t in ev["choices"][0]["token_ids"]] == batch["token_ids"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_an_interval_past_any_length_sends_the_first_token_and_the_rest(server: ServerProcess) -> None:
    sampling = {"max_tokens": 20, "extra_args": {"script_index": 0}, "stream_interval": 10**30}
    events, done = stream_post(server.url + "/inference/v1/generate",
                               {"token_ids": PROMPT, "stream": True, "sampling_params": sampling})
    assert done and chunk_sizes(events) == [1, 19]


def test_text_streams_spell_the_batch_text(server: ServerProcess, script_texts: list[str]) -> None:  # noqa: F811
    for i, expected in enumerate(script_texts):
        events, done = stream_post(server.url + "/inference/v1/generate",
                                   {**body(script=i, logprobs=1), "stream": True})
        assert done and "".join(ev["choices"][0]["text"] for ev in events) == expected
        # Logprobs stay with their tokens, one entry per id, however the ids were chunked.
        for ev in events:
            choice = ev["choices"][0]
            assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])
        assert len(events) < len(gen(server, body(script=i))["choices"][0]["token_ids"]) / 2


def test_a_stop_string_inside_a_chunk_cuts_the_answer_as_without_one(server: ServerProcess) -> None:
    events, done = stream_post(server.url + "/inference/v1/generate",
                               {**body(script=0, stop=["commas"]), "stream": True})
    assert done
    last = events[-1]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", "commas")
    assert "".join(ev["choices"][0]["text"] for ev in events) == \
        "Hello there! This is a plain English answer, with punctuation: "


def test_chat_stream_through_the_sdk(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)
    messages = [{"role": "user", "content": "Hi"}]
    extra = {"vllm_xargs": {"script_index": 3}}
    streams = {}
    for interval in (1, 6):  # 1: raised to the server's 3
        chunks = list(client.chat.completions.create(
            model="scripted", messages=messages, stream=True,  # type: ignore[arg-type]
            extra_body={**extra, "stream_interval": interval}, stream_options={"include_usage": True},
        ))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
        streams[interval] = ("".join(d.content or "" for d in deltas),
                             "".join(getattr(d, "reasoning", None) or "" for d in deltas), len(deltas))
        tokens = chunks[-1].usage.completion_tokens  # type: ignore[union-attr]
        # The role chunk, the first token, full chunks, the end.
        assert len(deltas) <= 3 + (tokens - 1) // max(interval, SERVER_INTERVAL)
    assert streams[6][:2] == streams[1][:2] and streams[6][0].strip() == "The answer is 391."
    assert streams[6][2] < streams[1][2]


@pytest.mark.parametrize("value", [0, -2])
def test_an_interval_below_one_is_a_400_naming_it(server: ServerProcess, value: int) -> None:
    r = httpx.post(server.url + "/inference/v1/generate",
                   json={"token_ids": PROMPT, "stream": True, "sampling_params": {"stream_interval": value}})
    assert r.status_code == 400 and "stream_interval" in r.text
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "Hi"}], "stream": True, "stream_interval": value})
    assert r.status_code == 400 and "stream_interval" in r.text


def test_render_passes_it_on_and_the_banner_says_it(server: ServerProcess) -> None:
    rendered = httpx.post(server.url + "/v1/chat/completions/render",
                          json={"messages": [{"role": "user", "content": "Hi"}], "stream_interval": 4}).json()
    assert rendered["sampling_params"]["stream_interval"] == 4
    assert f"streams    a chunk per {SERVER_INTERVAL} tokens of a sequence" in banner(server)


def test_the_flag_is_checked() -> None:
    run = subprocess.run([sys.executable, "-m", "pdserve.cli", "serve", "--engine", "scripted", "--script",
                          str(SCRIPTS), "--stream-interval", "0"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--stream-interval must be at least 1" in run.stderr


@pytest.fixture(scope="module")
def torch_server() -> Iterator[ServerProcess]:
    """The torch engine in its core process, where outputs are held until a chunk is due."""
    with ServerProcess("serve", "qwen3-tiny", "--max-model-len", "256", "--stream-interval", "4") as srv:
        yield srv


def test_the_engine_core_sends_chunks_and_stop_strings_still_cut(torch_server: ServerProcess) -> None:
    sampling = {"max_tokens": 40, "temperature": 0, "ignore_eos": True, "skip_special_tokens": False}
    batch = gen(torch_server, {"token_ids": PROMPT, "output_mode": "text", "sampling_params": sampling})["choices"][0]
    events, done = stream_post(torch_server.url + "/inference/v1/generate",
                               {"token_ids": PROMPT, "output_mode": "text", "stream": True, "sampling_params": sampling})
    assert done and "".join(ev["choices"][0]["text"] for ev in events) == batch["text"]
    assert [t for ev in events for t in ev["choices"][0]["token_ids"]] == batch["token_ids"]
    assert len(events) <= 2 + 39 // 4
    # A stop string from the middle of the answer, found inside a chunk: the same cut as a batch request.
    text = batch["text"]
    # (Greedy output of random weights: take the first window past the middle that is plain enough to match.)
    stop = next(text[i: i + 3] for i in range(len(text) // 2, len(text) - 3)
                if text[i: i + 3].strip() and "\ufffd" not in text[i: i + 3] and text.index(text[i: i + 3]) > 0)
    stopped = {**sampling, "stop": [stop]}
    want = gen(torch_server, {"token_ids": PROMPT, "output_mode": "text", "sampling_params": stopped})["choices"][0]
    events, done = stream_post(torch_server.url + "/inference/v1/generate",
                               {"token_ids": PROMPT, "output_mode": "text", "stream": True, "sampling_params": stopped})
    assert done and "".join(ev["choices"][0]["text"] for ev in events) == want["text"] == text[: text.index(stop)]
    assert (events[-1]["choices"][0]["finish_reason"], events[-1]["choices"][0]["stop_reason"]) == ("stop", stop)
    assert [t for ev in events for t in ev["choices"][0]["token_ids"]] == want["token_ids"]


def test_an_interval_past_any_length_crosses_to_the_engine_core(torch_server: ServerProcess) -> None:
    # Capped at the model length on the way: the engine wire carries 64-bit ints.
    sampling = {"max_tokens": 9, "temperature": 0, "ignore_eos": True, "stream_interval": 10**30}
    events, done = stream_post(torch_server.url + "/inference/v1/generate",
                               {"token_ids": PROMPT, "stream": True, "sampling_params": sampling})
    assert done and chunk_sizes(events) == [1, 8]
