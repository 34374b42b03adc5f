"""Several frontend processes against one engine-core process; the core dying is handled cleanly."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.e2e.test_generate import PROMPT, SCRIPTS
from tests.serverproc import ServerProcess


def health(srv: ServerProcess) -> httpx.Response:
    # A fresh connection each time, so SO_REUSEPORT can hand it to either frontend.
    with httpx.Client() as client:
        return client.get(srv.url + "/health", timeout=5)


@pytest.fixture()
def two_frontends():  # type: ignore[no-untyped-def]
    with ServerProcess("serve", "--engine", "scripted", "--tokenizer", "qwen3", "--script", str(SCRIPTS),
                       "--api-server-count", "2", "--step-ms", "20") as srv:
        yield srv


def test_both_frontends_answer_against_one_core(two_frontends) -> None:  # type: ignore[no-untyped-def]
    srv = two_frontends
    frontends: set[str] = set()
    cores: set[str] = set()
    deadline = time.monotonic() + 30
    while len(frontends) < 2 and time.monotonic() < deadline:
        r = health(srv)
        assert r.status_code == 200
        frontends.add(r.headers["x-pdserve-pid"])
        cores.add(r.headers["x-pdserve-core-pid"])
        with httpx.Client() as client:
            g = client.post(srv.url + "/inference/v1/generate", json={
                "token_ids": PROMPT, "output_mode": "text", "sampling_params": {"max_tokens": 3}})
        assert g.status_code == 200 and g.json()["choices"][0]["text"]
    assert len(frontends) == 2, "both frontend processes served requests"
    assert len(cores) == 1 and str(srv.proc.pid) not in frontends


def test_abort_through_the_other_frontend(two_frontends) -> None:  # type: ignore[no-untyped-def]
    srv = two_frontends
    rid = "cross-abort"
    body = {"token_ids": PROMPT, "output_mode": "text", "stream": True, "request_id": rid,
            "sampling_params": {"max_tokens": 5000, "ignore_eos": True}}
    finals: list[dict] = []
    with httpx.Client() as client, client.stream("POST", srv.url + "/inference/v1/generate", json=body,
                                                  timeout=30) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        # Abort from fresh connections: whichever frontend gets it, the core aborts the request.
        for _ in range(4):
            with httpx.Client() as other:
                assert other.post(srv.url + "/abort_requests",
                                  json={"request_ids": ["generate-tokens-" + rid]}).status_code == 200
        for line in lines:
            if line.startswith("data: {"):
                finals.append(json.loads(line[6:]))
    assert finals and finals[-1]["choices"][0]["finish_reason"] == "abort"


def test_core_death_gives_clean_errors(two_frontends) -> None:  # type: ignore[no-untyped-def]
    srv = two_frontends
    core_pid = int(health(srv).headers["x-pdserve-core-pid"])
    body = {"token_ids": PROMPT, "output_mode": "text", "stream": True,
            "sampling_params": {"max_tokens": 5000, "ignore_eos": True}}
    events: list[str] = []

    def stream() -> None:
        with httpx.Client() as client, client.stream("POST", srv.url + "/inference/v1/generate", json=body,
                                                      timeout=30) as r:
            events.extend(line for line in r.iter_lines() if line.startswith("data: "))

    t = threading.Thread(target=stream)
    t.start()
    time.sleep(0.5)
    os.kill(core_pid, signal.SIGKILL)
    t.join(20)
    assert not t.is_alive(), "the in-flight stream ended instead of hanging"
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][6:])
    assert "error" in error and "engine" in error["error"]["message"]
    deadline = time.monotonic() + 15
    seen_unhealthy: set[str] = set()
    while len(seen_unhealthy) < 2 and time.monotonic() < deadline:
        r = health(srv)
        if r.status_code == 503:
            seen_unhealthy.add(r.headers["x-pdserve-pid"])
        time.sleep(0.1)
    assert len(seen_unhealthy) == 2, "both frontends report the dead engine"
    with httpx.Client() as client:
        r = client.post(srv.url + "/inference/v1/generate",
                        json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}}, timeout=10)
    assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
