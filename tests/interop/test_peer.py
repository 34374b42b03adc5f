"""pdserve and vLLM 0.32 as peers on one model dir: each one's render, generate and derender output is
accepted and reproduced by the other. Where vLLM 0.32 is wrong, the test pins pdserve's behaviour and
names the vLLM defect instead of copying it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from pdserve.conformance.checks_text import TOOLS
from pdserve.conformance.rules import RULES
from pdserve.text.tokenizer import Tokenizer
from tests.interop.peers import MODEL_NAME, PARSER_ARGS, VllmPeer, pdserve
from tests.serverproc import ServerProcess
from tests.sse import stream_post

CHATS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "Name three colours."}]},
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Capital of France?"},
        ]
    },
    {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS, "tool_choice": "auto"},
    {"messages": [{"role": "user", "content": "Think about it"}], "chat_template_kwargs": {"enable_thinking": False}},
]
# Answers the scripted pdserve replays as real tokens responses (it appends the EOS id, finish "stop").
SCRIPTS = [
    "<think>\nThe user wants colours.\n</think>\n\nRed, green and blue.",
    (
        "<think>\nA tool helps.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    ),
    "Plain answer without reasoning markup, ending here.",
    "<think>\nReasoning only, the answer was cut",
]
TOK = Tokenizer.load("qwen3")


@pytest.fixture(scope="module")
def pd(model_dir: Path) -> Iterator[ServerProcess]:
    with pdserve(model_dir, *PARSER_ARGS) as srv:
        yield srv


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    script = tmp_path_factory.mktemp("scripts") / "answers.jsonl"
    script.write_text("".join(json.dumps({"text": text}) + "\n" for text in SCRIPTS))
    with ServerProcess(
        "serve", "--engine", "scripted", "--script", str(script), "--served-model-name", MODEL_NAME, *PARSER_ARGS
    ) as srv:
        yield srv


def post(server: ServerProcess, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(server.url + path, json=body, timeout=120)
    assert r.status_code == 200, f"{path} on {server.url}: {r.status_code} {r.text[:500]}"
    return r.json()


def render(server: ServerProcess, chat: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return post(server, "/v1/chat/completions/render", {"model": MODEL_NAME, **chat, **extra})


# -- render ---------------------------------------------------------------------------------------------


def test_vllm_render_is_accepted_by_pdserve_generate(vllm: VllmPeer, pd: ServerProcess) -> None:
    for chat in CHATS:
        rendered = render(vllm, chat, max_tokens=8, temperature=0)
        answer = post(pd, "/inference/v1/generate", rendered)
        assert answer["output_mode"] == "tokens" and len(answer["choices"][0]["token_ids"]) == 8


# SamplingParams defaults: vLLM 0.32's render writes the penalties at their defaults, pdserve omits them.
SAMPLING_DEFAULTS = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}


def test_pdserve_render_equals_vllm_render(vllm: VllmPeer, pd: ServerProcess) -> None:
    for chat in CHATS:
        ours, theirs = render(pd, chat, max_tokens=8, temperature=0), render(vllm, chat, max_tokens=8, temperature=0)
        assert ours["token_ids"] == theirs["token_ids"], chat
        # Every key vLLM 0.32 writes, in its order; pdserve adds 0.33's parse_context.
        assert [k for k in ours if k != "parse_context"] == list(theirs)
        assert "parse_context" in ours
        assert SAMPLING_DEFAULTS | ours["sampling_params"] == SAMPLING_DEFAULTS | theirs["sampling_params"], chat
        for key in ("model", "output_mode", "stream", "token_offsets", "features", "content_parts", "priority"):
            assert ours[key] == theirs[key], key
        assert ours["request_id"].startswith("chatcmpl-") and theirs["request_id"].startswith("chatcmpl-")


def test_render_keeps_max_tokens_at_vllms_default(vllm: VllmPeer, pd: ServerProcess) -> None:
    # vLLM 0.32 defect: its render serializes SamplingParams without defaults, so max_tokens=16 is dropped
    # and its own generate then runs to the end of the model length. pdserve's render keeps it.
    chat = CHATS[0]
    assert "max_tokens" not in render(vllm, chat, max_tokens=16)["sampling_params"]
    assert render(pd, chat, max_tokens=16)["sampling_params"]["max_tokens"] == 16


# -- generate -------------------------------------------------------------------------------------------


def test_greedy_tokens_and_text_are_equal(vllm: VllmPeer, pd: ServerProcess) -> None:
    for chat in CHATS:
        body = render(pd, chat, max_tokens=24, temperature=0)
        for mode in ("tokens", "text"):
            ours = post(pd, "/inference/v1/generate", {**body, "output_mode": mode})["choices"][0]
            theirs = post(vllm, "/inference/v1/generate", {**body, "output_mode": mode})["choices"][0]
            assert ours["token_ids"] == theirs["token_ids"], (chat, mode)
            assert (ours["finish_reason"], ours["stop_reason"]) == (theirs["finish_reason"], theirs["stop_reason"])
            if mode == "text":
                assert ours["text"] == theirs["text"]


def test_stream_interval_chunks_like_vllm(vllm: VllmPeer, pd: ServerProcess) -> None:
    # Same greedy tokens, same chunking: the first token alone, then chunks of the interval, the rest last.
    body = render(pd, CHATS[0], max_tokens=23, temperature=0)
    body = {**body, "stream": True, "sampling_params": {**body["sampling_params"], "stream_interval": 4}}
    chunks = {}
    for name, server in (("pdserve", pd), ("vllm", vllm)):
        events, done = stream_post(server.url + "/inference/v1/generate", body)
        assert done, name
        chunks[name] = [e["choices"][0]["token_ids"] for e in events]
    assert chunks["pdserve"] == chunks["vllm"]
    assert [len(c) for c in chunks["pdserve"]] == [1, 4, 4, 4, 4, 4, 2]


# -- derender, both ways --------------------------------------------------------------------------------


def message_of(choice: dict[str, Any]) -> tuple[str, str, list[tuple[str, Any]]]:
    message = choice["message"]
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or []]
    return message.get("content") or "", message.get("reasoning") or "", calls


def derender(server: ServerProcess, response: dict[str, Any], chat: dict[str, Any]) -> dict[str, Any]:
    body = {"generate_response": response, "chat_request": {"model": MODEL_NAME, **chat}}
    return post(server, "/v1/chat/completions/derender", body)["choices"][0]


def assert_same_derender(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    assert message_of(ours) == message_of(theirs)
    assert ours["stop_reason"] == theirs["stop_reason"]
    if message_of(ours)[2]:
        # vLLM 0.32/0.33 defect: batch derender reports finish_reason "stop" although it parsed a tool call
        # (its coupled chat endpoint says "tool_calls"). pdserve says "tool_calls" on every surface.
        assert (ours["finish_reason"], theirs["finish_reason"]) == ("tool_calls", "stop")
    else:
        assert ours["finish_reason"] == theirs["finish_reason"]


def test_pdserve_tokens_responses_derender_the_same_on_vllm(
    vllm: VllmPeer, pd: ServerProcess, scripted: ServerProcess
) -> None:
    chat = {"messages": CHATS[2]["messages"], "tools": TOOLS, "tool_choice": "auto"}
    prompt = render(pd, chat)["token_ids"]
    for index, text in enumerate(SCRIPTS):
        response = post(
            scripted,
            "/inference/v1/generate",
            {
                "model": MODEL_NAME,
                "token_ids": prompt,
                "sampling_params": {"max_tokens": 200, "extra_args": {"script_index": index}},
            },
        )
        ids = response["choices"][0]["token_ids"]
        assert ids == TOK.encode(text) + [TOK.eos_token_id], "the scripted answer ends with its EOS"
        ours, theirs = derender(pd, response, chat), derender(vllm, response, chat)
        assert_same_derender(ours, theirs)
        # The EOS id's text is never part of the message (the stop rule), on either side.
        assert "<|im_end|>" not in json.dumps(ours["message"])


def generate(server: ServerProcess, base: dict[str, Any], mode: str = "tokens", **sampling: Any) -> dict[str, Any]:
    body = {**base, "output_mode": mode, "sampling_params": {**base["sampling_params"], **sampling}}
    return post(server, "/inference/v1/generate", body)


def test_vllm_tokens_responses_derender_the_same_on_pdserve(vllm: VllmPeer, pd: ServerProcess) -> None:
    base = render(pd, CHATS[0], max_tokens=12, temperature=0)
    for sampling in ({}, {"ignore_eos": True}, {"max_tokens": 3}):
        response = generate(vllm, base, **sampling)
        assert_same_derender(derender(pd, response, CHATS[0]), derender(vllm, response, CHATS[0]))


def folded(choice: dict[str, Any]) -> str:
    content, reasoning, _ = message_of(choice)
    return reasoning + content


def test_stop_handling_of_vllm_responses_follows_vllm_033(vllm: VllmPeer, pd: ServerProcess) -> None:
    """A vLLM response that stopped on a stop id or a stop string derenders on pdserve to exactly the text
    vLLM's own engine produced for it (its ``text`` mode). vLLM 0.32 defect (fixed in 0.33, whose rule
    pdserve follows): its derender neither leaves out the stop token's text nor cuts the stop string."""
    base = render(pd, CHATS[0], max_tokens=12, temperature=0)
    greedy = generate(vllm, base)["choices"][0]["token_ids"]
    stop_id = greedy[2]
    stop_text = TOK.decode(greedy[:6])[-3:]
    for sampling in ({"stop_token_ids": [stop_id]}, {"stop": [stop_text]}):
        response = generate(vllm, base, **sampling)
        engine_text = generate(vllm, base, "text", **sampling)["choices"][0]
        stop_reason = response["choices"][0]["stop_reason"]
        assert (
            stop_reason == engine_text["stop_reason"] == sampling.get("stop_token_ids", sampling.get("stop", [None]))[0]
        )
        chat = {**CHATS[0], **sampling}
        ours, theirs = derender(pd, response, chat), derender(vllm, response, chat)
        assert folded(ours) == engine_text["text"], sampling
        assert (ours["finish_reason"], ours["stop_reason"]) == ("stop", stop_reason)
        full = TOK.decode(response["choices"][0]["token_ids"])
        assert folded(theirs) == full and len(full) > len(engine_text["text"]), "the vLLM 0.32 defect is still there"


