"""Checks around generate: the 400 rules, render's shape, and derender (batch, streamed, inline), with
the reasoning and tool parsers the server says it runs."""

from __future__ import annotations

import json
from typing import Any

from pdserve.conformance.server import (
    CHAT_DERENDER,
    CHAT_RENDER,
    COMPLETIONS_RENDER,
    DERENDER,
    DERENDER_ENDPOINT,
    DERENDER_STREAM,
    GENERATE,
    TEXT,
    NotApplicable,
    Server,
    expect,
    short,
)

# -- 400 rules ----------------------------------------------------------------------------------------


def _rejected(r: Any, status: int = 400) -> str:
    """The answer is ``status`` with vLLM's error body ``{"error": {"message", "type", "code"}}``."""
    expect(r.status_code == status, f"answered {r.status_code}, want {status}: {r.text[:200]}")
    try:
        error = r.json().get("error")
    except ValueError:
        error = None
    expect(
        isinstance(error, dict) and isinstance(error.get("message"), str) and error.get("code") == status,
        f"error body {r.text[:200]} lacks {{error: {{message, type, code: {status}}}}}",
    )
    return f"{status}: {error['message'][:100]!r}"


def reject(make_body: Any, needs: str | None = None, status: int = 400) -> Any:
    """A rule: the body ``make_body(server)`` builds is refused with ``status``."""

    def check(server: Server) -> str:
        if needs is not None:
            server.need(needs)
        return _rejected(server.wire.post(GENERATE, make_body(server)), status)

    return check


def _sampling(server: Server, mode: str | None = None, **sampling: Any) -> dict[str, Any]:
    return server.body(mode, max_tokens=2, **sampling)


REJECTS: dict[str, Any] = {
    "empty_token_ids": lambda s: {**_sampling(s), "token_ids": []},
    "negative_token_id": lambda s: {**_sampling(s), "token_ids": [-1]},
    "token_id_outside_vocabulary": lambda s: {**_sampling(s), "token_ids": [2**30]},
    "missing_sampling_params": lambda s: {"model": s.model, "token_ids": s.prompt},
    "prompt_plus_max_tokens_over_model_len": lambda s: (
        _sampling(s) | {"sampling_params": {"max_tokens": s.max_model_len or 10**7}}
    ),
    "n_over_limit": lambda s: _sampling(s, n=100_000, temperature=1.0),
    "logprobs_over_limit": lambda s: _sampling(s, logprobs=100_000),
    "text_without_detokenize": lambda s: _sampling(s, "text", detokenize=False),
    "chat_request_without_derender": lambda s: {**_sampling(s, "text"), "chat_request": s.chat_request()},
    "derender_without_parser_context": lambda s: {
        k: v for k, v in _sampling(s, "derender").items() if k != "parse_context"
    },
}


def reject_malformed_json(server: Server) -> str:
    return _rejected(server.wire.post_raw(GENERATE, b'{"token_ids": [1,'))


def reject_unknown_model(server: Server) -> str:
    return _rejected(server.wire.post(GENERATE, {**_sampling(server), "model": "no-such-model-conformance"}), 404)


def reject_derender_without_context(server: Server) -> str:
    server.need_parser("reasoning" if server.reasoning_parser else "tool")
    return reject(REJECTS["derender_without_parser_context"], DERENDER)(server)


def reject_abort_without_ids(server: Server) -> str:
    return _rejected(server.wire.post("/inference/v1/abort_requests", {}))


# -- render -------------------------------------------------------------------------------------------


