"""Generate server e2e: real ``pdserve serve`` processes on loopback, scripted engine, Qwen3 tokenizer."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import httpx
import pytest

from pdserve.protocol.generate import generate_response_adapter, generate_stream_response_adapter
from pdserve.text.tokenizer import Tokenizer
from tests.serverproc import ServerProcess
from tests.sse import assert_tail_flushed, stream_and_abort, stream_post
from tests.waiting import wait_metric, wait_until

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
SCRIPTS = FIXTURES / "scripts.jsonl"
PROMPT = [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]
EOS = 151645


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.load("qwen3")


@pytest.fixture(scope="module")
def script_texts() -> list[str]:
    return [json.loads(line)["text"] for line in SCRIPTS.read_text().splitlines() if line.strip()]


def scripted(*extra: str, **kw) -> ServerProcess:  # type: ignore[no-untyped-def]
    return ServerProcess("serve", "--engine", "scripted", "--tokenizer", "qwen3", "--script", str(SCRIPTS), *extra, **kw)


@pytest.fixture(scope="module", params=[1, 2, 7], ids=lambda k: f"{k}-per-step")
def server(request):  # type: ignore[no-untyped-def]
    with scripted("--tokens-per-step", str(request.param)) as srv:
        yield srv


@pytest.fixture(scope="module")
def slow_server():  # type: ignore[no-untyped-def]
    with scripted("--step-ms", "40", "--max-num-seqs", "4") as srv:
        yield srv


def gen(srv: ServerProcess, body: dict, status: int = 200) -> dict:
    r = httpx.post(srv.url + "/inference/v1/generate", json=body, headers=srv.headers, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def body(mode: str = "text", script: int | None = None, **sampling) -> dict:  # type: ignore[no-untyped-def]
    if script is not None:
        sampling["extra_args"] = {"script_index": script}
    return {"token_ids": PROMPT, "output_mode": mode, "sampling_params": sampling}


def test_text_is_decode_of_token_ids(server, tok, script_texts) -> None:  # type: ignore[no-untyped-def]
    seen = set()
    for _ in script_texts:
        res = gen(server, body())  # round-robin over the scripts
        choice = res["choices"][0]
        assert res["output_mode"] == "text"
        ids = choice["token_ids"]
        assert choice["finish_reason"] == "stop" and choice["stop_reason"] is None
        assert ids[-1] == EOS, "a script ends with EOS, which stays in token_ids"
        assert choice["text"] == tok.decode(ids[:-1], skip_special_tokens=True)
        seen.add(choice["text"])
        generate_response_adapter.validate_python(res)
    assert seen == set(script_texts), "round-robin covers every script, multi-byte text intact"


def test_stream_deltas_concatenate_to_batch(server, script_texts) -> None:  # type: ignore[no-untyped-def]
    for i, expected in enumerate(script_texts):
        batch = gen(server, body(script=i))["choices"][0]
        assert batch["text"] == expected
        events, done = stream_post(server.url + "/inference/v1/generate", {**body(script=i), "stream": True})
        assert done
        for ev in events:
            generate_stream_response_adapter.validate_python(ev)
            assert ev["output_mode"] == "text" and len(ev["choices"]) == 1
        text = "".join(ev["choices"][0]["text"] for ev in events)
        ids = [i for ev in events for i in ev["choices"][0]["token_ids"]]
        assert text == batch["text"]
        assert ids == batch["token_ids"]
        assert events[-1]["choices"][0]["finish_reason"] == "stop"
        assert all(ev["choices"][0]["finish_reason"] is None for ev in events[:-1])


def test_tokens_mode_unchanged(server) -> None:  # type: ignore[no-untyped-def]
    res = gen(server, {"token_ids": PROMPT, "sampling_params": {"max_tokens": 5, "logprobs": 2}})
    assert res["output_mode"] == "tokens"
    choice = res["choices"][0]
    assert "text" not in choice and "message" not in choice
    assert len(choice["token_ids"]) == 5 and choice["finish_reason"] == "length"
    content = choice["logprobs"]["content"]
    assert [c["token_id"] for c in content] == choice["token_ids"]
    for c in content:
        assert isinstance(c["token_id"], int)
        assert c["top_logprobs"][0]["token_id"] == c["token_id"]
        assert all(isinstance(t["token_id"], int) for t in c["top_logprobs"])
    events, done = stream_post(server.url + "/inference/v1/generate", {"token_ids": PROMPT, "stream": True,
                                                                       "sampling_params": {"max_tokens": 5}})
    assert done and all("text" not in ev["choices"][0] for ev in events)
    assert sum(len(ev["choices"][0]["token_ids"]) for ev in events) == 5


EMOJI_SCRIPT = 2  # its emoji are split over ids that decode alone to U+FFFD


def test_text_logprobs_are_decoded(server, tok) -> None:  # type: ignore[no-untyped-def]
    res = gen(server, body(script=EMOJI_SCRIPT, logprobs=3))
    choice = res["choices"][0]
    assert any("\ufffd" in tok.decode([i]) for i in choice["token_ids"]), "the script must have split characters"
    content = choice["logprobs"]["content"]
    assert len(content) == len(choice["token_ids"])
    # Byte-fallback pieces are repaired with context: the logprob tokens spell the text.
    assert "".join(c["token"] for c in content) == tok.decode(choice["token_ids"], skip_special_tokens=False)
    for c in content:
        assert c["bytes"] == list(c["token"].encode())
        assert c["top_logprobs"][0]["token"] == c["token"]


def test_stop_strings(server, tok) -> None:  # type: ignore[no-untyped-def]
    for include in (False, True):
        res = gen(server, body(script=0, stop=["periods", "commas"], include_stop_str_in_output=include))
        choice = res["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["stop_reason"] == "commas"
        head = "Hello there! This is a plain English answer, with punctuation: "
        assert choice["text"] == head + ("commas" if include else "")
        decoded = tok.decode(choice["token_ids"])
        # token_ids keep every generated id up to the one that completed the stop string.
        assert decoded.startswith(head + "commas") and tok.decode(choice["token_ids"][:-1]).find("commas") < 0


def test_streamed_stop_never_leaks(server) -> None:  # type: ignore[no-untyped-def]
    events, done = stream_post(
        server.url + "/inference/v1/generate", {**body(script=1, stop=["世界", "答："]), "stream": True}
    )
    last = events[-1]["choices"][0]
    assert done and last["stop_reason"] == "答：" and last["finish_reason"] == "stop"
    assert "".join(ev["choices"][0]["text"] for ev in events) == "中文回"
    for ev in events:
        assert "答" not in ev["choices"][0]["text"]


def test_min_tokens_and_ignore_eos(server) -> None:  # type: ignore[no-untyped-def]
    res = gen(server, body(max_tokens=300, min_tokens=250))
    choice = res["choices"][0]
    assert len(choice["token_ids"]) >= 250
    res = gen(server, body(max_tokens=120, ignore_eos=True))
    assert res["choices"][0]["finish_reason"] == "length" and len(res["choices"][0]["token_ids"]) == 120


def test_n_choices(server, script_texts) -> None:  # type: ignore[no-untyped-def]
    res = gen(server, body(script=2, n=2, max_tokens=4))
    assert [c["index"] for c in res["choices"]] == [0, 1]
    assert res["usage"]["completion_tokens"] == 8
    events, done = stream_post(server.url + "/inference/v1/generate", {**body(script=2, n=3), "stream": True})
    assert done and {ev["choices"][0]["index"] for ev in events} == {0, 1, 2}
    for i in range(3):
        mine = [ev["choices"][0] for ev in events if ev["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == script_texts[2]
        assert mine[-1]["finish_reason"] == "stop"


def test_stop_token_ids(server, tok) -> None:  # type: ignore[no-untyped-def]
    probe = gen(server, body("tokens", script=0, max_tokens=3))
    stop_id = probe["choices"][0]["token_ids"][2]
    choice = gen(server, body(script=0, stop_token_ids=[stop_id]))["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop_id
    assert choice["token_ids"] == probe["choices"][0]["token_ids"]
    assert choice["text"] == tok.decode(choice["token_ids"][:2])


def test_omitted_max_tokens_uses_model_room(server) -> None:  # type: ignore[no-untyped-def]
    res = gen(server, body(ignore_eos=True))  # no max_tokens: runs to the model length, not 16
    assert len(res["choices"][0]["token_ids"]) == 32768 - len(PROMPT)


def test_abort_mid_stream_gives_final_chunk(slow_server, tok) -> None:  # type: ignore[no-untyped-def]
    rid = "abort-me"
    stop = "zzzzzzzz"
    req = {**body(ignore_eos=True, max_tokens=2000, stop=[stop]), "stream": True, "request_id": rid}

    def abort() -> None:
        a = httpx.post(slow_server.url + "/abort_requests", json={"request_ids": ["generate-tokens-" + rid]}, timeout=60)
        assert a.status_code == 200 and a.text == ""

    events, done = stream_and_abort(slow_server.url + "/inference/v1/generate", req, 3, abort)
    assert done
    assert_tail_flushed(events, tok, lambda choice: choice["text"], hold_back=len(stop) - 1)
    wait_metric(slow_server, "pdserve_engine_running_requests", 0)
    wait_metric(slow_server, "pdserve_running_requests", 0)


def send_and_hang_up(srv: ServerProcess, payload: dict) -> None:
    """POST ``payload`` to generate on a raw connection and hang up once the engine runs it.

    A raw socket, because an HTTP client only gives up on a timer; here the hang-up comes
    exactly when the request is known to be in the engine.
    """
    data = json.dumps(payload).encode()
    head = (
        f"POST /inference/v1/generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", srv.port)) as conn:
        conn.sendall(head + data)
        wait_metric(srv, "pdserve_engine_running_requests", 1)


def counted(status: int) -> str:
    """The sample that counts text-mode generate requests answered with ``status``."""
    return f'pdserve_requests_total{{endpoint="generate",output_mode="text",status="{status}"}}'


def test_client_disconnect_frees_engine(slow_server) -> None:  # type: ignore[no-untyped-def]
    req = {**body(ignore_eos=True, max_tokens=2000), "stream": True}
    left_before = slow_server.metric(counted(499), missing=0)
    with httpx.stream("POST", slow_server.url + "/inference/v1/generate", json=req, timeout=60) as r:
        lines = r.iter_lines()  # keep the iterator: dropping it closes the connection
        for line in lines:
            if line.startswith("data: {"):
                break
        wait_metric(slow_server, "pdserve_engine_running_requests", 1)  # the core's heartbeat carries it
    wait_metric(slow_server, "pdserve_engine_running_requests", 0)
    wait_metric(slow_server, "pdserve_running_requests", 0)
    # A non-streaming request whose client hangs up while the engine runs it.
    send_and_hang_up(slow_server, {**req, "stream": False})
    wait_metric(slow_server, "pdserve_engine_running_requests", 0)
    wait_metric(slow_server, "pdserve_running_requests", 0)
    wait_metric(slow_server, counted(499), left_before + 2)  # both were counted as "client left"


def test_inference_abort_route_non_stream(slow_server) -> None:  # type: ignore[no-untyped-def]
    rid = "batch-abort"
    answered_before = slow_server.metric(counted(200), missing=0)
    tokens_before = slow_server.metric("pdserve_generation_tokens_total")
    result: dict = {}

    def run() -> None:
        result["res"] = gen(slow_server, {**body(ignore_eos=True, max_tokens=2000), "request_id": rid})

    t = threading.Thread(target=run)
    t.start()
    # Abort once the engine has produced some of the answer (a batch request counts its tokens as they come).
    wait_until(lambda: slow_server.metric("pdserve_generation_tokens_total") > tokens_before, "a token was generated")
    r = httpx.post(slow_server.url + "/inference/v1/abort_requests", json={"request_ids": ["generate-tokens-" + rid]},
                   timeout=60)
    assert r.status_code == 200
    t.join(60)
    assert not t.is_alive() and "res" in result, "the aborted request got its response"
    choice = result["res"]["choices"][0]
    assert choice["finish_reason"] == "abort" and 0 < len(choice["token_ids"]) < 2000
    wait_metric(slow_server, counted(200), answered_before + 1)  # an aborted batch request is still a 200


def test_usage_options(server) -> None:  # type: ignore[no-untyped-def]
    req = {**body(max_tokens=9), "stream": True, "stream_options": {"include_usage": True,
                                                                      "continuous_usage_stats": True}}
    events, done = stream_post(server.url + "/inference/v1/generate", req)
    assert done
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 9
    running = [ev["usage"]["completion_tokens"] for ev in events[:-1]]
    assert running == sorted(running) and running[-1] == 9


def test_engine_error_mid_stream(tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = tmp_path / "fail.jsonl"
    script.write_text(json.dumps({"text": "one two three four five six", "fail_after": 3}) + "\n")
    with ServerProcess("serve", "--engine", "scripted", "--tokenizer", "qwen3", "--script", str(script)) as srv:
        events, done = stream_post(srv.url + "/inference/v1/generate", {**body(), "stream": True})
        assert done and "error" in events[-1] and "scripted failure" in events[-1]["error"]["message"]
        r = httpx.post(srv.url + "/inference/v1/generate", json=body(), timeout=60)
        assert r.status_code == 500 and "scripted failure" in r.json()["error"]["message"]
        wait_metric(srv, "pdserve_running_requests", 0)


def test_startup_heap_is_frozen(server) -> None:  # type: ignore[no-untyped-def]
    """What the server built at startup is out of the garbage collector's walks (a full collection over
    it cost 30-70 ms of a streaming server's CPU each time), and requests add nothing to it (a frozen
    object that is freed leaves it)."""
    frozen = server.metric("pdserve_frozen_objects")
    assert frozen > 10_000
    gen(server, body("text", max_tokens=4, ignore_eos=True))
    assert server.metric("pdserve_frozen_objects") <= frozen


def test_tokens_mode_does_no_detokenization(server, tok) -> None:  # type: ignore[no-untyped-def]
    """A counter, not a timer: the ids the server's tokenizer turned into text stay put for tokens-mode
    requests (batch, stream, with logprobs) unless a stop string needs text, and grow in text mode."""
    name = "pdserve_detokenized_tokens_total"
    url = server.url + "/inference/v1/generate"
    before = server.metric(name)
    for stream in (False, True):
        req = {**body("tokens", max_tokens=12, ignore_eos=True, logprobs=2), "stream": stream}
        if stream:
            events, done = stream_post(url, req)
            assert done and sum(len(ev["choices"][0]["token_ids"]) for ev in events) == 12
        else:
            assert len(gen(server, req)["choices"][0]["token_ids"]) == 12
    assert server.metric(name) == before, "tokens mode decoded ids"
    gen(server, body("tokens", max_tokens=12, ignore_eos=True, stop=["zzzz"]))  # a stop string needs text
    after_stop = server.metric(name)
    assert after_stop >= before + 12
    gen(server, body("text", max_tokens=12, ignore_eos=True))
    assert server.metric(name) >= after_stop + 12
