"""End of stream at the text and derender levels: held-back text, finish-only chunks, abort."""

from __future__ import annotations

import json

import httpx
import pytest

from pdserve.text.tokenizer import Tokenizer
from tests.e2e.test_generate import EOS, PROMPT, SCRIPTS
from tests.serverproc import ServerProcess
from tests.sse import assert_tail_flushed, stream_and_abort, stream_post
from tests.waiting import wait_metric

TOK = Tokenizer.load("qwen3")
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


def new_content(choice: dict, mode: str) -> str:
    """The answer text a streamed choice adds: ``text``, or the derender delta's ``content``."""
    return choice["text"] if mode == "text" else choice["delta"].get("content") or ""


def assembled(events: list[dict], mode: str) -> tuple[str, str]:
    content = "".join(new_content(ev["choices"][0], mode) for ev in events)
    if mode == "text":
        return content, ""
    return content, "".join(ev["choices"][0]["delta"].get("reasoning") or "" for ev in events)


@pytest.mark.parametrize("mode", ["text", "derender"])
def test_final_chunk_carries_only_held_back_text(server, mode: str) -> None:  # type: ignore[no-untyped-def]
    # A stop string that never matches holds back its length - 1 chars until the end.
    stop = "NEVER-MATCHES-XYZ"
    events, done = stream_post(server.url + "/inference/v1/generate", req(mode, 0, stop=[stop]))
    assert done
    last = events[-1]["choices"][0]
    assert last["token_ids"][-1] == EOS and last["stop_reason"] is None
    text, _ = assembled(events, mode)
    assert text == json.loads(SCRIPTS.read_text().splitlines()[0])["text"]
    assert_tail_flushed(events, TOK, lambda choice: new_content(choice, mode), len(stop) - 1, "stop")


@pytest.mark.parametrize("mode", ["text", "derender"])
def test_finish_only_chunk(server, mode: str) -> None:  # type: ignore[no-untyped-def]
    # The terminating EOS produces no text: the last chunk has the finish_reason and no new text.
    events, done = stream_post(server.url + "/inference/v1/generate", req(mode, 3, thinking=True))
    assert done
    last = events[-1]["choices"][0]
    assert last["finish_reason"] == "stop" and last["token_ids"] == [EOS]
    if mode == "text":
        assert last["text"] == ""
    else:
        content, reasoning = assembled(events, mode)
        assert content == "\n\nThe answer is 391." and reasoning == "\nLet me think: 17*23 = 391.\n"


@pytest.mark.parametrize("mode", ["text", "derender"])
def test_abort_final_chunk(server, mode: str) -> None:  # type: ignore[no-untyped-def]
    rid = f"eos-abort-{mode}"
    stop = "NEVER-MATCHES-XYZ"
    body = {**req(mode, 0, ignore_eos=True, max_tokens=5000, stop=[stop]), "request_id": rid}

    def abort() -> None:
        r = httpx.post(server.url + "/inference/v1/abort_requests", json={"request_ids": ["generate-tokens-" + rid]},
                      timeout=60)
        assert r.status_code == 200

    events, done = stream_and_abort(server.url + "/inference/v1/generate", body, 4, abort)
    assert done
    text, reasoning = assembled(events, mode)
    assert text.startswith("Hello there!") and reasoning == ""
    assert_tail_flushed(events, TOK, lambda choice: new_content(choice, mode), len(stop) - 1)
    wait_metric(server, "pdserve_engine_running_requests", 0)
