"""``pdserve conformance URL`` against real servers: every rule passes against pdserve (the scripted
engine with parsers, and qwen3-tiny on the torch engine), and the kit fails, naming the rule, against a
server that breaks one rule (a proxy in front of pdserve that drops the streams' ``data: [DONE]``)."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from pdserve.conformance.rules import RULES
from tests.serverproc import ServerProcess
from tests.waiting import wait_until

PARSERS = ("qwen3", "hermes")
# One script: the scripted engine replays it for every request, so the server is deterministic, as
# the kit needs (it compares greedy answers across requests and surfaces).
SCRIPT = '{"text": "Red, green and blue are three colours; yellow and violet are two more of the rainbow."}\n'
LINE = re.compile(r"^(pass|FAIL|unsupported|n/a)\s+(\S+)\s", re.MULTILINE)


def conformance(url: str, *args: str) -> tuple[int, dict[str, str], str]:
    """Run the command; its exit code, ``{rule id: status}`` and its output."""
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "conformance", url, *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return proc.returncode, {rule: status for status, rule in LINE.findall(proc.stdout)}, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    script = tmp_path_factory.mktemp("conformance") / "script.jsonl"
    script.write_text(SCRIPT)
    with ServerProcess(
        "serve",
        "--engine",
        "scripted",
        "--script",
        str(script),
        "--reasoning-parser",
        PARSERS[0],
        "--tool-call-parser",
        PARSERS[1],
        "--enable-auto-tool-choice",
        api_key="conformance-key",
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, str]]:
    return {}


def test_scripted_server_with_parsers_conforms(scripted: ServerProcess, results: dict) -> None:
    code, statuses, output = conformance(scripted.url, "--parsers", *PARSERS, "--api-key", "conformance-key")
    assert code == 0, output
    assert set(statuses) == {r.id for r in RULES}, output
    assert set(statuses.values()) <= {"pass", "n/a"}, output
    results["scripted"] = statuses


@pytest.mark.slow
def test_qwen3_tiny_torch_server_conforms(results: dict) -> None:
    with ServerProcess("serve", "qwen3-tiny", "--max-model-len", "1024") as srv:
        code, statuses, output = conformance(srv.url)
    assert code == 0, output
    assert set(statuses) == {r.id for r in RULES}, output
    assert set(statuses.values()) <= {"pass", "n/a"}, output
    results["torch"] = statuses


def test_every_rule_passed_somewhere(results: dict) -> None:
    if len(results) < 2:
        pytest.skip("needs both conforming runs above")
    never = [r.id for r in RULES if all(statuses[r.id] != "pass" for statuses in results.values())]
    assert not never, f"rules that passed on no server: {never}"


def without_done(upstream: str) -> FastAPI:
    """A proxy to ``upstream`` that passes everything on but the SSE ``data: [DONE]`` line."""
    app = FastAPI()
    client = httpx.AsyncClient(base_url=upstream, timeout=60)

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(path: str, request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "authorization")}
        upstream_request = client.build_request(
            request.method, "/" + path, content=await request.body(), headers=headers
        )
        r = await client.send(upstream_request, stream=True)
        if not r.headers.get("content-type", "").startswith("text/event-stream"):
            body = await r.aread()
            await r.aclose()
            return Response(body, status_code=r.status_code, media_type=r.headers.get("content-type"))

        async def events() -> Iterator[bytes]:
            async for line in r.aiter_lines():
                if line != "data: [DONE]":
                    yield (line + "\n").encode()
            await r.aclose()

        return StreamingResponse(events(), status_code=r.status_code, media_type="text/event-stream")

    return app


def test_kit_fails_a_server_that_drops_done(scripted: ServerProcess, tmp_path: Path) -> None:
    config = uvicorn.Config(without_done(scripted.url), host="127.0.0.1", port=0, log_level="warning")
    proxy = uvicorn.Server(config)
    thread = threading.Thread(target=proxy.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: proxy.started, "the [DONE]-dropping proxy listens")
        port = proxy.servers[0].sockets[0].getsockname()[1]
        code, statuses, output = conformance(
            f"http://127.0.0.1:{port}",
            "--parsers",
            *PARSERS,
            "--api-key",
            "conformance-key",
            "--rule",
            "stream.end",
            "--rule",
            "mode.tokens",
            "--rule",
            "abort.stream",
        )
    finally:
        proxy.should_exit = True
        thread.join(timeout=30)
    assert code == 1, output
    assert statuses == {"stream.end": "FAIL", "mode.tokens": "pass", "abort.stream": "FAIL"}, output
    assert "no data: [DONE]" in output
