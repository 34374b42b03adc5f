"""Derender of responses that come over the wire (vLLM peers, hand-assembled RL outputs), on real servers.

* A "stop" finish with a null stop_reason drops the last id's text only when that id is a stop token
  (the request's stop ids, the model's EOS ids from the tokenizer dir's generation_config.json);
  the request's stop strings then cut (vLLM 0.33's rule; cases from vLLM's derender stop tests).
* A prompt that ends in the middle of a character never leaks into output deltas.
* Streaming derender rejects a carried state that cannot belong to the stream (400, not made-up text).
* What a server's generate may emit, its derender takes back: a model whose embedding is padded past the
  tokenizer's vocabulary may sample a padding id (it decodes to ""); only ids past the model's are a 400.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.text.tokenizer import Tokenizer
from tests.modeldirs import qwen3_model_dir
from tests.serverproc import ServerProcess
from tests.sse import stream_post

TOK = Tokenizer.load("qwen3")
IM_END, END_OF_TEXT = 151645, 151643
MAX_LEN = 64
REST = TOK.encode("This is the rest")
WORDS = TOK.encode("one two three")
# A prompt that ends inside a character: its decode ends with U+FFFD.
WIDE = TOK.encode("Say 龘靐 and 🫠 done")
SPLIT = next(k for k in range(1, len(WIDE)) if TOK.decode(WIDE[:k]).endswith("\ufffd"))
WIDE_PROMPT, WIDE_OUTPUT = WIDE[:SPLIT], WIDE[SPLIT:]
WIDE_WANT = TOK.decode(WIDE)[len(TOK.decode(WIDE_PROMPT)) :]
CHAT = {"messages": [{"role": "user", "content": "Count"}]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Qwen3 tokenizer with the model's generation_config.json (two EOS ids), as a model dir has it."""
    return qwen3_model_dir(tmp_path_factory.mktemp("qwen3-dir"),
                           generation_config={"eos_token_id": [IM_END, END_OF_TEXT]})


