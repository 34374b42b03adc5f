"""Parity: inline derender == derender(generate tokens) == coupled /v1/chat/completions, batch and streamed.

A real server per parser setup (scripted engine replaying every case's output
with the real Qwen3 tokenizer), its requests at one token per engine step and at three
(``vllm_xargs.tokens_per_step``). For each case every surface is checked against
the hand-written expectation in tests/fixtures/parser_cases.py and against each
other (content, reasoning, tool calls by name + parsed arguments, finish_reason,
stop_reason, logprob tokens/bytes).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from pdserve.text.tokenizer import Tokenizer
from pdserve.topology.process import start_all, stop_all
from tests.fixtures.parser_cases import ALL_CASES, CASES, ParserCase, Setup
from tests.serverproc import ServerProcess
from tests.sse import stream_post

TOK = Tokenizer.load("qwen3")
SETUPS: dict[str, Setup] = {}
CASES_BY_SETUP: dict[str, list[ParserCase]] = defaultdict(list)
for _case in ALL_CASES:  # pdserve's cases and the restated vLLM parser-test cases
    for _setup in _case.setups:
        SETUPS[_setup.label] = _setup
        CASES_BY_SETUP[_setup.label].append(_case)

# Every case of every setup on the server of one token per step; on the server of three (multi-token deltas
# into the parsers and the streams) the longest case of each setup. That the parsers fold any chunking of any
# case into the batch answer is tests/unit/parsers/test_parser_cases.py's property; here the surfaces.
PARAMS = [(1, label, case) for label, cases in CASES_BY_SETUP.items() for case in cases] + [
    (3, label, max(cases, key=lambda c: len(c.output))) for label, cases in CASES_BY_SETUP.items()
]


class Servers:
    """One server per setup, each started on first use (or all at once)."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory):
        self._tmp = tmp_path_factory
        self._servers: dict[str, ServerProcess] = {}

    def _server(self, label: str) -> ServerProcess:
        script = self._tmp.mktemp("parity") / f"{label}.jsonl"
        script.write_text("".join(json.dumps({"text": c.output}) + "\n" for c in CASES_BY_SETUP[label]))
        return ServerProcess("serve", "--engine", "scripted", "--tokenizer", "qwen3", "--script", str(script),
                             *SETUPS[label].cli_args())

    def get(self, label: str) -> ServerProcess:
        if label not in self._servers:
            self.start_all([label])
        return self._servers[label]

    def start_all(self, labels: list[str]) -> None:
        """Start the servers of ``labels`` together: their imports and tokenizer loads overlap."""
        new = {label: self._server(label) for label in labels if label not in self._servers}
        self._servers |= new
        start_all(list(new.values()))

    def stop(self) -> None:
        stop_all(list(self._servers.values()))