# -- the conformance kit, recorded in docs/compatibility.md ---------------------------------------------

COMPATIBILITY = Path(__file__).resolve().parents[2] / "docs" / "compatibility.md"
KIT_LINE = re.compile(r"^(pass|FAIL|unsupported|n/a)\s+(\S+)\s", re.MULTILINE)
TABLE_ROW = re.compile(r"^\| `([\w.]+)` \| [^|]* \| (\S+) \| (\S+) \|", re.MULTILINE)


def kit(server: ServerProcess) -> dict[str, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "conformance", server.url, "--parsers", "qwen3", "hermes"],
        check=False,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    return {rule: status for status, rule in KIT_LINE.findall(proc.stdout)}


def test_compatibility_table_is_what_the_kit_finds(vllm: VllmPeer, pd: ServerProcess) -> None:
    table = {rule: (ours, theirs) for rule, ours, theirs in TABLE_ROW.findall(COMPATIBILITY.read_text())}
    assert set(table) == {r.id for r in RULES}, "docs/compatibility.md lists other rules than the kit runs"
    found_pd, found_vllm = kit(pd), kit(vllm)
    for column, found in ((0, found_pd), (1, found_vllm)):
        expected = {rule: s[column] for rule, s in table.items()}
        # A `flaky` cell: the server's answer varies from run to run (the table's note says how often).
        flaky = {rule for rule, status in expected.items() if status == "flaky"}
        assert all(found[rule] in ("pass", "FAIL") for rule in flaky), {r: found[r] for r in flaky}
        assert {r: s for r, s in expected.items() if r not in flaky} == {r: s for r, s in found.items() if r not in flaky}


