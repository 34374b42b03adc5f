"""The preflight of ``bench serve``: an arm whose output mode a server does not serve is dropped, with why.

The servers here are stand-ins (``httpx.MockTransport``) answering the three ways a real one does:
pdserve (and vLLM 0.32 for ``text``) echoes the mode, a generate server older than vLLM 0.32
ignores the unknown field and answers ``tokens``, a ``--tokens-only`` pdserve refuses with a 400. The e2e and interop tests run the same against real servers.
"""

from __future__ import annotations

import json

import httpx
import pytest

from pdserve.bench.loadgen import Arm, Prompt
from pdserve.bench.preflight import mode_refusal, servable_arms

PROMPT = Prompt(chat={"messages": []}, rendered={"token_ids": [1, 2], "sampling_params": {"temperature": 0}},
                max_tokens=256, ignore_eos=True)
ECHOES, IGNORES, REFUSES = "http://echoes", "http://ignores", "http://refuses"


def _answer(request: httpx.Request) -> httpx.Response:
    body = json.loads(request.content)
    assert request.url.path == "/inference/v1/generate"
    assert body["sampling_params"]["max_tokens"] == 1 and "ignore_eos" not in body["sampling_params"]
    assert "stream" not in body  # a batch request: the echo is in the body
    host = f"http://{request.url.host}"
    if host == REFUSES and body["output_mode"] != "tokens":
        return httpx.Response(400, json={"error": {"message": "output_mode needs a tokenizer (--tokens-only)"}})
    choice = {"index": 0, "token_ids": [7], "finish_reason": "length"}
    if host == IGNORES:
        return httpx.Response(200, json={"request_id": "x", "choices": [choice]})
    return httpx.Response(200, json={"request_id": "x", "output_mode": body["output_mode"], "choices": [choice]})


@pytest.fixture
def client() -> httpx.Client:
    return httpx.Client(transport=httpx.MockTransport(_answer))


@pytest.mark.parametrize(("url", "mode", "expected"), [
    (ECHOES, "text", None),
    (ECHOES, "derender", None),
    (IGNORES, "text", "ignores output_mode='text': it answered a 'tokens' response"),
    (REFUSES, "derender", "answered 400 to output_mode='derender': "),
])
def test_a_mode_is_served_only_when_the_answer_echoes_it(client: httpx.Client, url: str, mode: str,
                                                         expected: str | None) -> None:
    refusal = mode_refusal(client, url, PROMPT, mode)
    if expected is None:
        assert refusal is None
    else:
        assert refusal is not None and expected in refusal and url in refusal


def test_a_body_that_is_not_an_object_is_a_refusal() -> None:
    odd = httpx.Client(transport=httpx.MockTransport(lambda r: httpx.Response(200, content=b"[1, 2]")))
    refusal = mode_refusal(odd, ECHOES, PROMPT, "text")
    assert refusal is not None and "not a JSON object" in refusal


def test_only_the_arms_a_server_does_not_serve_are_dropped() -> None:
    seen: list[str] = []

    def counting(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.url.host} {json.loads(request.content)['output_mode']}")
        return _answer(request)

    arms = [Arm(f"{m} @ {u}", u, modes=(m,)) for u in (ECHOES, IGNORES, REFUSES) for m in ("tokens", "text")]
    arms += [Arm(f"mix @ {IGNORES}", IGNORES, modes=("tokens", "derender")),
             Arm(f"chat @ {REFUSES}", REFUSES, endpoint="chat"),
             Arm(f"tier @ {IGNORES}", IGNORES, endpoint="tier")]
    kept, skipped = servable_arms(arms, PROMPT, httpx.Client(transport=httpx.MockTransport(counting)))
    assert [a.label for a in kept] == [f"tokens @ {ECHOES}", f"text @ {ECHOES}", f"tokens @ {IGNORES}",
                                       f"tokens @ {REFUSES}", f"chat @ {REFUSES}", f"tier @ {IGNORES}"]
    assert {s.label: s.reason.split(": ")[0] for s in skipped} == {
        f"text @ {IGNORES}": f"{IGNORES}/inference/v1/generate ignores output_mode='text'",
        f"text @ {REFUSES}": f"{REFUSES}/inference/v1/generate answered 400 to output_mode='text'",
        f"mix @ {IGNORES}": f"{IGNORES}/inference/v1/generate ignores output_mode='derender'",
    }
    # One probe per server and non-default mode; tokens, chat and the tier are never probed.
    assert sorted(seen) == ["echoes text", "ignores derender", "ignores text", "refuses text"]
