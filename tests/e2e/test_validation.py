"""Every misconfiguration answers 400 with a message that names the fix (DESIGN.md rules 1-6)."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.test_generate import PROMPT, SCRIPTS
from tests.serverproc import ServerProcess


@pytest.fixture(scope="module")
def server():  # type: ignore[no-untyped-def]
    with ServerProcess(
        "serve", "--engine", "scripted", "--tokenizer", "qwen3", "--script", str(SCRIPTS), "--max-model-len", "2048",
        "--max-num-seqs", "4",
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def tokens_only():  # type: ignore[no-untyped-def]
    with ServerProcess(
        "serve", "--engine", "scripted", "--tokenizer", "qwen3", "--script", str(SCRIPTS), "--tokens-only",
        api_key="sekret",
    ) as srv:
        yield srv


def post(srv: ServerProcess, payload, **kw) -> httpx.Response:  # type: ignore[no-untyped-def]
    headers = {**srv.headers, **kw.pop("headers", {})}
    if isinstance(payload, (bytes, str)):
        return httpx.post(srv.url + "/inference/v1/generate", content=payload, headers=headers, timeout=30)
    return httpx.post(srv.url + "/inference/v1/generate", json=payload, headers=headers, timeout=30)


def assert_400(r: httpx.Response, *needles: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400
    for needle in needles:
        assert needle in err["message"], err["message"]


def test_rule1_text_on_tokens_only(tokens_only) -> None:  # type: ignore[no-untyped-def]
    for mode in ("text", "derender"):
        r = post(tokens_only, {"token_ids": PROMPT, "output_mode": mode, "sampling_params": {}})
        assert_400(r, "tokens-only", "output_mode='tokens'")


def test_rule2_detokenize_false(server) -> None:  # type: ignore[no-untyped-def]
    r = post(server, {"token_ids": PROMPT, "output_mode": "text", "sampling_params": {"detokenize": False}})
    assert_400(r, "detokenize", "output_mode='tokens'")
    ok = post(server, {"token_ids": PROMPT, "sampling_params": {"detokenize": False, "max_tokens": 2}})
    assert ok.status_code == 200


def test_rule3_chat_request_needs_derender(server) -> None:  # type: ignore[no-untyped-def]
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for mode in ("tokens", "text"):
        r = post(server, {"token_ids": PROMPT, "output_mode": mode, "chat_request": chat, "sampling_params": {}})
        assert_400(r, "chat_request", "output_mode='derender'")


def test_rule5_stop_on_tokens_only(tokens_only) -> None:  # type: ignore[no-untyped-def]
    r = post(tokens_only, {"token_ids": PROMPT, "sampling_params": {"stop": ["x"]}})
    assert_400(r, "stop strings", "stop_token_ids")


def test_rule6_both_contexts(server) -> None:  # type: ignore[no-untyped-def]
    r = post(server, {"token_ids": PROMPT, "output_mode": "derender", "sampling_params": {},
                      "chat_request": {"messages": []}, "parse_context": {}})
    assert_400(r, "either chat_request or parse_context")


@pytest.mark.parametrize(
    ("payload", "needles"),
    [
        ({"token_ids": [1, 999999], "sampling_params": {}}, ("outside the vocabulary",)),
        ({"token_ids": [-1], "sampling_params": {}}, ("non-negative",)),
        ({"token_ids": [], "sampling_params": {}}, ("token_ids",)),
        ({"token_ids": PROMPT}, ("sampling_params",)),
        ({"token_ids": PROMPT, "sampling_params": {"max_tokens": 2045}}, ("lower max_tokens to at most 2039",)),
        ({"token_ids": [1] * 2048, "sampling_params": {}}, ("no room",)),
        ({"token_ids": PROMPT, "sampling_params": {"n": 5}}, ("n=5", "limit of 4")),
        ({"token_ids": PROMPT, "sampling_params": {"max_tokens": 0}}, ("max_tokens",)),
        ({"token_ids": PROMPT, "sampling_params": {"min_tokens": 5, "max_tokens": 2}}, ("min_tokens",)),
        ({"token_ids": PROMPT, "sampling_params": {"logprobs": 50}}, ("logprobs=50", "0..20")),
        ({"token_ids": PROMPT, "sampling_params": {"stop": [""]}}, ("non-empty",)),
        ({"token_ids": PROMPT, "sampling_params": {"temperature": -1}}, ("temperature",)),
        ({"token_ids": PROMPT, "output_mode": "json", "sampling_params": {}}, ("output_mode",)),
        ({"token_ids": PROMPT, "sampling_params": {"stop": ["x"], "detokenize": False}}, ("detokenize",)),
    ],
)
def test_rule6_limits(server, payload, needles) -> None:  # type: ignore[no-untyped-def]
    assert_400(post(server, payload), *needles)


def test_malformed_bodies(server) -> None:  # type: ignore[no-untyped-def]
    assert_400(post(server, b"{not json", headers={"content-type": "application/json"}), "JSON decode error")
    assert_400(post(server, b"[1, 2]", headers={"content-type": "application/json"}), "JSON object")
    assert_400(post(server, b'{"token_ids": [1]}', headers={"content-type": "text/plain"}), "application/json")
    big = b'{"token_ids": [' + b"1," * (17 * 1024 * 1024) + b'1], "sampling_params": {}}'
    assert_400(post(server, big, headers={"content-type": "application/json"}), "over the limit")


def test_unknown_model_is_404(server) -> None:  # type: ignore[no-untyped-def]
    r = post(server, {"token_ids": PROMPT, "model": "nope", "sampling_params": {}})
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"]


def test_unknown_keys_ignored(server) -> None:  # type: ignore[no-untyped-def]
    r = post(server, {"token_ids": PROMPT, "future_field": 1, "sampling_params": {"max_tokens": 2, "novel": True}})
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 2


def test_api_key_guards_all_but_health(tokens_only) -> None:  # type: ignore[no-untyped-def]
    url = tokens_only.url
    assert httpx.get(url + "/health").status_code == 200
    for method, path in [("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/inference/v1/generate"),
                         ("POST", "/inference/v1/abort_requests"), ("POST", "/abort_requests")]:
        r = httpx.request(method, url + path, json={"request_ids": []})
        assert r.status_code == 401, path
        assert "API key" in r.json()["error"]["message"]
    ok = httpx.post(url + "/abort_requests", json={"request_ids": ["x"]}, headers=tokens_only.headers)
    assert ok.status_code == 200
    r = httpx.post(url + "/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 3}},
                   headers=tokens_only.headers, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 3


def test_abort_body_errors(server) -> None:  # type: ignore[no-untyped-def]
    r = httpx.post(server.url + "/inference/v1/abort_requests", json={"ids": []})
    assert_400(r, "request_ids")
