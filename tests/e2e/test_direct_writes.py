"""Streams written from the engine's dispatch (serve.driver's direct path) on a real server: the torch
engine in its core process, streamed generate read by httpx and chat and completions by the openai SDK,
against the same request answered in batch.

The direct path must carry the middle of every such stream (``pdserve_direct_outputs_total`` counts it)
and change nothing the client sees; a request with stop strings, and a completions request with several
prompts, keep to the stream's own loop."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.serverproc import ServerProcess
from tests.sse import parse_sse, stream_post
from tests.waiting import wait_until

PROMPT = [9707, 11, 1879, 0, 151644, 872, 198]
DIRECT = "pdserve_direct_outputs_total"
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    # Every test sends its prompt twice (batch, then stream) and compares the answers: without the prefix cache
    # the second computes what the first did (read past a cached prefix, bf16 rows agree only to rounding).
    with ServerProcess("serve", "qwen3-tiny", "--max-model-len", "1024", "--no-enable-prefix-caching") as srv:
        yield srv


def batch_and_stream(srv: ServerProcess, mode: str, **sampling: Any) -> tuple[dict, list[dict], float]:
    """The batch answer, the stream's events, and how many outputs the direct path took for the stream."""
    params = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **sampling}
    body: dict[str, Any] = {"token_ids": PROMPT, "output_mode": mode, "sampling_params": params}
    if mode == "derender":
        body["chat_request"] = {"messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(srv.url + "/inference/v1/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    before = srv.metric(DIRECT)
    events, done = stream_post(srv.url + "/inference/v1/generate", {**body, "stream": True})
    assert done
    return r.json(), events, srv.metric(DIRECT) - before


def joined(events: list[dict], index: int, key: str) -> Any:
    parts = [c[key] for ev in events for c in ev["choices"] if c["index"] == index and c.get(key) is not None]
    return "".join(parts) if parts and isinstance(parts[0], str) else [x for p in parts for x in p]


@pytest.mark.parametrize("mode", ["tokens", "text", "derender"])
def test_a_stream_written_from_the_dispatch_spells_the_batch_answer(server: ServerProcess, mode: str) -> None:
    batch, events, direct = batch_and_stream(server, mode)
    choice = batch["choices"][0]
    assert joined(events, 0, "token_ids") == choice["token_ids"] and len(choice["token_ids"]) == MAX_TOKENS
    if mode == "text":
        assert joined(events, 0, "text") == choice["text"]
    if mode == "derender":
        content = "".join((c["delta"].get("content") or "") for ev in events for c in ev["choices"])
        assert content == choice["message"]["content"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    # One output per engine step: all but the first and the last may go direct, and most must.
    assert MAX_TOKENS // 2 <= direct <= MAX_TOKENS - 2


def test_two_sequences_and_logprobs_go_direct_and_stay_apart(server: ServerProcess) -> None:
    batch, events, direct = batch_and_stream(server, "text", n=2, temperature=1.0, seed=7, logprobs=3)
    for choice in batch["choices"]:
        i = choice["index"]
        assert joined(events, i, "token_ids") == choice["token_ids"]
        assert joined(events, i, "text") == choice["text"]
        streamed = [p for ev in events for c in ev["choices"] if c["index"] == i and c["logprobs"]
                    for p in c["logprobs"]["content"]]
        assert [p["token"] for p in streamed] == [p["token"] for p in choice["logprobs"]["content"]]
        assert [p["logprob"] for p in streamed] == pytest.approx([p["logprob"] for p in choice["logprobs"]["content"]],
                                                                 abs=1e-4)
    assert direct >= MAX_TOKENS


def test_a_request_with_stop_strings_keeps_to_the_streams_own_loop(server: ServerProcess) -> None:
    batch, events, direct = batch_and_stream(server, "text", stop=["\u0000never\u0000"])
    assert joined(events, 0, "text") == batch["choices"][0]["text"]
    assert direct == 0


def test_chat_and_completions_streams_go_direct_through_the_sdk(server: ServerProcess) -> None:
    """The coupled OpenAI endpoints take the same path (one prompt); the official SDK reads them."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    extra = {"ignore_eos": True}
    messages = [{"role": "user", "content": "hi"}]
    batch = client.chat.completions.create(model="qwen3-tiny", messages=messages, max_tokens=MAX_TOKENS,  # type: ignore[arg-type]
                                           temperature=0, extra_body=extra)
    before = server.metric(DIRECT)
    stream = client.chat.completions.create(model="qwen3-tiny", messages=messages, max_tokens=MAX_TOKENS,  # type: ignore[arg-type]
                                            temperature=0, extra_body=extra, stream=True)
    content = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert content == batch.choices[0].message.content
    assert server.metric(DIRECT) - before >= MAX_TOKENS // 2

    text = client.completions.create(model="qwen3-tiny", prompt="Count:", max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body=extra).choices[0].text
    before = server.metric(DIRECT)
    parts = client.completions.create(model="qwen3-tiny", prompt="Count:", max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body=extra, stream=True)
    assert "".join(c.choices[0].text for c in parts) == text
    assert server.metric(DIRECT) - before >= MAX_TOKENS // 2

    # Two prompts are merged through a queue: that stream keeps to its own loop, and still spells both.
    before = server.metric(DIRECT)
    two = client.completions.create(model="qwen3-tiny", prompt=["Count:", "Count:"], max_tokens=8, temperature=0,
                                    extra_body=extra, stream=True)
    by_index: dict[int, str] = {}
    for c in two:
        for ch in c.choices:
            by_index[ch.index] = by_index.get(ch.index, "") + ch.text
    assert by_index[0] == by_index[1] == client.completions.create(
        model="qwen3-tiny", prompt="Count:", max_tokens=8, temperature=0, extra_body=extra).choices[0].text
    assert server.metric(DIRECT) == before


def dechunk(raw: bytes) -> bytes:
    """The body of a chunked HTTP/1.1 response (its head cut off)."""
    body, rest = b"", raw.split(b"\r\n\r\n", 1)[1]
    while True:
        size_line, rest = rest.split(b"\r\n", 1)
        size = int(size_line, 16)
        if size == 0:
            return body
        body, rest = body + rest[:size], rest[size + 2:]


def test_a_slow_reader_falls_back_to_the_streams_loop_and_loses_nothing(server: ServerProcess) -> None:
    """A client with a tiny receive window that reads nothing while the whole answer is produced: the
    connection's buffer passes its high mark, outputs wait in the stream's own send, and direct writes resume
    once it has caught up. What the client finally reads is every sequence whole, in order.

    The answer must be larger than what the kernel takes off the server's hands (its send buffer autotunes to
    ``net.ipv4.tcp_wmem``'s 4 MiB here): 16 sequences of 250 tokens with 20 logprobs each are ~8 MB. With a
    1 MB answer every output went direct, and the test passed only because the first step once sent two
    outputs that went by the stream's loop."""
    n, tokens = 16, 250
    sampling = {"n": n, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "logprobs": 20}  # ~2 KB a chunk
    body = {"token_ids": PROMPT, "output_mode": "text", "sampling_params": sampling, "stream": True}
    payload = json.dumps(body).encode()
    before = server.metric(DIRECT)
    conn = socket.socket()
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    conn.connect(("127.0.0.1", server.port))
    try:
        conn.sendall(b"POST /inference/v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        # The engine runs on (16 x 250 tokens: a few seconds); the server's writes back up.
        running = "pdserve_engine_running_requests"
        wait_until(lambda: server.metric(running) == 1, "the engine runs the request")
        wait_until(lambda: server.metric(running) == 0, "the engine produced every token", bound_s=120)
        conn.settimeout(60)
        raw = b""
        while chunk := conn.recv(1 << 16):
            raw += chunk
    finally:
        conn.close()
    events, done = parse_sse(dechunk(raw).decode().splitlines())
    assert done
    # Greedy: the 16 sequences are one answer, computed as 16 identical rows of each step: a chunk lost, doubled
    # or out of order in any of them shows as a difference.
    answers = {(tuple(joined(events, i, "token_ids")), joined(events, i, "text")) for i in range(n)}
    assert len(answers) == 1 and len(next(iter(answers))[0]) == tokens
    direct = server.metric(DIRECT) - before
    # Without the fall-back every output would go direct but each sequence's first (sent before the sink is
    # attached) and its last (an end always goes by the stream's loop): n * (tokens - 2). Here ~1,400 of 4,000
    # went direct, what the kernel took before the connection's buffer passed its high mark.
    assert 0 < direct < n * (tokens - 3), "outputs must have waited in the stream's own send, the rest gone direct"


def test_a_client_that_leaves_mid_stream_has_its_request_aborted(server: ServerProcess) -> None:
    body = {"token_ids": PROMPT, "stream": True, "sampling_params": {"max_tokens": 240, "ignore_eos": True}}
    before = server.metric(DIRECT)
    with httpx.stream("POST", server.url + "/inference/v1/generate", json=body, timeout=60) as r:
        for n, _line in enumerate(r.iter_lines()):
            if n > 40:
                break  # closes the connection while the dispatch writes this stream
    assert server.metric(DIRECT) > before
    wait_until(lambda: server.metric("pdserve_engine_running_requests") == 0, "the engine request ended")
    wait_until(lambda: server.metric("pdserve_running_requests") == 0, "the stream ended")
    wait_until(lambda: server.metric("pdserve_live_request_states") == 0, "its request state was freed")
    assert server.metric('pdserve_requests_total{endpoint="generate",output_mode="tokens",status="499"}') >= 1
