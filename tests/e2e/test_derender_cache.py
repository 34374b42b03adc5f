"""Streaming /derender continues cached parser/detokenizer states, on real servers.

* A tier client that follows a generate stream chunk by chunk continues a cached state on every chunk
  after the first (``pdserve_derender_cache_hits``), and the answer is byte for byte what a replay of
  the same request gives (the same request sent again finds no state: the first took it).
* A request id sent again with another prompt, or with other earlier output (two RL rollouts),
  misses and gets its own answer; the stream whose state it matched by name keeps it.
* At most ``--derender-cache-entries`` states are kept (least recently used out first), each for
  ``--derender-cache-ttl`` after its last chunk.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.text.tokenizer import Tokenizer
from tests.fixtures.parser_cases import CASES_BY_NAME
from tests.serverproc import ServerProcess
from tests.sse import stream_post
from tests.unit.parsers.parser_support import TOOL_CALL_ID
from tests.waiting import wait_metric

TOK = Tokenizer.load("qwen3")
PARSERS = ("--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--enable-auto-tool-choice")
TOOL_CASE = CASES_BY_NAME["reasoning_then_two_tool_calls"]
CHAT_PATH, COMPLETION_PATH = "/v1/chat/completions/derender", "/v1/completions/derender"
ENTRIES = 2
HITS, MISSES = "pdserve_derender_cache_hits_total", "pdserve_derender_cache_misses_total"
EVICTIONS, SIZE = "pdserve_derender_cache_evictions_total", "pdserve_derender_cache_entries"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Scripted engine (the tool case's output, two tokens a step) with parsers and a cache of 2 states."""
    script = Path(tmp_path_factory.mktemp("dc")) / "s.jsonl"
    script.write_text(json.dumps({"text": TOOL_CASE.output}) + "\n")
    with ServerProcess("serve", "--engine", "scripted", "--tokenizer", "qwen3", "--script", str(script),
                       "--tokens-per-step", "2", *PARSERS, "--derender-cache-entries", str(ENTRIES)) as srv:
        yield srv


@pytest.fixture(scope="module")
def short_lived() -> Iterator[ServerProcess]:
    """A render server whose cached states live 0.2 s."""
    with ServerProcess("launch", "render", "--tokenizer", "qwen3", "--derender-cache-ttl", "0.2") as srv:
        yield srv


def counts(srv: ServerProcess) -> dict[str, float]:
    return {name: srv.metric(name) for name in (HITS, MISSES, EVICTIONS, SIZE)}


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    """One connection for the many small calls of a tier client."""
    with httpx.Client(timeout=60) as c:
        yield c


def derender_call(client: httpx.Client, srv: ServerProcess, path: str, body: dict[str, Any]) -> bytes:
    r = client.post(srv.url + path, json=body)
    assert r.status_code == 200, r.text
    return r.content


def comparable(raw: bytes) -> str:
    """A response with what differs between two answers to one request by design: the creation time and
    the made-up id of a tool call that starts in this chunk."""
    return TOOL_CALL_ID.sub("ID", re.sub(r'"created":\d+', "", raw.decode()))


def chunk(request_id: str, ids: list[int], finish: str | None = None) -> dict[str, Any]:
    return {"request_id": request_id, "choices": [{"index": 0, "token_ids": ids, "finish_reason": finish}]}


def test_a_stream_followed_in_order_continues_cached_states(server: ServerProcess, client: httpx.Client) -> None:
    chat = dict(TOOL_CASE.request, vllm_xargs={"script_index": 0})
    rendered = httpx.post(server.url + "/v1/chat/completions/render", json=chat, timeout=60).json()
    events, done = stream_post(server.url + "/inference/v1/generate", {**rendered, "stream": True})
    assert done
    chunks = [e for e in events if e["choices"]]
    assert len(chunks) > 10 and all(len(c["choices"][0]["token_ids"]) <= 2 for c in chunks)
    before = counts(server)
    state: dict[str, Any] | None = None
    reasoning, names, args, finish = "", {}, {}, None
    for gchunk in chunks:
        body = {"stream": True, "generate_chunk": gchunk, "stream_state": state,
                "prompt_token_ids": rendered["token_ids"], "chat_request": chat}
        first = derender_call(client, server, CHAT_PATH, body)
        again = derender_call(client, server, CHAT_PATH, body)  # its state was taken by the first: a replay
        assert comparable(again) == comparable(first)
        answer = json.loads(first)
        state = answer["stream_state"]
        choice = answer["chunk"]["choices"][0]
        reasoning += choice["delta"].get("reasoning") or ""
        for call in choice["delta"].get("tool_calls") or []:
            names[call["index"]] = call["function"].get("name") or names.get(call["index"])
            args[call["index"]] = args.get(call["index"], "") + (call["function"].get("arguments") or "")
        finish = choice["finish_reason"] or finish
    assert reasoning == TOOL_CASE.reasoning and finish == "tool_calls"
    assert [(names[i], json.loads(args[i])) for i in sorted(names)] == [(c.name, c.arguments) for c in TOOL_CASE.tool_calls]
    after = counts(server)
    assert after[HITS] - before[HITS] == len(chunks) - 1
    assert after[MISSES] - before[MISSES] == len(chunks) - 1
    assert after[SIZE] == 0  # the last chunk finished the choice: nothing to continue


