"""Every sampling param vLLM honours is honoured or refused with a 400 naming it, on generate and OpenAI."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.test_generate import PROMPT, SCRIPTS
from tests.serverproc import ServerProcess

CHAT = {"messages": [{"role": "user", "content": "Capital of France?"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def server():  # type: ignore[no-untyped-def]
    with ServerProcess("serve", "--engine", "scripted", "--tokenizer", "qwen3", "--script", str(SCRIPTS)) as srv:
        yield srv


def post(srv: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, headers=srv.headers, timeout=30)


def assert_400(r: httpx.Response, field: str) -> dict:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert field in error["message"] or error["param"] == field, error
    return error


HONOURED = {"presence_penalty": 0.5, "frequency_penalty": 1.0, "repetition_penalty": 1.2,
            "logit_bias": {"9707": -100}, "allowed_token_ids": list(range(100, 20000)), "bad_words": ["Paris"]}


def test_generate_takes_the_params_vllm_honours(server) -> None:  # type: ignore[no-untyped-def]
    """The scripted engine enforces the hard constraints (allowed ids, bad words) on its replay."""
    sampling = {**HONOURED, "bad_words": [" plain"], "max_tokens": 12, "extra_args": {"script_index": 0}}
    plain = post(server, "/inference/v1/generate", {"token_ids": PROMPT, "output_mode": "text",
                                                      "sampling_params": {"max_tokens": 12,
                                                                          "extra_args": {"script_index": 0}}})
    assert " plain" in plain.json()["choices"][0]["text"]  # the script has the word the request bans
    r = post(server, "/inference/v1/generate", {"token_ids": PROMPT, "output_mode": "text", "sampling_params": sampling})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] and all(100 <= t < 20000 for t in choice["token_ids"])
    assert " plain" not in choice["text"]


def test_a_priority_needs_priority_scheduling(server) -> None:  # type: ignore[no-untyped-def]
    """As vLLM without --scheduling-policy priority: a non-zero priority is refused, not ignored."""
    assert_400(post(server, "/inference/v1/generate", {"token_ids": PROMPT, "priority": 3, "sampling_params": {}}),
               "priority")
    assert_400(post(server, "/v1/chat/completions", {**CHAT, "priority": -1}), "priority")
    ok = post(server, "/inference/v1/generate", {"token_ids": PROMPT, "priority": 0, "sampling_params": {"max_tokens": 2}})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"allowed_token_ids": [999999]}, "allowed_token_ids"),
        ({"bad_words": [""]}, "bad_words"),
        ({"structured_outputs": {"json": {"type": "object"}}}, "structured_outputs"),
        ({"logprob_token_ids": [1]}, "logprob_token_ids"),
        ({"thinking_token_budget": 8}, "thinking_token_budget"),
        ({"trace_decode_token_ids": [1, 2]}, "trace_decode_token_ids"),
    ],
)
def test_generate_refuses_with_the_field_named(server, sampling, field) -> None:  # type: ignore[no-untyped-def]
    assert_400(post(server, "/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": sampling}), field)


def test_bad_words_refused_on_tokens_only() -> None:
    with ServerProcess("serve", "--engine", "scripted", "--tokenizer", "qwen3", "--script", str(SCRIPTS),
                       "--tokens-only") as srv:
        r = post(srv, "/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": {"bad_words": ["x"]}})
        error = assert_400(r, "bad_words")
        assert error["param"] == "sampling_params.bad_words" and "tokens-only" in error["message"]
        ok = post(srv, "/inference/v1/generate",
                  {"token_ids": PROMPT, "sampling_params": {"logit_bias": {"5": -100}, "max_tokens": 2}})
        assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/chat/completions/render"])
@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}}}}, "response_format"),
        ({"structured_outputs": {"choice": ["a", "b"]}}, "structured_outputs"),
        ({"guided_json": {"type": "object"}}, "guided_json"),
        ({"guided_regex": "[0-9]+"}, "guided_regex"),
        ({"guided_choice": ["yes", "no"]}, "guided_choice"),
        ({"guided_grammar": "root ::= 'a'"}, "guided_grammar"),
        ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"echo": True}, "echo"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"logit_bias": {"hello": 5}}, "logit_bias"),
        ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
    ],
)
def test_chat_refuses_with_the_field_named(server, path, extra, field) -> None:  # type: ignore[no-untyped-def]
    assert_400(post(server, path, {**CHAT, **extra}), field)


def test_chat_checks_ids_against_the_vocabulary(server) -> None:  # type: ignore[no-untyped-def]
    assert_400(post(server, "/v1/chat/completions", {**CHAT, "logit_bias": {"999999": 5}}), "logit_bias")
    assert_400(post(server, "/v1/chat/completions", {**CHAT, "allowed_token_ids": [999999]}), "allowed_token_ids")


def test_completions_refuse_unimplemented(server) -> None:  # type: ignore[no-untyped-def]
    for extra, field in [({"suffix": "!"}, "suffix"), ({"echo": True}, "echo"),
                         ({"response_format": {"type": "json_object"}}, "response_format")]:
        assert_400(post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **extra}), field)


def test_openai_endpoints_honour_the_params(server) -> None:  # type: ignore[no-untyped-def]
    openai_params = {"presence_penalty": 0.5, "frequency_penalty": 1.0, "repetition_penalty": 1.2,
                     "logit_bias": {"9707": 250}, "bad_words": ["Paris"], "allowed_token_ids": [11, 9707],
                     "response_format": {"type": "text"}, "use_beam_search": False}
    r = post(server, "/v1/chat/completions", {**CHAT, **openai_params})
    assert r.status_code == 200, r.text
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **openai_params})
    assert r.status_code == 200, r.text
    rendered = post(server, "/v1/chat/completions/render", {**CHAT, **openai_params}).json()["sampling_params"]
    assert {k: rendered[k] for k in ("presence_penalty", "frequency_penalty", "repetition_penalty", "bad_words",
                                     "allowed_token_ids")} == \
        {"presence_penalty": 0.5, "frequency_penalty": 1.0, "repetition_penalty": 1.2, "bad_words": ["Paris"],
         "allowed_token_ids": [11, 9707]}
    assert rendered["logit_bias"] == {"9707": 100.0}  # vLLM clamps OpenAI biases to [-100, 100]
