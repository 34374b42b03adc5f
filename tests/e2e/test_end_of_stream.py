"""End of stream at the text and derender levels: held-back text, finish-only chunks, abort."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.e2e.test_generate import PROMPT, SCRIPTS, wait_metric_zero
from tests.serverproc import ServerProcess
from tests.sse import parse_sse, stream_post

PARSER_ARGS = ("--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--enable-auto-tool-choice")


@pytest.fixture(scope="module")
def server():  # type: ignore[no-untyped-def]
    with ServerProcess("serve", "--engine", "scripted", "--tokenizer", "qwen3", "--script", str(SCRIPTS),
                       "--step-ms", "20", *PARSER_ARGS) as srv:
        yield srv


def req(mode: str, script: int, thinking: bool = False, **sampling) -> dict:  # type: ignore[no-untyped-def]
    body = {"token_ids": PROMPT, "output_mode": mode, "stream": True,
            "sampling_params": {**sampling, "extra_args": {"script_index": script}}}
    if mode == "derender":
        # Scripts without <think> are plain answers: tell the qwen3 parser thinking is off.
        body["parse_context"] = {"chat_template_kwargs": {"enable_thinking": thinking}}
    return body


def assembled(events: list[dict], mode: str) -> tuple[str, str]:
    if mode == "text":
        return "".join(ev["choices"][0]["text"] for ev in events), ""
    content = "".join(ev["choices"][0]["delta"].get("content") or "" for ev in events)
    reasoning = "".join(ev["choices"][0]["delta"].get("reasoning") or "" for ev in events)
    return content, reasoning


@pytest.mark.parametrize("mode", ["text", "derender"])
def test_final_chunk_carries_only_held_back_text(server, mode: str) -> None:  # type: ignore[no-untyped-def]
    # A stop string that never matches holds back its length - 1 chars until the end.
    stop = "NEVER-MATCHES-XYZ"
    events, done = stream_post(server.url + "/inference/v1/generate", req(mode, 0, stop=[stop]))
    assert done
    last = events[-1]["choices"][0]
    assert last["finish_reason"] == "stop"
    assert last["token_ids"] == [] or last["token_ids"][-1] == 151645
    text, _ = assembled(events, mode)
    expected = json.loads(SCRIPTS.read_text().splitlines()[0])["text"]
    assert text == expected
    held = last["text"] if mode == "text" else last["delta"].get("content")
    assert held and len(held) >= 1, "the terminal chunk flushed the held-back tail"
    assert expected.endswith(held)


@pytest.mark.parametrize("mode", ["text", "derender"])
def test_finish_only_chunk(server, mode: str) -> None:  # type: ignore[no-untyped-def]
    # The terminating EOS produces no text: the last chunk has the finish_reason and no new text.
    events, done = stream_post(server.url + "/inference/v1/generate", req(mode, 3, thinking=True))
    assert done
    last = events[-1]["choices"][0]
    assert last["finish_reason"] == "stop" and last["token_ids"] == [151645]
    if mode == "text":
        assert last["text"] == ""
    else:
        content, reasoning = assembled(events, mode)
        assert content == "\n\nThe answer is 391." and reasoning == "\nLet me think: 17*23 = 391.\n"


@pytest.mark.parametrize("mode", ["text", "derender"])
def test_abort_final_chunk(server, mode: str) -> None:  # type: ignore[no-untyped-def]
    rid = f"eos-abort-{mode}"
    body = {**req(mode, 0, ignore_eos=True, max_tokens=5000, stop=["NEVER-MATCHES-XYZ"]), "request_id": rid}
    events: list[dict] = []
    with httpx.stream("POST", server.url + "/inference/v1/generate", json=body, timeout=30) as r:
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
            if len(events) == 4:
                httpx.post(server.url + "/inference/v1/abort_requests", json={"request_ids": ["generate-tokens-" + rid]})
                break
        more, done = parse_sse(list(lines))
    events += more
    assert done
    last = events[-1]["choices"][0]
    assert last["finish_reason"] == "abort"
    text, _ = assembled(events, mode)
    assert text.startswith("Hello there!")
    # All generated ids were delivered with their text (held-back tail flushed on abort).
    ids = [i for ev in events for i in ev["choices"][0]["token_ids"]]
    from pdserve.text.tokenizer import Tokenizer

    assert Tokenizer.load("qwen3").decode(ids) == text
    wait_metric_zero(server, "pdserve_engine_running_requests")