REQUEST = {"messages": [{"role": "user", "content": "What is the answer?"}]}
OTHER_PROMPT_REQUEST = {"messages": [{"role": "user", "content": "What is the question?"}]}
ROLLOUT = TOK.encode("<think>\nFirst I think about it.\n</think>\n\nThe answer is forty-two, and that is all.")


def prompt_of(request: dict[str, Any]) -> list[int]:
    return TOK.encode(TOK.apply_chat_template(request["messages"], add_generation_prompt=True))


def test_a_resent_request_id_with_another_prompt_or_output_misses_and_gets_its_own_answer(
    server: ServerProcess, client: httpx.Client
) -> None:
    prompt = prompt_of(REQUEST)
    pieces = [ROLLOUT[k : k + 4] for k in range(0, len(ROLLOUT), 4)]

    def send(state: dict[str, Any] | None, ids: list[int], prompt_ids: list[int]) -> dict[str, Any]:
        body = {"stream": True, "generate_chunk": chunk("rl-rollout", ids), "stream_state": state,
                "prompt_token_ids": prompt_ids, "chat_request": REQUEST}
        return json.loads(derender_call(client, server, CHAT_PATH, body))

    state = None
    for ids in pieces[:-3]:
        state = send(state, ids, prompt)["stream_state"]
    assert state is not None and state["output_token_ids"] == ROLLOUT[: 4 * (len(pieces) - 3)]
    nxt = pieces[-3]
    base = counts(server)

    # The same request id and output after another prompt: a miss, answered for that prompt's stream.
    other = send(state, nxt, prompt_of(OTHER_PROMPT_REQUEST))
    assert other["chunk"]["choices"][0]["delta"]["content"] == TOK.decode(nxt)
    # The first rollout's state was left in place: its own next chunk continues it.
    state = send(state, nxt, prompt)["stream_state"]
    nxt = pieces[-2]
    # Another rollout of the same request id: same prompt, as many ids, the same last ones, one earlier
    # id different ("First" -> "Then"): a miss, and its own answer.
    first, then = TOK.encode("First"), TOK.encode("Then")
    assert len(first) == len(then) == 1 and ROLLOUT.count(first[0]) == 1
    rollout = [then[0] if t == first[0] else t for t in state["output_token_ids"]]
    reply = send({**state, "output_token_ids": rollout}, nxt, prompt)
    assert reply["chunk"]["choices"][0]["delta"]["content"] == TOK.decode(nxt)
    assert reply["stream_state"]["output_token_ids"] == rollout + nxt
    send(state, nxt, prompt)  # the first rollout goes on from its own state
    now = counts(server)
    assert (now[HITS] - base[HITS], now[MISSES] - base[MISSES]) == (2, 2)


def test_at_most_the_configured_number_of_states_is_kept(server: ServerProcess, client: httpx.Client) -> None:
    ids = TOK.encode("One two three four five six")
    states = {}
    base = counts(server)
    for rid in ("bound-a", "bound-b", "bound-c"):  # a is the least recently used when c comes
        body = {"stream": True, "generate_chunk": chunk(rid, ids[:3]), "prompt_token_ids": [1, 2]}
        states[rid] = json.loads(derender_call(client, server, COMPLETION_PATH, body))["stream_state"]
    assert server.metric(SIZE) == ENTRIES
    assert server.metric(EVICTIONS) - base[EVICTIONS] >= 1
    texts = {}
    for rid in ("bound-a", "bound-c"):
        body = {"stream": True, "generate_chunk": chunk(rid, ids[3:], "length"), "stream_state": states[rid],
                "prompt_token_ids": [1, 2]}
        texts[rid] = json.loads(derender_call(client, server, COMPLETION_PATH, body))["chunk"]["choices"][0]["text"]
    assert texts == {"bound-a": TOK.decode(ids[3:]), "bound-c": TOK.decode(ids[3:])}
    now = counts(server)
    assert (now[HITS] - base[HITS], now[MISSES] - base[MISSES]) == (1, 1)  # c continued; a had been evicted


def test_a_state_expires_ttl_after_its_last_chunk(short_lived: ServerProcess, client: httpx.Client) -> None:
    ids = TOK.encode("Expiring states are replayed")
    body = {"stream": True, "generate_chunk": chunk("ttl", ids[:2]), "prompt_token_ids": [1, 2]}
    state = json.loads(derender_call(client, short_lived, COMPLETION_PATH, body))["stream_state"]
    wait_metric(short_lived, SIZE, 0)  # /metrics drops expired states
    assert short_lived.metric(EVICTIONS) == 1
    body = {"stream": True, "generate_chunk": chunk("ttl", ids[2:], "length"), "stream_state": state,
            "prompt_token_ids": [1, 2]}
    text = json.loads(derender_call(client, short_lived, COMPLETION_PATH, body))["chunk"]["choices"][0]["text"]
    assert text == TOK.decode(ids[2:])
    assert (short_lived.metric(HITS), short_lived.metric(MISSES)) == (0, 1)
