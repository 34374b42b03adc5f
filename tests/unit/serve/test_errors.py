"""A server bug is a logged 500, never the client's 400 (import layering: tests/unit/test_layers.py)."""

from __future__ import annotations

import logging

import pytest
from fastapi.testclient import TestClient

from pdserve.output.request_state import ChoiceState
from pdserve.serve.app import create_app
from pdserve.serve.config import ServerConfig
from pdserve.text.tokenizer import Tokenizer

TOK = Tokenizer.load("qwen3")
STREAM_BODY = {"stream": True, "generate_chunk": {"request_id": "r", "choices": [{"index": 0, "token_ids": [9707]}]}}


def _client() -> TestClient:
    return TestClient(create_app(ServerConfig(engine=None), None, TOK), raise_server_exceptions=False)


def test_a_bug_while_derendering_is_a_logged_500(monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    def broken(self: ChoiceState, out: object) -> None:
        raise RuntimeError("a bug in the output layer")

    monkeypatch.setattr(ChoiceState, "add", broken)
    with caplog.at_level(logging.ERROR, logger="pdserve"):
        response = _client().post("/v1/chat/completions/derender", json=STREAM_BODY)
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "InternalServerError"
    assert any("/v1/chat/completions/derender" in r.getMessage() and "a bug" in r.getMessage()
               for r in caplog.records)


def test_a_bad_stream_state_stays_the_clients_400() -> None:
    body = {**STREAM_BODY, "stream_state": {"output_token_ids": [TOK.vocab_size + 5]}}
    response = _client().post("/v1/chat/completions/derender", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "stream_state.output_token_ids"