# -- bench ----------------------------------------------------------------------------------------------


def test_bench_serve_measures_the_modes_vllm_serves_and_skips_the_others(
    vllm: VllmPeer, pd: ServerProcess, tmp_path: Path
) -> None:
    """vLLM 0.32's generate serves ``tokens`` and ``text``, not ``derender``: that arm is skipped, with why."""
    result_file = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "pdserve.cli", "bench", "serve", "--base-url", pd.url, "--base-url", vllm.url,
           "--output-mode", "tokens,text,derender", "--num-prompts", "2", "--random-input-len", "8",
           "--random-output-len", "4", "--idle-window-s", "0.1", "--no-server-cpu",
           "--result-filename", str(result_file), "--disable-tqdm"]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(result_file.read_text())
    pd_at, vllm_at = (urlsplit(u).netloc for u in (pd.url, vllm.url))
    assert sorted(c["label"] for c in result["cells"]) == sorted(
        [f"{mode} @ {pd_at}" for mode in ("tokens", "text", "derender")] + [f"tokens @ {vllm_at}", f"text @ {vllm_at}"])
    assert all(c["completed"] == 2 for c in result["cells"])
    [skipped] = result["skipped_arms"]
    assert skipped["label"] == f"derender @ {vllm_at}"
    assert re.search(r"answered 4\d\d to output_mode='derender'", skipped["reason"]), skipped["reason"]