@pytest.fixture(scope="module")
def setups(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    """The servers, made on first use and shared by the module's tests."""
    made = Servers(tmp_path_factory)
    try:
        yield made
    finally:
        made.stop()


@dataclass
class Paced:
    """The servers, and how many ids a step of the engine gives each request of a test."""

    servers: Servers
    tokens_per_step: int

    def get(self, label: str) -> ServerProcess:
        return self.servers.get(label)


@pytest.fixture(params=[1, 3], ids=lambda k: f"{k}-per-step")
def servers(request: pytest.FixtureRequest, setups: Servers) -> Paced:
    return Paced(setups, request.param)


def chat_body(label: str, case: ParserCase, tokens_per_step: int, **extra: Any) -> dict[str, Any]:
    """The case's chat request: its script replayed ``tokens_per_step`` ids a step (the render carries both
    into the sampling params every other surface is sent)."""
    body = dict(case.request)
    body["vllm_xargs"] = {"script_index": CASES_BY_SETUP[label].index(case), "tokens_per_step": tokens_per_step}
    body["logprobs"] = True
    body["top_logprobs"] = 2
    if case.engine_finish_reason == "length":
        body["max_tokens"] = len(TOK.encode(case.output))
    body.update(extra)
    return body


# One client for the module's thousands of calls (a connection per server, kept alive).
CLIENT = httpx.Client(timeout=60)


def post(srv: ServerProcess, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = CLIENT.post(srv.url + path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def norm_message(message: dict[str, Any]) -> dict[str, Any]:
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or []]
    for c in message.get("tool_calls") or []:
        assert c["id"].startswith("chatcmpl-tool-") and c["type"] == "function"
    return {"content": message.get("content") or "", "reasoning": message.get("reasoning"), "tool_calls": calls}


def assemble(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """Fold stream deltas into one message; a tool call's id never changes."""
    content, reasoning = "", None
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        content += d.get("content") or ""
        if d.get("reasoning") is not None:
            reasoning = (reasoning or "") + d["reasoning"]
        for tc in d.get("tool_calls") or []:
            slot = calls.setdefault(tc["index"], {"id": None, "name": "", "arguments": ""})
            if tc.get("id"):
                assert slot["id"] in (None, tc["id"]), "tool-call id changed mid-stream"
                slot["id"] = tc["id"]
            fn = tc.get("function") or {}
            slot["name"] += fn.get("name") or ""
            slot["arguments"] += fn.get("arguments") or ""
    tool_calls = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    for c in calls.values():
        assert c["id"] and c["id"].startswith("chatcmpl-tool-")
    return {"content": content, "reasoning": reasoning, "tool_calls": tool_calls}


def expected(case: ParserCase) -> dict[str, Any]:
    return {
        "content": case.content or "",
        "reasoning": case.reasoning,
        "tool_calls": [(c.name, c.arguments) for c in case.tool_calls],
    }


def logprob_view(content: list[dict[str, Any]] | None) -> list[tuple[str, list[int], list[str]]] | None:
    if content is None:
        return None
    return [(e["token"], e["bytes"], [t["token"] for t in e["top_logprobs"]]) for e in content]


def stream_logprobs(choices: list[dict[str, Any]]) -> list | None:
    out: list = []
    seen = False
    for c in choices:
        if c.get("logprobs") is not None:
            seen = True
            out += c["logprobs"]["content"] or []
    return logprob_view(out) if seen else None


@pytest.mark.parametrize(("tokens_per_step", "label", "case"), PARAMS,
                         ids=[f"{k}-per-step-{label}-{case.name}" for k, label, case in PARAMS])
def test_chat_parity(setups: Servers, tokens_per_step: int, label: str, case: ParserCase) -> None:
    setups.start_all(list(CASES_BY_SETUP))  # the matrix uses every setup: start them together, once
    srv = setups.get(label)
    want = expected(case)
    chat = chat_body(label, case, tokens_per_step)

    # Coupled, batch and stream.
    coupled = post(srv, "/v1/chat/completions", chat)["choices"][0]
    events, done = stream_post(srv.url + "/v1/chat/completions", {**chat, "stream": True})
    assert done
    coupled_stream = [e["choices"][0] for e in events if e["choices"]]

    # Render once, then generate inline (batch, stream; parse_context and chat_request shapes).
    rendered = post(srv, "/v1/chat/completions/render", chat)
    assert rendered["parse_context"] is not None and rendered["output_mode"] == "tokens"
    inline = post(srv, "/inference/v1/generate", {**rendered, "output_mode": "derender"})
    assert inline["output_mode"] == "derender"
    inline_choice = inline["choices"][0]
    rfc_shape = {**rendered, "output_mode": "derender", "parse_context": None, "chat_request": chat}
    inline_rfc = post(srv, "/inference/v1/generate", rfc_shape)["choices"][0]
    events, done = stream_post(srv.url + "/inference/v1/generate", {**rendered, "output_mode": "derender",
                                                                     "stream": True})
    assert done and all(e["output_mode"] == "derender" for e in events)
    inline_stream = [e["choices"][0] for e in events]
    # One chunk per 4 tokens (the first token and the end at once): the same message, in fewer chunks. (On the
    # pace of one token per step; the other already feeds the parsers multi-token deltas.)
    interval_streams: dict[str, list[dict[str, Any]]] = {}
    if tokens_per_step == 1:
        events, done = stream_post(srv.url + "/v1/chat/completions", {**chat, "stream": True, "stream_interval": 4})
        assert done
        interval_streams["coupled stream_interval 4"] = [e["choices"][0] for e in events if e["choices"]]
        events, done = stream_post(srv.url + "/inference/v1/generate", {
            **rendered, "output_mode": "derender", "stream": True,
            "sampling_params": {**rendered["sampling_params"], "stream_interval": 4},
        })
        assert done
        interval_streams["inline stream_interval 4"] = [e["choices"][0] for e in events]

    # Tokens leg, then stateless derender (batch, and per-chunk streaming with stream_state).
    tokens = post(srv, "/inference/v1/generate", {**rendered, "return_token_ids": True})
    derendered = post(srv, "/v1/chat/completions/derender", {
        "generate_response": tokens, "chat_request": chat, "prompt_token_ids": rendered["token_ids"],
    })["choices"][0]
    derender_stream = _derendered_stream(srv, rendered, chat)

    batch = {"coupled": coupled, "inline": inline_choice, "inline_chat_request": inline_rfc,
             "derender": derendered}
    streams = {"coupled": coupled_stream, "inline": inline_stream, "derender": derender_stream}
    for name, choice in batch.items():
        assert norm_message(choice["message"]) == want, name
        assert choice["finish_reason"] == case.finish_reason, name
        assert choice["stop_reason"] == batch["coupled"]["stop_reason"], name
        assert logprob_view((choice["logprobs"] or {}).get("content")) == \
            logprob_view((coupled["logprobs"] or {}).get("content")), name
        if case.hide_metadata:
            assert choice["logprobs"] is None, name
    if case.hide_metadata:
        assert inline_choice["token_ids"] is None
    else:
        assert inline_choice["token_ids"] == tokens["choices"][0]["token_ids"]
    generated = len(tokens["choices"][0]["token_ids"])
    # The engine's steps carried the request's pace: a chunk per step at most (and one for the end).
    assert len(inline_stream) <= 2 + -(-generated // tokens_per_step)
    if interval_streams:
        chunks = len(interval_streams["inline stream_interval 4"])
        assert chunks <= 2 + (generated - 1) // 4
        assert chunks < len(inline_stream) or generated <= 12
    streams |= interval_streams
    for name, choices in streams.items():
        message = assemble([c["delta"] for c in choices])
        assert message == {**want, "reasoning": case.streamed_reasoning}, name
        finals = [c["finish_reason"] for c in choices if c["finish_reason"] is not None]
        assert finals == [case.finish_reason], name
        assert stream_logprobs(choices) == logprob_view((coupled["logprobs"] or {}).get("content")), name


def _derendered_stream(srv: ServerProcess, rendered: dict[str, Any], chat: dict[str, Any]) -> list[dict[str, Any]]:
    """A tokens stream, each chunk through stateless /derender with the state the last answer carried."""
    events, done = stream_post(srv.url + "/inference/v1/generate", {**rendered, "stream": True})
    assert done
    state, choices = None, []
    for event in events:
        res = post(srv, "/v1/chat/completions/derender", {
            "stream": True, "generate_chunk": event, "stream_state": state, "chat_request": chat,
            "prompt_token_ids": rendered["token_ids"],
        })
        state = res["stream_state"]
        choices += res["chunk"]["choices"]
    return choices


TEXT_CASES = [c for c in CASES if c.name in ("plain_answer", "cjk_and_emoji", "reasoning_then_answer")]


@pytest.mark.parametrize("case", TEXT_CASES, ids=[c.name for c in TEXT_CASES])
def test_text_parity(servers: Paced, case: ParserCase) -> None:
    label = next(s.label for s in case.setups)
    srv = servers.get(label)
    rendered = post(srv, "/v1/chat/completions/render", chat_body(label, case, servers.tokens_per_step))
    ids, sp = rendered["token_ids"], {**rendered["sampling_params"], "logprobs": 2}
    text = post(srv, "/inference/v1/generate", {"token_ids": ids, "output_mode": "text", "sampling_params": sp})
    tokens = post(srv, "/inference/v1/generate", {"token_ids": ids, "sampling_params": sp})
    derendered = post(srv, "/v1/completions/derender", {"generate_responses": [tokens], "prompt_token_ids": [ids]})
    coupled = post(srv, "/v1/completions", {"prompt": ids, "max_tokens": sp["max_tokens"], "logprobs": 2,
                                            "skip_special_tokens": sp.get("skip_special_tokens", True),
                                            "vllm_xargs": sp["extra_args"]})
    inline_text = text["choices"][0]["text"]
    assert inline_text == derendered["choices"][0]["text"] == coupled["choices"][0]["text"]
    want_text = TOK.decode(TOK.encode(case.parser_text), skip_special_tokens=sp.get("skip_special_tokens", True))
    assert inline_text == want_text
    tokens_view = [e["token"] for e in text["choices"][0]["logprobs"]["content"]]
    assert tokens_view == derendered["choices"][0]["logprobs"]["tokens"] == coupled["choices"][0]["logprobs"]["tokens"]
    # Streaming text == batch text.
    events, _ = stream_post(srv.url + "/inference/v1/generate",
                            {"token_ids": ids, "output_mode": "text", "stream": True, "sampling_params": sp})
    assert "".join(e["choices"][0]["text"] for e in events) == inline_text
    events, _ = stream_post(srv.url + "/inference/v1/generate", {
        "token_ids": ids, "output_mode": "text", "stream": True, "sampling_params": {**sp, "stream_interval": 3}})
    assert "".join(e["choices"][0]["text"] for e in events) == inline_text
    assert [c for e in events for c in e["choices"][0]["logprobs"]["content"]] == \
        text["choices"][0]["logprobs"]["content"]
    # Streaming completions derender of the tokens stream == batch text.
    events, _ = stream_post(srv.url + "/inference/v1/generate", {"token_ids": ids, "stream": True,
                                                                 "sampling_params": sp})
    state, pieces = None, []
    for event in events:
        res = post(srv, "/v1/completions/derender", {"stream": True, "generate_chunk": event, "stream_state": state,
                                                     "prompt_token_ids": ids})
        state = res["stream_state"]
        pieces += [c["text"] for c in res["chunk"]["choices"]]
    assert "".join(pieces) == inline_text


@pytest.mark.parametrize(
    ("stop", "content", "reasoning_cut"),
    [("= 391.", "\n\n17 * 23 ", False), (" so ", "", True)],
    ids=["in-content", "in-reasoning"],
)
def test_stop_string_parity(servers: Paced, stop: str, content: str, reasoning_cut: bool) -> None:
    case = next(c for c in CASES if c.name == "reasoning_then_answer")
    label = case.setups[0].label
    srv = servers.get(label)
    chat = chat_body(label, case, servers.tokens_per_step, stop=[stop])
    coupled = post(srv, "/v1/chat/completions", chat)["choices"][0]
    rendered = post(srv, "/v1/chat/completions/render", chat)
    inline = post(srv, "/inference/v1/generate", {**rendered, "output_mode": "derender"})["choices"][0]
    assert norm_message(inline["message"]) == norm_message(coupled["message"])
    assert inline["stop_reason"] == coupled["stop_reason"] == stop
    assert (inline["message"]["content"] or "") == content
    reasoning = inline["message"]["reasoning"]
    if reasoning_cut:
        assert reasoning == case.reasoning.split(stop)[0]
    else:
        assert reasoning == case.reasoning
    assert "</think>" not in (inline["message"]["content"] or "")
    # Streamed: no text past the stop, nothing of the reasoning lost.
    events, _ = stream_post(srv.url + "/inference/v1/generate", {**rendered, "output_mode": "derender",
                                                                 "stream": True})
    streamed = assemble([e["choices"][0]["delta"] for e in events])
    assert streamed["content"] == content and streamed["reasoning"] == reasoning
    # With chunks of 5 tokens the stop string is found later, and the answer is the same.
    events, _ = stream_post(srv.url + "/inference/v1/generate", {
        **rendered, "output_mode": "derender", "stream": True,
        "sampling_params": {**rendered["sampling_params"], "stream_interval": 5}})
    streamed = assemble([e["choices"][0]["delta"] for e in events])
    assert streamed["content"] == content and streamed["reasoning"] == reasoning
    assert events[-1]["choices"][0]["stop_reason"] == stop
    # Text level against /v1/completions and /derender (without the request: cut from stop_reason).
    sp = rendered["sampling_params"]
    text = post(srv, "/inference/v1/generate", {"token_ids": rendered["token_ids"], "output_mode": "text",
                                                "sampling_params": sp})["choices"][0]
    comp = post(srv, "/v1/completions", {"prompt": rendered["token_ids"], "stop": [stop], "max_tokens": sp["max_tokens"],
                                          "skip_special_tokens": False, "vllm_xargs": sp["extra_args"]})["choices"][0]
    assert text["text"] == comp["text"] and stop not in text["text"]
    tokens = post(srv, "/inference/v1/generate", {"token_ids": rendered["token_ids"], "sampling_params": sp})
    der = post(srv, "/v1/completions/derender", {"generate_responses": [tokens]})["choices"][0]
    assert der["text"].startswith(text["text"])
    # token_ids keep the id that completed the stop string: re-decoding brings it back.
    assert stop in TOK.decode(tokens["choices"][0]["token_ids"])


def test_n_parity(servers: Paced) -> None:
    case = next(c for c in CASES if c.name == "reasoning_then_two_tool_calls")
    label = case.setups[0].label
    srv = servers.get(label)
    chat = chat_body(label, case, servers.tokens_per_step, n=2)
    coupled = post(srv, "/v1/chat/completions", chat)["choices"]
    rendered = post(srv, "/v1/chat/completions/render", chat)
    inline = post(srv, "/inference/v1/generate", {**rendered, "output_mode": "derender"})["choices"]
    assert len(coupled) == len(inline) == 2
    for a, b in zip(coupled, inline, strict=True):
        assert norm_message(a["message"]) == norm_message(b["message"]) == expected(case)
    events, _ = stream_post(srv.url + "/inference/v1/generate", {**rendered, "output_mode": "derender",
                                                                 "stream": True})
    for i in range(2):
        deltas = [e["choices"][0]["delta"] for e in events if e["choices"][0]["index"] == i]
        assert assemble(deltas) == expected(case)


HELP = TOK.encode(" help")[0]
# How a response ends: the generate sampling_params (also sent to derender as the request), and
# what derender is given of the tokens response (a peer that reports no stop_reason; a "stop" finish
# on an ordinary id).
ENDINGS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "eos": ({}, {}),
    "stop_id": ({"stop_token_ids": [HELP]}, {}),
    "stop_id_unreported": ({"stop_token_ids": [HELP]}, {"stop_reason": None}),
    "stop_string": ({"stop": [" help"]}, {}),
    "stop_string_unreported": ({"stop": [" help"]}, {"stop_reason": None}),
    "length": ({"max_tokens": 4}, {}),
    "stop_without_stop_token": ({"max_tokens": 4}, {"finish_reason": "stop", "stop_reason": None}),
}


@pytest.mark.parametrize("label", ["-+-", "-+hermes"])
@pytest.mark.parametrize("ending", list(ENDINGS))
def test_derender_of_tokens_equals_generate_for_every_ending(servers: Paced, label: str, ending: str) -> None:
    """Derender of a tokens response == generate text/derender of the same ids, however it ended."""
    case = next(c for c in CASES if c.name == "plain_answer")
    srv = servers.get(label)
    params, rewrite = ENDINGS[ending]
    # Special tokens kept in the text, so a stop token whose text is not left out would show.
    chat = chat_body(label, case, servers.tokens_per_step, skip_special_tokens=False, logprobs=False,
                     top_logprobs=None, **params)
    rendered = post(srv, "/v1/chat/completions/render", chat)
    sp = {**rendered["sampling_params"], "skip_special_tokens": False, **params}
    ids = rendered["token_ids"]
    tokens = post(srv, "/inference/v1/generate", {**rendered, "sampling_params": sp, "return_token_ids": True})
    text = post(srv, "/inference/v1/generate", {"token_ids": ids, "output_mode": "text", "sampling_params": sp})
    inline = post(srv, "/inference/v1/generate", {**rendered, "sampling_params": sp, "output_mode": "derender"})
    peer_choice = {**tokens["choices"][0], **rewrite}
    peer = {**tokens, "choices": [peer_choice]}
    want_finish = peer_choice["finish_reason"]
    completion_request = {"prompt": ids, "skip_special_tokens": False, **params}
    derendered_text = post(srv, "/v1/completions/derender", {
        "generate_responses": [peer], "prompt_token_ids": [ids], "completion_request": completion_request,
    })["choices"][0]
    derendered_chat = post(srv, "/v1/chat/completions/derender", {
        "generate_response": peer, "chat_request": chat, "prompt_token_ids": ids,
    })["choices"][0]

    want = text["choices"][0]
    assert derendered_text["text"] == want["text"]
    assert norm_message(derendered_chat["message"]) == norm_message(inline["choices"][0]["message"])
    assert derendered_chat["message"]["content"] == want["text"]
    for choice in (derendered_text, derendered_chat):
        assert choice["stop_reason"] == want["stop_reason"]
        assert choice["finish_reason"] == want_finish
    if ending == "eos":
        assert tokens["choices"][0]["token_ids"][-1] == TOK.eos_token_id and "<|im_end|>" not in want["text"]
    if ending.startswith("stop_string"):
        assert want["stop_reason"] == " help"
    if ending.startswith("stop_id"):
        assert want["stop_reason"] == HELP
    # Streaming derender of the tokens stream (no stop strings there) ends where generate text ends.
    if "stop_string" not in ending and ending != "stop_without_stop_token":
        events, _ = stream_post(srv.url + "/inference/v1/generate", {"token_ids": ids, "stream": True,
                                                                     "sampling_params": sp})
        state, pieces = None, []
        for event in events:
            res = post(srv, "/v1/completions/derender", {"stream": True, "generate_chunk": event, "stream_state": state,
                                                         "prompt_token_ids": ids,
                                                         "completion_request": completion_request})
            state = res["stream_state"]
            pieces += [c["text"] for c in res["chunk"]["choices"]]
        assert "".join(pieces) == want["text"]
