"""Schema-driven fuzzing: cases generated from the server's own /openapi.json never get a 5xx.

Schemathesis builds bodies from the published request schemas (valid ones, and ones that break them)
for every operation; the server must answer each with a non-5xx status and stay healthy. The server is
the scripted engine with parsers, so valid requests run end to end quickly.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.schemas import APIOperation

from tests.e2e.test_generate import SCRIPTS
from tests.serverproc import ServerProcess

MIN_CASES = 1000
# Operations with a body get the cases; a body-less GET has few distinct cases to give.
CASES_PER_BODY_OPERATION = 120


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(
        "serve", "--engine", "scripted", "--tokenizer", "qwen3", "--script", str(SCRIPTS), "--max-model-len", "2048",
        "--max-num-seqs", "4", "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes",
        "--enable-auto-tool-choice",
    ) as srv:
        yield srv


def fuzz(op: APIOperation, client: httpx.Client, statuses: Counter[int], server_errors: list[str]) -> None:
    """Send the operation's generated cases; tally statuses and keep every 5xx with its body."""

    @given(case=op.as_strategy())
    @settings(max_examples=CASES_PER_BODY_OPERATION if op.body else 5, deadline=None, database=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    def run(case: schemathesis.Case) -> None:
        sent = case.as_transport_kwargs(base_url=str(client.base_url))
        headers = {k: v for k, v in (sent.get("headers") or {}).items() if k.lower() == "content-type"}
        r = client.request(sent["method"], sent["url"], json=sent.get("json"), headers=headers)
        statuses[r.status_code] += 1
        if r.status_code >= 500:
            server_errors.append(f"{op.label}: {r.status_code} {r.text[:300]} for {sent.get('json')!r:.300}")

    run()


def test_generated_cases_never_get_a_5xx(server: ServerProcess) -> None:
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert sum(1 for op in operations if op.body) >= 9, [op.label for op in operations]  # every JSON route's body
    statuses: Counter[int] = Counter()
    server_errors: list[str] = []
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for op in operations:
            fuzz(op, client, statuses, server_errors)
    assert sum(statuses.values()) >= MIN_CASES, statuses
    assert statuses[200] > 0, statuses  # valid requests were generated too, and served
    assert not server_errors, "\n".join(server_errors[:10])
    assert httpx.get(server.url + "/health").status_code == 200
    assert "pdserve_server_errors_total{" not in httpx.get(server.url + "/metrics").text