@pytest.fixture(scope="module")
def render(model_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess("launch", "render", "--tokenizer", str(model_dir), "--max-model-len", str(MAX_LEN)) as srv:
        yield srv


@pytest.fixture(scope="module")
def render_parsed(model_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess("launch", "render", "--tokenizer", str(model_dir), "--reasoning-parser", "qwen3",
                       "--tool-call-parser", "hermes", "--enable-auto-tool-choice") as srv:
        yield srv


@pytest.fixture(scope="module")
def torch_server() -> Iterator[ServerProcess]:
    """qwen3-tiny: its embedding has 151,936 rows, the Qwen3 tokenizer 151,669 ids."""
    with ServerProcess("serve", "qwen3-tiny", "--max-model-len", "256") as srv:
        yield srv


def post(srv: ServerProcess, path: str, body: dict[str, Any], status: int = 200) -> dict[str, Any]:
    r = httpx.post(srv.url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def tokens_response(ids: list[int], finish: str = "stop", stop_reason: int | str | None = None) -> dict[str, Any]:
    return {"request_id": "peer", "usage": {"prompt_tokens": 3, "completion_tokens": len(ids), "total_tokens": 0},
            "choices": [{"index": 0, "token_ids": ids, "finish_reason": finish, "stop_reason": stop_reason}]}


def chat_derender(srv: ServerProcess, ids: list[int], finish: str = "stop", stop_reason: int | str | None = None,
                  **chat: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"generate_response": tokens_response(ids, finish, stop_reason)}
    if chat:
        body["chat_request"] = {**CHAT, **chat}
    return post(srv, "/v1/chat/completions/derender", body)["choices"][0]


def completion_derender(srv: ServerProcess, ids: list[int], finish: str = "stop",
                        stop_reason: int | str | None = None, **req: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"generate_responses": [tokens_response(ids, finish, stop_reason)]}
    if req:
        body["completion_request"] = {"prompt": "Count", **req}
    return post(srv, "/v1/completions/derender", body)["choices"][0]


def stream_derender(srv: ServerProcess, path: str, chunks: list[list[int]], finish: str = "stop",
                    **extra: Any) -> list[dict[str, Any]]:
    """Each chunk through streaming derender with the carried state; the finish on the last one."""
    state, choices = None, []
    for i, ids in enumerate(chunks):
        chunk = {"request_id": "peer", "choices": [
            {"index": 0, "token_ids": ids, "finish_reason": finish if i == len(chunks) - 1 else None}]}
        res = post(srv, path, {"stream": True, "generate_chunk": chunk, "stream_state": state, **extra})
        state = res["stream_state"]
        choices += res["chunk"]["choices"]
    return choices


def chat_text(choices: list[dict[str, Any]]) -> str:
    return "".join(c["delta"].get("content") or "" for c in choices)


# -- item 1: which "stop" drops the last id -----------------------------------------------------


def test_stop_with_null_stop_reason_keeps_ordinary_last_text(render: ServerProcess) -> None:
    assert chat_derender(render, REST)["message"]["content"] == "This is the rest"
    assert chat_derender(render, REST, temperature=0)["message"]["content"] == "This is the rest"
    assert completion_derender(render, REST)["text"] == "This is the rest"
    assert completion_derender(render, REST, max_tokens=8)["text"] == "This is the rest"
    halves = [REST[:2], REST[2:]]
    assert chat_text(stream_derender(render, "/v1/chat/completions/derender", halves)) == "This is the rest"
    texts = stream_derender(render, "/v1/completions/derender", [[t] for t in REST])
    assert "".join(c["text"] for c in texts) == "This is the rest"


def test_stop_with_null_stop_reason_keeps_ordinary_last_text_with_parsers(render_parsed: ServerProcess) -> None:
    chat = {**CHAT, "chat_template_kwargs": {"enable_thinking": False}}  # the answer is content
    rendered = post(render_parsed, "/v1/chat/completions/render", chat)
    message = post(render_parsed, "/v1/chat/completions/derender", {
        "generate_response": tokens_response(REST), "chat_request": chat,
        "prompt_token_ids": rendered["token_ids"]})["choices"][0]["message"]
    assert message["content"] == "This is the rest" and not message.get("reasoning")
    streamed = stream_derender(render_parsed, "/v1/chat/completions/derender", [REST[:3], REST[3:]],
                               chat_request=chat, prompt_token_ids=rendered["token_ids"])
    assert chat_text(streamed) == "This is the rest"


def test_a_response_without_usage_is_derendered(render: ServerProcess) -> None:
    """vLLM's GenerateResponse has usage optional; a response assembled elsewhere may leave it out."""
    gen = tokens_response(REST)
    del gen["usage"]
    chat = post(render, "/v1/chat/completions/derender", {"generate_response": gen})
    assert chat["choices"][0]["message"]["content"] == "This is the rest"
    assert chat["usage"]["completion_tokens"] == len(REST)
    completion = post(render, "/v1/completions/derender", {"generate_responses": [gen]})
    assert completion["choices"][0]["text"] == "This is the rest"


def test_request_stop_string_cuts_a_response_without_stop_reason(render: ServerProcess) -> None:
    choice = chat_derender(render, WORDS, stop=["three"])
    assert (choice["message"]["content"], choice["stop_reason"]) == ("one two ", "three")
    choice = chat_derender(render, WORDS, stop=["three"], include_stop_str_in_output=True)
    assert (choice["message"]["content"], choice["stop_reason"]) == ("one two three", "three")
    number = TOK.encode("one number")
    choice = completion_derender(render, number, stop=["number"])
    assert (choice["text"], choice["stop_reason"]) == ("one ", "number")
    # "length": stop strings are not applied (the engine would have stopped on them).
    choice = completion_derender(render, number, "length", stop=["number"])
    assert (choice["text"], choice["stop_reason"]) == ("one number", None)


def test_stop_token_ids_of_the_request(render: ServerProcess) -> None:
    three = WORDS[-1]
    choice = chat_derender(render, WORDS, stop_token_ids=[three])
    assert (choice["message"]["content"], choice["stop_reason"]) == ("one two", three)
    choice = chat_derender(render, WORDS, "length", stop_token_ids=[three])
    assert (choice["message"]["content"], choice["stop_reason"]) == ("one two three", None)
    choice = completion_derender(render, WORDS, stop_token_ids=[three], include_stop_str_in_output=True)
    assert (choice["text"], choice["stop_reason"]) == ("one two three", three)
    streamed = stream_derender(render, "/v1/completions/derender", [WORDS[:1], WORDS[1:]],
                               completion_request={"prompt": "x", "stop_token_ids": [three]})
    assert "".join(c["text"] for c in streamed) == "one two"


def test_eos_ids_come_from_the_model_dir_on_a_render_server(render: ServerProcess) -> None:
    keep = {"skip_special_tokens": False}
    for eos, reason in ((IM_END, None), (END_OF_TEXT, END_OF_TEXT)):
        choice = completion_derender(render, WORDS + [eos], **keep)
        assert (choice["text"], choice["stop_reason"]) == ("one two three", reason)
        choice = chat_derender(render, WORDS + [eos], **keep)
        assert (choice["message"]["content"], choice["stop_reason"]) == ("one two three", reason)
    choice = completion_derender(render, WORDS + [IM_END], ignore_eos=True, **keep)
    assert choice["text"] == "one two three<|im_end|>"


# -- item 2: a prompt that ends mid-character ---------------------------------------------------


def test_streaming_derender_after_a_prompt_cut_mid_character(render: ServerProcess) -> None:
    assert WIDE_WANT and not WIDE_WANT.startswith("Say")
    chunks = [[t] for t in WIDE_OUTPUT]
    chat = stream_derender(render, "/v1/chat/completions/derender", chunks, prompt_token_ids=WIDE_PROMPT)
    assert chat_text(chat) == WIDE_WANT
    comp = stream_derender(render, "/v1/completions/derender", chunks, prompt_token_ids=WIDE_PROMPT)
    assert "".join(c["text"] for c in comp) == WIDE_WANT
    assert all("Say" not in (c["text"] or "") for c in comp)
    batch = post(render, "/v1/completions/derender", {"generate_responses": [tokens_response(WIDE_OUTPUT, "length")],
                                                      "prompt_token_ids": [WIDE_PROMPT]})
    assert batch["choices"][0]["text"] == WIDE_WANT


def test_generate_text_and_derender_after_a_prompt_cut_mid_character(tmp_path: Path) -> None:
    script = tmp_path / "wide.jsonl"
    script.write_text(json.dumps({"token_ids": WIDE_OUTPUT}) + "\n")
    with ServerProcess("serve", "--engine", "scripted", "--tokenizer", "qwen3", "--script", str(script)) as srv:
        body = {"token_ids": WIDE_PROMPT, "sampling_params": {"max_tokens": len(WIDE_OUTPUT) + 1}}
        text = post(srv, "/inference/v1/generate", {**body, "output_mode": "text"})
        assert text["choices"][0]["text"] == WIDE_WANT
        message = post(srv, "/inference/v1/generate", {**body, "output_mode": "derender"})["choices"][0]["message"]
        assert message["content"] == WIDE_WANT
        events, done = stream_post(srv.url + "/inference/v1/generate", {**body, "output_mode": "text", "stream": True})
        assert done and "".join(e["choices"][0]["text"] for e in events) == WIDE_WANT
        events, done = stream_post(srv.url + "/inference/v1/generate",
                                   {**body, "output_mode": "derender", "stream": True})
        assert done and "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == WIDE_WANT
        assert all("Say" not in (e["choices"][0]["delta"].get("content") or "") for e in events)


# -- item 5: streaming derender bounds and carried state ----------------------------------------


def stream_error(srv: ServerProcess, path: str, state: dict[str, Any] | None, ids: list[int],
                 **extra: Any) -> dict[str, Any]:
    chunk = {"request_id": "peer", "choices": [{"index": 0, "token_ids": ids, "finish_reason": None}]}
    return post(srv, path, {"stream": True, "generate_chunk": chunk, "stream_state": state, **extra}, 400)["error"]


@pytest.mark.parametrize("path", ["/v1/chat/completions/derender", "/v1/completions/derender"])
def test_stream_over_max_model_len_is_refused(render: ServerProcess, path: str) -> None:
    state = {"output_token_ids": [TOK.encode(" a")[0]] * (MAX_LEN - 2)}
    error = stream_error(render, path, state, REST[:3])
    assert "max_model_len" in error["message"]
    # At the limit it still works.
    post(render, path, {"stream": True, "stream_state": state, "generate_chunk": {
        "request_id": "peer", "choices": [{"index": 0, "token_ids": REST[:2], "finish_reason": None}]}})


@pytest.mark.parametrize("path", ["/v1/chat/completions/derender", "/v1/completions/derender"])
@pytest.mark.parametrize(
    ("state", "field"),
    [
        ({"prefix_offset": -1}, "prefix_offset"),
        ({"read_offset": -1}, "read_offset"),
        ({"logprob_text_offset": -1}, "logprob_text_offset"),
        ({"prev_tokens": ["a"], "prefix_offset": 1, "read_offset": 0}, "read_offset"),
        ({"prev_tokens": ["a"], "prefix_offset": 0, "read_offset": 2}, "read_offset"),
        ({"prev_tokens": ["a"] * 1025}, "prev_tokens"),
        ({"prev_tokens": ["not-a-qwen3-token\u2603"], "read_offset": 1}, "prev_tokens"),
        ({"output_token_ids": [TOK.vocab_size]}, "output_token_ids"),
        ({"output_token_ids": [-1]}, "output_token_ids"),
        ({"output_token_ids": [1, 2], "output_chunk_lens": [1]}, "output_chunk_lens"),
        ({"logprob_context_token_ids": [TOK.vocab_size + 5]}, "logprob_context_token_ids"),
    ],
)
def test_inconsistent_stream_state_is_refused(render: ServerProcess, path: str, state: dict[str, Any],
                                              field: str) -> None:
    assert field in stream_error(render, path, state, REST)["message"]


def test_parser_stream_state_whose_chunks_do_not_cover_the_ids_is_refused(render_parsed: ServerProcess) -> None:
    rendered = post(render_parsed, "/v1/chat/completions/render", CHAT)
    error = stream_error(render_parsed, "/v1/chat/completions/derender", {"output_token_ids": REST[:2]}, REST[2:],
                         chat_request=CHAT, prompt_token_ids=rendered["token_ids"])
    assert "output_chunk_lens" in error["message"]


def test_stream_continues_from_a_vllm_decode_window(render: ServerProcess) -> None:
    """A state holding only vLLM's plain window (token strings, the last one an incomplete character)."""
    char = TOK.encode("𓀀")
    window = [TOK.id_to_token(t) for t in TOK.encode("ab") + char[:1]]
    state = {"prev_tokens": window, "prefix_offset": 0, "read_offset": 2, "role_sent": True}
    chunk = {"request_id": "peer", "choices": [{"index": 0, "token_ids": char[1:] + TOK.encode("c"),
                                                "finish_reason": None}]}
    res = post(render, "/v1/completions/derender", {"stream": True, "generate_chunk": chunk, "stream_state": state})
    assert res["chunk"]["choices"][0]["text"] == "𓀀c"


def test_padding_ids_of_the_model_are_derendered_and_ids_past_it_refused(torch_server: ServerProcess) -> None:
    padding = TOK.vocab_size + 100  # a row of the model's embedding that no token has
    model_vocab = 151936
    rest = [*REST[:2], padding, *REST[2:]]
    # Generate takes a prompt holding one (the engine's vocabulary bounds it) and may sample them.
    post(torch_server, "/inference/v1/generate", {"token_ids": [*WORDS, padding], "sampling_params": {"max_tokens": 2}})
    assert chat_derender(torch_server, rest, "length")["message"]["content"] == "This is the rest"
    assert completion_derender(torch_server, rest, "length")["text"] == "This is the rest"
    streamed = stream_derender(torch_server, "/v1/completions/derender", [[padding], REST[:2], [padding], REST[2:]],
                               "length", prompt_token_ids=[*WORDS, padding])
    assert [c["text"] for c in streamed][0] == ""
    assert "".join(c["text"] for c in streamed) == "This is the rest"
    r = httpx.post(torch_server.url + "/v1/completions/derender", timeout=60,
                   json={"generate_responses": [tokens_response([*REST, model_vocab])]})
    assert r.status_code == 400 and f"outside the vocabulary (size {model_vocab})" in r.json()["error"]["message"]