def render_shape(server: Server) -> str:
    r = server.rendered
    problems = []
    if not isinstance(r.get("request_id"), str) or not r["request_id"].startswith("chatcmpl-"):
        problems.append(f"request_id {short(r.get('request_id'))} (want chatcmpl-...)")
    if not (
        isinstance(r.get("token_ids"), list) and r["token_ids"] and all(isinstance(t, int) for t in r["token_ids"])
    ):
        problems.append(f"token_ids {short(r.get('token_ids'))}")
    sampling = r.get("sampling_params")
    if not isinstance(sampling, dict) or sampling.get("max_tokens") != 4:
        problems.append(f"sampling_params {short(sampling)} (want max_tokens 4)")
    if r.get("model") != server.model:
        problems.append(f"model {r.get('model')!r}")
    if r.get("stream") not in (False, None):
        problems.append(f"stream {r.get('stream')!r}")
    expect(not problems, "; ".join(problems))
    return f"GenerateRequest keys {sorted(r)}"


def render_accepted(server: Server) -> str:
    choice = server.generate(server.rendered)["choices"][0]
    expect(len(choice.get("token_ids") or []) <= 4, f"max_tokens 4 gave {choice.get('token_ids')}")
    return f"render output sent unchanged: 200, {len(choice['token_ids'])} ids"


def render_completions(server: Server) -> str:
    r = server.wire.post(COMPLETIONS_RENDER, {"model": server.model, "prompt": ["a b", "c"], "max_tokens": 3})
    expect(r.status_code == 200, f"answered {r.status_code}: {r.text[:200]}")
    body = r.json()
    expect(
        isinstance(body, list) and len(body) == 2 and all(b.get("token_ids") for b in body),
        f"two prompts gave {short(body)}, want two GenerateRequests",
    )
    return f"two prompts, two GenerateRequests ({[len(b['token_ids']) for b in body]} ids)"


def render_stream_flag(server: Server) -> str:
    r = server.wire.post(CHAT_RENDER, server.chat_request(max_tokens=2, stream=True))
    expect(r.status_code == 200 and r.json().get("stream") is True, f"stream=true rendered as {r.text[:200]}")
    return "stream: true carried into the GenerateRequest"


# -- derender -----------------------------------------------------------------------------------------


def _message_fields(message: dict[str, Any]) -> tuple[str, str, list[tuple[str, Any]]]:
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or []]
    return message.get("content") or "", message.get("reasoning") or "", calls


def _derender(server: Server, tokens_response: dict[str, Any], **chat: Any) -> dict[str, Any]:
    r = server.wire.post(
        CHAT_DERENDER, {"generate_response": tokens_response, "chat_request": server.chat_request(**chat)}
    )
    expect(r.status_code == 200, f"derender answered {r.status_code}: {r.text[:300]}")
    return r.json()["choices"][0]


def derender_equals_text(server: Server) -> str:
    if server.parsers:
        raise NotApplicable("compares plain text: needs a server without parsers")
    server.need(DERENDER_ENDPOINT)
    server.need(TEXT)
    message = _derender(server, server.baseline())["message"]
    text = server.baseline("text")["choices"][0]["text"]
    expect((message.get("content") or "") == text, f"derendered content {message.get('content')!r} != text {text!r}")
    return f"/derender of the tokens answer = the text answer ({text!r})"


def derender_stream_equals_batch(server: Server) -> str:
    server.need(DERENDER_ENDPOINT)
    batch = _message_fields(_derender(server, server.baseline())["message"])
    s = server.stream(server.body(stream=True))
    state, content, reasoning, roles = None, "", "", []
    for chunk in s.events:
        r = server.wire.post(
            CHAT_DERENDER,
            {
                "stream": True,
                "generate_chunk": chunk,
                "stream_state": state,
                "chat_request": server.chat_request(),
                "prompt_token_ids": server.prompt,
            },
        )
        expect(r.status_code == 200, f"streaming derender answered {r.status_code}: {r.text[:300]}")
        state = r.json()["stream_state"]
        for choice in r.json()["chunk"]["choices"]:
            delta = choice.get("delta") or {}
            roles.append(delta.get("role"))
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning") or ""
    expect(roles and roles[0] == "assistant", f"first delta role {roles[:1]}, want 'assistant'")
    expect(
        (content, reasoning) == batch[:2],
        f"streamed (content, reasoning) {(content, reasoning)!r} != batch {batch[:2]!r}",
    )
    return f"{len(s.events)} chunks derendered one by one fold to the batch message"


