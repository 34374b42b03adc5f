"""Hostile input on every route: a 4xx JSON error that names the field, never a 5xx, and a healthy server after.

The table holds each class of issue 12 (nesting, negative and out-of-vocabulary ids, wrong types in
extra_args and messages, lone surrogates, tool_choice without tools, unbounded indexes and lists,
oversized ids and headers) plus every DESIGN.md validation rule, against three servers: the scripted
engine with parsers and an API key, a ``--tokens-only`` one and a plain one.
"""

from __future__ import annotations

import asyncio
import json
import select
import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.protocol.errors import RequestError
from pdserve.protocol.limits import (
    MAX_HEADER_BYTES,
    MAX_JSON_DEPTH,
    MAX_MESSAGES,
    MAX_REQUEST_ID_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOOLS,
)
from pdserve.protocol.sse import sse_event
from pdserve.serve.config import ServerConfig
from pdserve.serve.http.body import check_json
from pdserve.serve.http.handlers import install_error_handlers
from pdserve.serve.metrics import Metrics
from pdserve.serve.responses import respond_stream
from pdserve.serve.state import AppState
from pdserve.topology.process import start_all
from tests.e2e.test_generate import PROMPT, SCRIPTS
from tests.serverproc import ServerProcess

KEY = "hostile-key"
GEN, CHAT, CMPL = "/inference/v1/generate", "/v1/chat/completions", "/v1/completions"
CHAT_RENDER, CMPL_RENDER = "/v1/chat/completions/render", "/v1/completions/render"
CHAT_DR, CMPL_DR = "/v1/chat/completions/derender", "/v1/completions/derender"
ABORT = "/inference/v1/abort_requests"
MSGS = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
VOCAB_OUT = 10**9


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, ServerProcess]]:
    base = ("serve", "--engine", "scripted", "--tokenizer", "qwen3", "--script", str(SCRIPTS),
            "--max-model-len", "2048", "--max-num-seqs", "4")
    procs = {
        "parsers": ServerProcess(*base, "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes",
                                 "--enable-auto-tool-choice", api_key=KEY),
        "tokens_only": ServerProcess(*base, "--tokens-only"),
        "plain": ServerProcess(*base),
    }
    try:
        start_all(list(procs.values()))
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def gen(**kw: Any) -> dict[str, Any]:
    return {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}, **kw}


def sp(**kw: Any) -> dict[str, Any]:
    return {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2, **kw}}


def chat(**kw: Any) -> dict[str, Any]:
    return {"messages": MSGS, "max_tokens": 4, **kw}


def cmpl(**kw: Any) -> dict[str, Any]:
    return {"prompt": "hi", "max_tokens": 2, **kw}


def chunk(index: int = 0, token_ids: list[int] | None = None, **kw: Any) -> dict[str, Any]:
    return {"stream": True, "generate_chunk": {"request_id": "r", "choices": [
        {"index": index, "token_ids": token_ids if token_ids is not None else [9707]}]}, **kw}


