"""Several frontend processes against one engine-core process; the core dying is handled cleanly."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.test_generate import PROMPT, SCRIPTS
from tests.serverproc import ServerProcess
from tests.sse import stream_and_abort
from tests.waiting import wait_until


def health(srv: ServerProcess) -> httpx.Response:
    # A fresh connection each time, so SO_REUSEPORT can hand it to either frontend.
    with httpx.Client() as client:
        return client.get(srv.url + "/health", timeout=60)


def wait_for_both_frontends(srv: ServerProcess, status: int, what: str) -> None:
    """Poll /health on fresh connections until both frontend pids have answered with ``status``."""
    seen: set[str] = set()

    def both() -> bool:
        r = health(srv)
        if r.status_code == status:
            seen.add(r.headers["x-pdserve-pid"])
        return len(seen) == 2

    wait_until(both, lambda: f"{what} (seen {seen})")


@contextlib.contextmanager
def one_connection_per_frontend(srv: ServerProcess) -> Iterator[dict[str, httpx.Client]]:
    """An open keep-alive connection to each of the two frontend processes, by pid.

    SO_REUSEPORT hands each new connection to either process; a client keeps its connection,
    so what one client asks always reaches the same frontend.
    """
    connections: dict[str, httpx.Client] = {}

    def both_reached() -> bool:
        client = httpx.Client(timeout=60)
        pid = client.get(srv.url + "/health").headers["x-pdserve-pid"]
        if pid in connections:
            client.close()
        else:
            connections[pid] = client
        return len(connections) == 2

    try:
        wait_until(both_reached, lambda: f"new connections reached both frontends (seen {set(connections)})")
        yield connections
    finally:
        for client in connections.values():
            client.close()


@pytest.fixture()
def two_frontends():  # type: ignore[no-untyped-def]
    with ServerProcess("serve", "--engine", "scripted", "--tokenizer", "qwen3", "--script", str(SCRIPTS),
                       "--api-server-count", "2", "--step-ms", "20") as srv:
        yield srv


def test_both_frontends_answer_against_one_core(two_frontends) -> None:  # type: ignore[no-untyped-def]
    srv = two_frontends
    frontends: set[str] = set()
    cores: set[str] = set()

    def both_frontends_answered() -> bool:
        r = health(srv)
        assert r.status_code == 200
        frontends.add(r.headers["x-pdserve-pid"])
        cores.add(r.headers["x-pdserve-core-pid"])
        with httpx.Client(timeout=60) as client:
            g = client.post(srv.url + "/inference/v1/generate", json={
                "token_ids": PROMPT, "output_mode": "text", "sampling_params": {"max_tokens": 3}})
        assert g.status_code == 200 and g.json()["choices"][0]["text"]
        return len(frontends) == 2

    wait_until(both_frontends_answered, lambda: f"both frontend processes served requests (seen {frontends})")
    assert len(cores) == 1 and str(srv.proc.pid) not in frontends


def test_abort_through_the_other_frontend(two_frontends) -> None:  # type: ignore[no-untyped-def]
    srv = two_frontends
    rid = "cross-abort"
    body = {"token_ids": PROMPT, "output_mode": "text", "stream": True, "request_id": rid,
            "sampling_params": {"max_tokens": 5000, "ignore_eos": True}}
    with one_connection_per_frontend(srv) as connections:

        def abort_through_the_other_frontend() -> None:
            # The frontend holding the stream is the one running a request; abort through the other.
            idle = [c for c in connections.values() if srv.metric("pdserve_running_requests", via=c) == 0]
            assert len(idle) == 1, "exactly one frontend runs the stream"
            a = idle[0].post(srv.url + "/abort_requests", json={"request_ids": ["generate-tokens-" + rid]})
            assert a.status_code == 200

        events, done = stream_and_abort(srv.url + "/inference/v1/generate", body, 1, abort_through_the_other_frontend)
    assert done and events[-1]["choices"][0]["finish_reason"] == "abort"
    assert sum(len(ev["choices"][0]["token_ids"]) for ev in events) < 5000


def test_core_death_gives_clean_errors(two_frontends) -> None:  # type: ignore[no-untyped-def]
    srv = two_frontends
    core_pid = int(health(srv).headers["x-pdserve-core-pid"])
    # /health answers once the first frontend is up; the core must not die before the second has
    # connected to it (a frontend that cannot reach the core at start exits, and takes the server down).
    wait_for_both_frontends(srv, 200, "both frontends answer /health")
    body = {"token_ids": PROMPT, "output_mode": "text", "stream": True,
            "sampling_params": {"max_tokens": 5000, "ignore_eos": True}}
    events: list[str] = []
    streaming = threading.Event()

    def stream() -> None:
        with httpx.Client() as client, client.stream("POST", srv.url + "/inference/v1/generate", json=body,
                                                      timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    streaming.set()

    t = threading.Thread(target=stream)
    t.start()
    assert streaming.wait(60), "the request started streaming"
    os.kill(core_pid, signal.SIGKILL)
    t.join(60)
    assert not t.is_alive(), "the in-flight stream ended instead of hanging"
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][6:])
    assert "error" in error and "engine" in error["error"]["message"]
    wait_for_both_frontends(srv, 503, "both frontends report the dead engine")
    with httpx.Client() as client:
        r = client.post(srv.url + "/inference/v1/generate",
                        json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}}, timeout=60)
    assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
