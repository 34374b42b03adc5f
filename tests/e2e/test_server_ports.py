"""The e2e launcher (tests/serverproc.py) against a port another process took between the pick and the bind:
the server comes up on a fresh port, and a foreign server answering /health there is never taken for it."""

from __future__ import annotations

from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler

import httpx
import pytest

from tests.e2e.test_generate import SCRIPTS
from tests.loopback import LoopbackServer
from tests.serverproc import ServerProcess


class _AlwaysHealthy(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("x-impostor", "1")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def impostor() -> Iterator[int]:
    """A plain HTTP server on 127.0.0.1 that answers 200 to everything; yields its port."""
    server = LoopbackServer(_AlwaysHealthy)
    try:
        yield server.port
    finally:
        server.close()


def test_a_server_whose_port_was_taken_starts_on_another_and_is_itself(impostor: int) -> None:
    srv = ServerProcess("serve", "--engine", "scripted", "--tokenizer", "qwen3", "--script", str(SCRIPTS))
    # As if the impostor had taken the launcher's pick before the child bound it.
    srv.use_port(impostor)
    with srv:
        assert srv.port != impostor and srv.url == f"http://127.0.0.1:{srv.port}"
        r = httpx.get(srv.url + "/health", timeout=60)
        assert r.status_code == 200 and "x-impostor" not in r.headers
        assert r.headers["x-pdserve-pid"] == str(srv.pid)
