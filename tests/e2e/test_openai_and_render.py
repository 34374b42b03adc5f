"""Coupled OpenAI endpoints through the official SDK, the render server, and derender-level 400s."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from tests.fixtures.parser_cases import CASES_BY_NAME
from tests.serverproc import ServerProcess

PARSERS = ("--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--enable-auto-tool-choice")
TOOL_CASE = CASES_BY_NAME["reasoning_then_two_tool_calls"]
PLAIN_CASE = CASES_BY_NAME["reasoning_then_answer"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):  # type: ignore[no-untyped-def]
    script = Path(tmp_path_factory.mktemp("oa")) / "s.jsonl"
    script.write_text(json.dumps({"text": TOOL_CASE.output}) + "\n" + json.dumps({"text": PLAIN_CASE.output}) + "\n")
    with ServerProcess("serve", "--engine", "scripted", "--tokenizer", "qwen3", "--script", str(script),
                       "--served-model-name", "tiny", *PARSERS, api_key="k") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)


def test_sdk_chat_tool_calls_batch_and_stream(client: openai.OpenAI) -> None:
    req = dict(TOOL_CASE.request, model="tiny", extra_body={"vllm_xargs": {"script_index": 0}})
    res = client.chat.completions.create(**req)
    choice = res.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [(c.name, c.arguments) for c in TOOL_CASE.tool_calls]
    assert choice.message.model_extra["reasoning"] == TOOL_CASE.reasoning
    stream = client.chat.completions.create(**req, stream=True, stream_options={"include_usage": True})
    args: dict[int, str] = {}
    names: dict[int, str] = {}
    finish = None
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                if tc.function and tc.function.name:
                    names[tc.index] = tc.function.name
                if tc.function and tc.function.arguments:
                    args[tc.index] = args.get(tc.index, "") + tc.function.arguments
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    assert [(names[i], json.loads(args[i])) for i in sorted(names)] == [(c.name, c.arguments) for c in TOOL_CASE.tool_calls]
    assert usage is not None and usage.completion_tokens == res.usage.completion_tokens


def test_sdk_completions(client: openai.OpenAI) -> None:
    res = client.completions.create(model="tiny", prompt="2+2=", max_tokens=200,
                                    extra_body={"vllm_xargs": {"script_index": 1}, "skip_special_tokens": False})
    text = res.choices[0].text
    assert text == PLAIN_CASE.parser_text
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(
            model="tiny", prompt="2+2=", max_tokens=200, stream=True,
            extra_body={"vllm_xargs": {"script_index": 1}, "skip_special_tokens": False},
        ) if c.choices
    )
    assert streamed == text


def test_sdk_errors_are_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       tools=TOOL_CASE.request["tools"],
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])


def gen(server: ServerProcess, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/inference/v1/generate", json=body, headers=server.headers, timeout=30)


def test_rule4_derender_needs_context_with_parsers(server) -> None:  # type: ignore[no-untyped-def]
    r = gen(server, {"token_ids": [1, 2], "output_mode": "derender", "sampling_params": {}})
    assert r.status_code == 400 and "parse_context" in r.json()["error"]["message"]
    ok = gen(server, {"token_ids": [1, 2], "output_mode": "derender", "parse_context": {},
                      "sampling_params": {"max_tokens": 3}})
    assert ok.status_code == 200 and "message" in ok.json()["choices"][0]
    r = gen(server, {"token_ids": [1, 2], "output_mode": "derender", "sampling_params": {},
                     "parse_context": {"tools": [], "tool_choice": {"type": "function", "function": {"name": "x"}}}})
    assert r.status_code == 400 and "does not match" in r.json()["error"]["message"]


def test_derender_endpoint_rules(server) -> None:  # type: ignore[no-untyped-def]
    tokens = gen(server, {"token_ids": [1, 2], "sampling_params": {"max_tokens": 3}}).json()
    url = server.url + "/v1/chat/completions/derender"
    r = httpx.post(url, json={"generate_response": tokens}, headers=server.headers)
    assert r.status_code == 400 and "chat_request is required" in r.json()["error"]["message"]
    chat = {"messages": [{"role": "user", "content": "x"}], "stop": ["a"]}
    chunk = {"request_id": "r", "output_mode": "tokens", "choices": [{"index": 0, "token_ids": [1]}]}
    r = httpx.post(url, json={"stream": True, "generate_chunk": chunk, "chat_request": chat, "prompt_token_ids": [1]},
                   headers=server.headers)
    assert r.status_code == 400 and "stop strings" in r.json()["error"]["message"]
    chat.pop("stop")
    r = httpx.post(url, json={"stream": True, "generate_chunk": chunk, "chat_request": chat}, headers=server.headers)
    assert r.status_code == 400 and "prompt_token_ids" in r.json()["error"]["message"]
    bad = {**tokens, "choices": [{**tokens["choices"][0], "token_ids": [10**7]}]}
    r = httpx.post(url, json={"generate_response": bad, "chat_request": chat}, headers=server.headers)
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]
    text_resp = gen(server, {"token_ids": [1, 2], "output_mode": "text", "sampling_params": {"max_tokens": 3}}).json()
    r = httpx.post(url, json={"generate_response": text_resp, "chat_request": chat}, headers=server.headers)
    assert r.status_code == 400 and "output_mode" in r.json()["error"]["message"]


def test_render_server_has_no_generate(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with ServerProcess("launch", "render", "--tokenizer", "qwen3", *PARSERS) as srv:
        chat = dict(TOOL_CASE.request)
        rendered = httpx.post(srv.url + "/v1/chat/completions/render", json=chat).json()
        assert rendered["parse_context"]["tool_choice"] == "auto"
        assert rendered["sampling_params"]["skip_special_tokens"] is False
        assert rendered["reasoning_parser_kwargs"] == {"chat_template_kwargs": {}}
        from pdserve.text.tokenizer import Tokenizer

        tok = Tokenizer.load("qwen3")
        assert tok.decode(rendered["token_ids"]).endswith("<|im_start|>assistant\n")
        assert httpx.post(srv.url + "/inference/v1/generate", json={}).status_code == 404
        # Derender works on the render server: batch, from token ids.
        ids = tok.encode(TOOL_CASE.parser_text)
        generate_response = {"request_id": "generate-tokens-x", "usage": {},
                             "choices": [{"index": 0, "token_ids": ids + [151645], "finish_reason": "stop"}]}
        res = httpx.post(srv.url + "/v1/chat/completions/derender",
                         json={"generate_response": generate_response, "chat_request": chat,
                               "prompt_token_ids": rendered["token_ids"]}).json()
        message = res["choices"][0]["message"]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == \
            [(c.name, c.arguments) for c in TOOL_CASE.tool_calls]
        assert res["choices"][0]["finish_reason"] == "tool_calls"
        comps = httpx.post(srv.url + "/v1/completions/render", json={"prompt": ["a", "b c"]}).json()
        assert [c["request_id"].rsplit("-", 1)[1] for c in comps] == ["0", "1"]
        assert [tok.decode(c["token_ids"]) for c in comps] == ["a", "b c"]


def test_more_bad_input_is_400(server) -> None:  # type: ignore[no-untyped-def]
    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(server.url + path, json=body, headers=server.headers, timeout=30)

    r = post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0})
    assert r.status_code == 400 and r.json()["error"]["message"] == "n: Input should be greater than or equal to 1"
    r = post("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
    assert r.status_code == 400 and "only text content parts" in r.json()["error"]["message"]
    chunk = {"request_id": "r", "choices": [{"index": 0, "token_ids": [10**9]}]}
    r = post("/v1/completions/derender", {"stream": True, "generate_chunk": chunk})
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]
    chunk["choices"][0]["token_ids"] = [1]
    state = {"output_token_ids": [1, 2], "output_chunk_lens": [5]}
    r = post("/v1/chat/completions/derender", {"stream": True, "generate_chunk": chunk, "stream_state": state,
                                               "chat_request": {"messages": []}, "prompt_token_ids": [1]})
    assert r.status_code == 400 and "output_chunk_lens" in r.json()["error"]["message"]


def test_text_content_parts_render_like_strings(server) -> None:  # type: ignore[no-untyped-def]
    def render(content: object) -> list[int]:
        r = httpx.post(server.url + "/v1/chat/completions/render", headers=server.headers,
                       json={"messages": [{"role": "user", "content": content}]})
        assert r.status_code == 200, r.text
        return r.json()["token_ids"]

    assert render([{"type": "text", "text": "Hello "}, {"type": "text", "text": "world"}]) == render("Hello world")


# vLLM 0.33's GenerateRequest, every key in its order (reference §3.1 and §16: render emits all, nulls included).
VLLM_GENERATE_KEYS = [
    "request_id", "token_ids", "token_offsets", "features", "content_parts", "sampling_params", "model",
    "reasoning_ended", "reasoning_parser_kwargs", "return_token_ids", "output_mode", "parse_context", "stream",
    "stream_options", "cache_salt", "priority", "kv_transfer_params", "ec_transfer_params",
]


def test_render_emits_vllm_generate_request_shape(server) -> None:  # type: ignore[no-untyped-def]
    def render(path: str, body: dict) -> dict | list:
        r = httpx.post(server.url + path, json=body, headers=server.headers, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 32}
    batch = render("/v1/chat/completions/render", chat)
    assert list(batch) == VLLM_GENERATE_KEYS
    assert (batch["token_offsets"], batch["features"], batch["content_parts"], batch["ec_transfer_params"]) == \
        (None, None, None, None)
    # vLLM: omit-defaults msgspec JSON after __post_init__ (lists normalized from None), FINAL_ONLY = 2,
    # skip_clone set by to_sampling_params; skip_special_tokens false because a reasoning parser reads the text.
    assert batch["sampling_params"] == {
        "max_tokens": 32, "stop": [], "stop_token_ids": [], "bad_words": [], "skip_special_tokens": False,
        "output_kind": 2, "skip_clone": True, "skip_reading_prefix_cache": False,
    }
    streamed = render("/v1/chat/completions/render", {**chat, "stream": True, "stop": "x", "temperature": 0.5})
    assert streamed["sampling_params"]["output_kind"] == 1  # DELTA
    assert (streamed["sampling_params"]["stop"], streamed["sampling_params"]["temperature"]) == (["x"], 0.5)
    (completion,) = render("/v1/completions/render", {"prompt": "hi", "max_tokens": 5, "cache_salt": "salt"})
    assert list(completion) == VLLM_GENERATE_KEYS
    assert completion["parse_context"] is None and completion["cache_salt"] == "salt"
    # A pdserve render goes to generate unchanged.
    assert gen(server, batch).status_code == 200


def test_generate_accepts_a_vllm_render(server) -> None:  # type: ignore[no-untyped-def]
    """A body shaped like vLLM 0.33's render output (reference §16, written by hand) is served as sent."""
    body = {
        "request_id": "chatcmpl-3f0c", "token_ids": [151644, 872, 198, 6023, 151645, 198, 151644, 77091, 198],
        "token_offsets": None, "features": None, "content_parts": None,
        "sampling_params": {"max_tokens": 3, "output_kind": 1, "stop": [], "stop_token_ids": [], "bad_words": [],
                            "skip_reading_prefix_cache": False, "skip_clone": True, "presence_penalty": 0.25,
                            "repetition_penalty": 1.1, "logit_bias": {"13": -5.0}},
        "model": None, "reasoning_ended": None, "reasoning_parser_kwargs": None, "return_token_ids": None,
        "output_mode": "tokens",
        "parse_context": {"tools": None, "tool_choice": "none", "parallel_tool_calls": True,
                          "include_reasoning": True, "chat_template_kwargs": {}, "history_tool_call_cnt": 0},
        "stream": False, "stream_options": None, "cache_salt": None, "priority": 0,
        "kv_transfer_params": None, "ec_transfer_params": None,
    }
    r = gen(server, body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["token_ids"]) == 3
    for key, value in [("features", {"mm_hashes": {"image": ["h"]}, "mm_placeholders": {"image": []}}),
                       ("content_parts", [{"type": "image_url", "url": "http://x/y.png"}]),
                       ("ec_transfer_params", {"do_remote_encode": True})]:
        r = gen(server, {**body, key: value})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(key), r.text


def test_reasoning_effort_drives_the_template_like_vllm(server) -> None:  # type: ignore[no-untyped-def]
    def render(extra: dict) -> dict:
        body = {"messages": [{"role": "user", "content": "hi"}], **extra}
        r = httpx.post(server.url + "/v1/chat/completions/render", json=body, headers=server.headers, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    off = render({"reasoning_effort": "none"})
    assert off["token_ids"] == render({"chat_template_kwargs": {"enable_thinking": False}})["token_ids"]
    assert off["token_ids"] != render({})["token_ids"]
    assert off["reasoning_parser_kwargs"]["chat_template_kwargs"]["enable_thinking"] is False
    # An explicit enable_thinking wins over the effort, as in vLLM.
    explicit = render({"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}})
    assert explicit["token_ids"] == render({"reasoning_effort": "high"})["token_ids"] == render({})["token_ids"]