def derender_inline_equals_endpoint(server: Server) -> str:
    server.need(DERENDER)
    server.need(DERENDER_ENDPOINT)
    inline = server.generate(server.body("derender"))["choices"][0]
    endpoint = _derender(server, server.baseline())
    expect(
        _message_fields(inline["message"]) == _message_fields(endpoint["message"]),
        f"inline message {short(inline['message'])} != /derender message {short(endpoint['message'])}",
    )
    expect(
        inline["finish_reason"] == endpoint["finish_reason"],
        f"finish {inline['finish_reason']} != {endpoint['finish_reason']}",
    )
    return f"output_mode=derender = /derender(tokens): {short(inline['message'], 100)}"


def derender_inline_stream(server: Server) -> str:
    server.need(DERENDER)
    server.need(DERENDER_STREAM)
    batch = server.generate(server.body("derender"))["choices"][0]
    s = server.stream(server.body("derender", stream=True))
    deltas = [c.get("delta") or {} for c in s.choices()]
    folded = ("".join(d.get("content") or "" for d in deltas), "".join(d.get("reasoning") or "" for d in deltas))
    expect(folded == _message_fields(batch["message"])[:2], f"streamed {folded!r} != batch {short(batch['message'])}")
    expect(deltas and deltas[0].get("role") == "assistant", f"first delta {short(deltas[:1])}")
    expect(s.done and s.finish() == batch["finish_reason"], f"finish {s.finish()!r}, done={s.done}")
    return f"{len(s.events)} derender chunks fold to the batch message"


def _synthetic(server: Server, text: str) -> dict[str, Any]:
    """A tokens answer whose ids are ``text`` as the server tokenizes it. It finished with ``stop`` on an id
    that is no stop token, so derender keeps all its text (the stop rule of docs/protocol.md)."""
    ids = server.tokenize(text)
    return {
        "request_id": "generate-tokens-conformance",
        "model": server.model,
        "output_mode": "tokens",
        "choices": [{"index": 0, "token_ids": ids, "finish_reason": "stop", "stop_reason": None, "logprobs": None}],
    }


THINK = "<think>\nplan the answer\n</think>\n\n"


def derender_reasoning(server: Server) -> str:
    server.need_parser("reasoning")
    server.need(DERENDER_ENDPOINT)
    choice = _derender(server, _synthetic(server, THINK + "Red, green, blue."))
    content, reasoning, _ = _message_fields(choice["message"])
    expect(
        reasoning.strip() == "plan the answer" and content.strip() == "Red, green, blue.",
        f"reasoning {reasoning!r}, content {content!r}",
    )
    return f"reasoning={reasoning!r} content={content!r}"


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
TOOL_MARKUP = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "qwen3_coder": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    ),
}
TOOL_MARKUP["qwen3_xml"] = TOOL_MARKUP["qwen3_coder"]


def derender_tool_call(server: Server) -> str:
    parser = server.need_parser("tool")
    server.need(DERENDER_ENDPOINT)
    text = (THINK if server.reasoning_parser else "") + TOOL_MARKUP[parser]
    choice = _derender(server, _synthetic(server, text), tools=TOOLS, tool_choice="auto")
    _, _, calls = _message_fields(choice["message"])
    expect(calls == [("get_weather", {"city": "Paris"})], f"tool_calls {short(choice['message'].get('tool_calls'))}")
    expect(
        choice.get("finish_reason") == "tool_calls",
        f"finish_reason {choice.get('finish_reason')!r} with a tool call, want 'tool_calls'",
    )
    return "get_weather({'city': 'Paris'}), finish_reason=tool_calls"