def response(*choices: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return {"generate_response": {"request_id": "r", "choices": list(choices)}, **kw}


def choice(index: int = 0, token_ids: list[int] | None = None) -> dict[str, Any]:
    return {"index": index, "token_ids": token_ids if token_ids is not None else [9707], "finish_reason": "stop"}


@dataclass(frozen=True)
class Case:
    name: str
    server: str
    path: str
    body: Any  # a JSON value, or a str sent as it is (lone surrogates, deep nesting)
    needle: str  # a substring of the error message: it names the field or the limit
    status: int = 400
    headers: tuple[tuple[str, str], ...] = ()


CASES = [
    # -- nesting: every route that reads a body (a RecursionError before)
    *(Case(f"deep-json-{path}", "plain", path, '{"a": ' + nested(10_000) + "}", f"deeper than {MAX_JSON_DEPTH}")
      for path in (GEN, CHAT, CMPL, CHAT_RENDER, CMPL_RENDER, CHAT_DR, CMPL_DR, ABORT)),
    Case("deep-json-tokens-only", "tokens_only", GEN, '{"a": ' + nested(10_000) + "}", "deeper than"),
    Case("deep-json-parsers", "parsers", CHAT, '{"a": ' + nested(200) + "}", "deeper than"),
    # -- negative / out-of-vocabulary ids
    Case("negative-prompt-id", "plain", CMPL, cmpl(prompt=[-1, 5]), "prompt"),
    Case("negative-prompt-ids-batch", "plain", CMPL, cmpl(prompt=[[1], [-3]]), "prompt"),
    Case("empty-prompt-ids", "plain", CMPL, cmpl(prompt=[[]]), "prompt"),
    Case("oov-prompt-id", "plain", CMPL, cmpl(prompt=[VOCAB_OUT]), "outside the vocabulary"),
    Case("negative-token-ids", "plain", GEN, gen(token_ids=[-1]), "token_ids"),
    Case("oov-token-ids", "tokens_only", GEN, gen(token_ids=[VOCAB_OUT]), "token_ids"),
    Case("negative-stop-token-id", "plain", GEN, sp(stop_token_ids=[-1]), "stop_token_ids"),
    Case("oov-logit-bias", "plain", GEN, sp(logit_bias={str(VOCAB_OUT): 1.0}), "logit_bias"),
    Case("negative-allowed-ids", "plain", CHAT, chat(allowed_token_ids=[-5]), "allowed_token_ids"),
    # -- wrong types inside extra_args (an engine exception before)
    Case("script-index-str", "plain", CMPL, cmpl(vllm_xargs={"script_index": "abc"}), "script_index"),
    Case("script-index-list", "plain", CHAT, chat(vllm_xargs={"script_index": [1]}), "script_index"),
    Case("script-index-generate", "tokens_only", GEN, sp(extra_args={"script_index": {"a": 1}}), "script_index"),
    Case("extra-args-kv-not-dict", "plain", GEN, sp(extra_args={"kv_transfer_params": 5}), "kv_transfer_params"),
    Case("tokens-per-step-zero", "plain", CMPL, cmpl(vllm_xargs={"tokens_per_step": 0}), "tokens_per_step"),
    Case("tokens-per-step-str", "tokens_only", GEN, sp(extra_args={"tokens_per_step": "3"}), "tokens_per_step"),
    # -- message shapes, checked before the chat template
    Case("user-tool-calls-int", "plain", CHAT, chat(messages=[{"role": "user", "content": "x", "tool_calls": 5}]),
         "tool_calls"),
    Case("user-tool-calls-str", "parsers", CHAT,
         chat(messages=[{"role": "user", "content": "x", "tool_calls": "call"}]), "tool_calls"),
    Case("tool-call-function-int", "plain", CHAT, chat(messages=[
        {"role": "assistant", "content": "", "tool_calls": [{"function": 3}]}, *MSGS]), "function"),
    Case("tool-call-no-name", "plain", CHAT_RENDER, chat(messages=[
        {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}, *MSGS]), "name"),
    Case("content-int", "plain", CHAT, chat(messages=[{"role": "user", "content": 5}]), "content"),
    Case("content-image-part", "plain", CHAT, chat(messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), "text content"),
    Case("message-not-object", "plain", CHAT, chat(messages=[5]), "messages.0"),
    Case("message-without-role", "plain", CHAT, chat(messages=[{"content": "x"}]), "role"),
    Case("role-int", "plain", CHAT_RENDER, chat(messages=[{"role": 5, "content": "x"}]), "role"),
    Case("too-many-messages", "plain", CHAT, chat(messages=MSGS * (MAX_MESSAGES + 1)), "messages"),
    # -- cache_salt
    Case("cache-salt-empty", "plain", CHAT, chat(cache_salt=""), "cache_salt"),
    Case("cache-salt-long", "plain", CMPL, cmpl(cache_salt="s" * 5000), "cache_salt"),
    Case("cache-salt-generate", "tokens_only", GEN, gen(cache_salt=""), "cache_salt"),
    # -- lone surrogates (valid JSON escapes, not text)
    Case("surrogate-content", "plain", CHAT, '{"messages": [{"role": "user", "content": "\\ud800"}]}',
         "messages[0].content"),
    Case("surrogate-prompt", "plain", CMPL, '{"prompt": "a\\udfff", "max_tokens": 2}', "prompt"),
    Case("surrogate-request-id", "plain", GEN,
         json.dumps(gen(request_id="@")).replace("@", "\\ud800"), "request_id"),
    Case("surrogate-model", "plain", CMPL, '{"prompt": "hi", "model": "\\udbff"}', "model"),
    Case("surrogate-stop", "parsers", CHAT, json.dumps(chat(stop=["@"])).replace("@", "\\ud801"), "stop"),
    Case("surrogate-key", "plain", CHAT_RENDER, '{"messages": [{"role": "user", "content": "x", "\\ud800": 1}]}',
         "surrogate"),
    # -- tool_choice
    Case("named-tool-no-tools", "parsers", CHAT, chat(tool_choice={"type": "function", "function": {"name": "f"}}),
         "tool_choice"),
    Case("named-tool-not-in-tools", "parsers", CHAT,
         chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "other"}}), "tool_choice"),
    Case("required-no-tools", "parsers", CHAT, chat(tool_choice="required"), "tool_choice='required' needs tools"),
    Case("required-no-tools-render", "parsers", CHAT_RENDER, chat(tool_choice="required"), "needs tools"),
    Case("required-no-parser", "plain", CHAT, chat(tools=[TOOL], tool_choice="required"), "--tool-call-parser"),
    Case("auto-no-parser", "plain", CHAT, chat(tools=[TOOL]), "--enable-auto-tool-choice"),
    Case("too-many-tools", "parsers", CHAT, chat(tools=[TOOL] * (MAX_TOOLS + 1)), "tools"),
    Case("parse-context-named-unknown", "parsers", GEN, gen(output_mode="derender", parse_context={
        "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "x"}}}), "tool_choice"),
    # -- derender: ids, indexes, stream state
    Case("derender-negative-prompt-ids", "plain", CHAT_DR, response(choice(), prompt_token_ids=[-1]),
         "prompt_token_ids"),
    Case("derender-oov-prompt-ids", "plain", CHAT_DR, response(choice(), prompt_token_ids=[VOCAB_OUT]),
         "prompt_token_ids"),
    Case("derender-stream-oov-prompt-ids", "plain", CHAT_DR, chunk(prompt_token_ids=[VOCAB_OUT]), "prompt_token_ids"),
    Case("derender-cmpl-stream-negative-prompt", "plain", CMPL_DR, chunk(prompt_token_ids=[-3]), "prompt_token_ids"),
    Case("derender-oov-output", "plain", CHAT_DR, response(choice(token_ids=[VOCAB_OUT])), "vocabulary"),
    Case("derender-negative-output", "plain", CMPL_DR,
         {"generate_responses": [{"request_id": "r", "choices": [choice(token_ids=[-2])]}]}, "token_ids"),
    Case("derender-state-negative-context", "plain", CHAT_DR, chunk(stream_state={"logprob_context_token_ids": [-5]}),
         "logprob_context_token_ids"),
    Case("derender-state-oov-output", "plain", CHAT_DR, chunk(stream_state={"output_token_ids": [VOCAB_OUT]}),
         "output_token_ids"),
    Case("derender-state-oov-context", "plain", CMPL_DR,
         chunk(stream_state={"logprob_context_token_ids": [VOCAB_OUT]}), "logprob_context_token_ids"),
    Case("derender-stream-prompt-too-long", "plain", CHAT_DR, chunk(prompt_token_ids=[9707] * 3000),
         "prompt_token_ids has 3000 ids"),
    Case("derender-cmpl-chunk-index-past-n", "plain", CMPL_DR,
         chunk(index=1, completion_request={"prompt": "x", "n": 1}), "index"),
    Case("derender-state-negative-output", "plain", CMPL_DR, chunk(stream_state={"output_token_ids": [-1]}),
         "output_token_ids"),
    Case("derender-chunk-index-huge", "plain", CHAT_DR, chunk(index=1_000_000), "index"),
    Case("derender-cmpl-chunk-index-huge", "plain", CMPL_DR, chunk(index=1_000_000), "index"),
    Case("derender-chunk-index-past-max-seqs", "plain", CHAT_DR, chunk(index=100), "max_num_seqs"),
    Case("derender-chunk-index-past-n", "parsers", CHAT_DR,
         chunk(index=2, prompt_token_ids=PROMPT, chat_request={"messages": [], "n": 2}), "index"),
    Case("derender-chunk-index-negative", "plain", CHAT_DR, chunk(index=-1), "index"),
    Case("derender-choice-index-negative", "plain", CHAT_DR, response(choice(index=-1)), "index"),
    Case("derender-choice-index-past", "plain", CHAT_DR, response(choice(index=5)), "generate_response.choices"),
    Case("derender-choice-index-twice", "plain", CHAT_DR, response(choice(), choice()), "each once"),
    Case("derender-cmpl-index-past", "plain", CMPL_DR,
         {"generate_responses": [{"request_id": "r", "choices": [choice(index=3)]}]}, "each once"),
    Case("derender-no-context-with-parsers", "parsers", CHAT_DR, response(choice()), "chat_request"),
    # -- DESIGN.md validation rules
    Case("rule1-text-on-tokens-only", "tokens_only", GEN, gen(output_mode="text"), "tokens-only"),
    Case("rule2-detokenize-false", "plain", GEN,
         {"token_ids": PROMPT, "output_mode": "text", "sampling_params": {"detokenize": False}}, "detokenize"),
    Case("rule3-chat-request-without-derender", "plain", GEN, gen(chat_request={"messages": MSGS}), "chat_request"),
    Case("rule4-derender-no-context", "parsers", GEN, gen(output_mode="derender"), "parse_context"),
    Case("rule5-stop-on-tokens-only", "tokens_only", GEN, sp(stop=["x"]), "stop"),
    Case("rule6-both-contexts", "parsers", GEN,
         gen(output_mode="derender", chat_request={"messages": []}, parse_context={}), "not both"),
    Case("rule6-empty-token-ids", "plain", GEN, gen(token_ids=[]), "token_ids"),
    Case("rule6-over-model-length", "plain", GEN, sp(max_tokens=4000), "max_tokens"),
    Case("rule6-n-over-limit", "plain", CHAT, chat(n=100, stream=True), "n=100"),
    Case("rule6-malformed-json", "plain", GEN, "{not json", "JSON decode error"),
    Case("rule6-not-an-object", "tokens_only", GEN, "[1, 2]", "JSON object"),
    # -- bounded lists and strings
    Case("too-many-stop-strings", "plain", CHAT, chat(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]), "stop"),
    Case("stop-string-too-long", "plain", GEN, sp(stop=["x" * 5000]), "stop"),
    Case("too-many-prompts", "plain", CMPL, cmpl(prompt=[[1]] * 2000), "prompt"),
    Case("too-many-text-prompts", "plain", CMPL_RENDER, cmpl(prompt=["x"] * 2000), "at most 1024"),
    Case("request-id-too-long", "plain", CHAT, chat(request_id="r" * 1000), "request_id"),
    Case("generate-request-id-too-long", "tokens_only", GEN, gen(request_id="r" * 1000), "request_id"),
    Case("x-request-id-too-long", "plain", GEN, gen(), "X-Request-Id",
         headers=(("x-request-id", "r" * (MAX_REQUEST_ID_CHARS + 1)),)),
    Case("x-request-id-too-long-chat", "parsers", CHAT, chat(), "X-Request-Id",
         headers=(("x-request-id", "r" * 1000),)),
    Case("x-request-id-megabyte", "parsers", CHAT, chat(), "headers are over the limit", status=431,
         headers=(("x-request-id", "r" * 1_000_000),)),
    # -- free-form JSON bound for the engine: an int the engine wire cannot carry (a 500 on the torch engine before)
    Case("extra-args-huge-int", "plain", GEN, sp(extra_args={"x": [1, {"y": 10**30}]}), "sampling_params.extra_args"),
    Case("kv-params-huge-int", "tokens_only", GEN, gen(kv_transfer_params={"n": -(2**64)}), "kv_transfer_params"),
    Case("vllm-xargs-huge-int", "parsers", CHAT, chat(vllm_xargs={"n": 2**64}), "vllm_xargs"),
    Case("completions-kv-params-huge-int", "plain", CMPL, cmpl(kv_transfer_params={"n": 2**70}), "kv_transfer_params"),
    Case("abort-ids-not-strings", "tokens_only", ABORT, {"request_ids": [5]}, "request_ids"),
    Case("wrong-content-type", "plain", CHAT, chat(), "application/json", headers=(("content-type", "text/plain"),)),
    Case("huge-header", "plain", "/health", None, "headers are over the limit", status=431,
         headers=(("x-big", "a" * (MAX_HEADER_BYTES + 1)),)),
    Case("huge-header-generate", "tokens_only", GEN, gen(), "headers are over the limit", status=431,
         headers=(("x-big", "a" * (4 * 1024 * 1024)),)),
]


def send(srv: ServerProcess, case: Case) -> httpx.Response:
    headers = {**srv.headers, "content-type": "application/json", **dict(case.headers)}
    if case.body is None:
        return httpx.get(srv.url + case.path, headers=headers, timeout=60)
    raw = case.body if isinstance(case.body, str) else json.dumps(case.body)
    return httpx.post(srv.url + case.path, content=raw.encode("utf-8", "surrogatepass"), headers=headers, timeout=60)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_hostile_request_is_a_4xx_naming_the_field(servers: dict[str, ServerProcess], case: Case) -> None:
    srv = servers[case.server]
    r = send(srv, case)
    assert r.status_code == case.status, r.text[:500]
    assert r.headers["content-type"].startswith("application/json"), r.headers
    error = r.json()["error"]
    assert error["code"] == case.status
    assert case.needle in error["message"], error["message"]
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200


def test_table_covers_every_route_and_server() -> None:
    assert len(CASES) >= 60
    assert {c.path for c in CASES} >= {GEN, CHAT, CMPL, CHAT_RENDER, CMPL_RENDER, CHAT_DR, CMPL_DR, ABORT}
    assert {c.server for c in CASES} == {"parsers", "tokens_only", "plain"}


def test_head_health_answers_like_get(servers: dict[str, ServerProcess]) -> None:
    for srv in servers.values():
        head, get = httpx.head(srv.url + "/health"), httpx.get(srv.url + "/health")
        assert head.status_code == get.status_code == 200
        assert head.headers["x-pdserve-pid"] == get.headers["x-pdserve-pid"]


def test_chunked_body_stops_being_read_at_the_limit(servers: dict[str, ServerProcess]) -> None:
    """A body with no Content-Length is refused once 32 MiB arrived, not after the client sent 300 MB."""
    srv = servers["plain"]
    sent = 0

    def body() -> Iterator[bytes]:
        nonlocal sent
        yield b'{"token_ids": ['
        piece = b"1," * (512 * 1024)
        while sent < 300 * 1024 * 1024:
            sent += len(piece)
            yield piece

    try:
        r = httpx.post(srv.url + GEN, content=body(), headers={"content-type": "application/json"}, timeout=60)
    except httpx.HTTPError:
        # The server answered and closed while the client was still writing: it did not read on.
        pass
    else:
        assert r.status_code == 400 and "over the limit" in r.json()["error"]["message"], r.text
    assert sent < 300 * 1024 * 1024
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200


def test_slowly_sent_huge_header_is_cut_off(servers: dict[str, ServerProcess]) -> None:
    """Headers trickled in pieces are counted as they arrive: the 431 comes before the header ends."""
    srv = servers["plain"]
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: ")
        for _ in range(16 * MAX_HEADER_BYTES // 4096):
            if select.select([sock], [], [], 0.05)[0]:
                break  # the server answered before the header ended
            try:
                sock.sendall(b"a" * 4096)
            except OSError:
                return  # the server closed the connection early (its 431 lost to the reset): cut off
        else:
            pytest.fail("the server read a 1 MiB header without answering")
        reply = sock.recv(65536)
    assert reply.startswith(b"HTTP/1.1 431"), reply[:200]


def test_no_server_errors_counted(servers: dict[str, ServerProcess]) -> None:
    """After the whole table, /metrics counts no 5xx on any server (the counter sees every route)."""
    for srv in servers.values():
        text = httpx.get(srv.url + "/metrics", headers=srv.headers, timeout=10).text
        assert "# TYPE pdserve_server_errors_total counter" in text
        assert "pdserve_server_errors_total{" not in text, text


def test_late_failures_end_streams_with_a_verdict_and_every_5xx_is_counted() -> None:
    """In process (no server bug can be provoked from outside any more): a stream that fails after its
    200 headers ends with an error event then [DONE], and /metrics counts it and a batch route's bug."""
    app = FastAPI()
    state = AppState(config=ServerConfig(engine=None), engine=None, tokenizer=None, metrics=Metrics())
    app.state.pdserve = state
    install_error_handlers(app)

    async def events() -> AsyncIterator[str]:
        yield sse_event({"step": 1})
        raise ValueError("a bug after the headers")

    @app.post("/stream")
    async def stream() -> StreamingResponse:
        return respond_stream(state, ("test", "tokens"), [], events())

    @app.post("/batch")
    async def batch() -> None:
        raise KeyError("a bug before any byte")

    async def run() -> tuple[httpx.Response, httpx.Response]:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post("/stream"), await client.post("/batch")

    streamed, failed = asyncio.run(run())
    events_seen = [line.removeprefix("data: ") for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert streamed.status_code == 200 and events_seen[-1] == "[DONE]", streamed.text
    assert json.loads(events_seen[-2])["error"]["code"] == 500
    assert failed.status_code == 500 and failed.json()["error"]["type"] == "InternalServerError"
    errors = state.metrics.server_errors
    assert errors.labels("/stream", "500")._value.get() == 1
    assert errors.labels("/batch", "500")._value.get() == 1
    assert state.metrics.requests.labels("test", "tokens", "500")._value.get() == 1


JSON_LEAVES = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
JSON_VALUES = st.recursive(JSON_LEAVES, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=4), inner, max_size=4), max_leaves=20)


@settings(max_examples=200, deadline=None)
@given(value=JSON_VALUES, extra=st.integers(0, 3), surrogate=st.sampled_from(["\ud800", "\udfff", "a\udbffb"]))
def test_body_check_refuses_exactly_deep_nesting_and_lone_surrogates(value: Any, extra: int, surrogate: str) -> None:
    """In process, the body check every route runs: any JSON without lone surrogates passes within the
    depth bound; the same value nested past it, or with a lone surrogate added, is a 400 naming why."""
    check_json({"v": value})  # st.text never makes lone surrogates: valid text passes
    deep: Any = value
    for _ in range(MAX_JSON_DEPTH + extra):
        deep = [deep]
    with pytest.raises(RequestError, match=f"deeper than {MAX_JSON_DEPTH}"):
        check_json({"v": deep})
    with pytest.raises(RequestError, match="surrogate") as err:
        check_json({"v": value, "w": [1, {"x": surrogate}]})
    assert err.value.param == "w[1].x"
