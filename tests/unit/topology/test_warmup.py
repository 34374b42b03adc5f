"""The warm-up hand-off (pdserve.topology.warmup): a failed pull is tried once more, a failed prefill leg is not;
against members on loopback that answer as scripted."""

from __future__ import annotations

import json
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler

import pytest

from pdserve.topology.warmup import PULL_ATTEMPTS, WarmUpFailed, hand_off, warm_pairs
from tests.loopback import LoopbackServer, reply


class Member(LoopbackServer):
    """A generate endpoint answering the statuses of ``script`` in turn (then 200), recording each body."""

    def __init__(self, script: list[int]) -> None:
        self.script = list(script)
        self.bodies: list[dict] = []
        member = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's spelling)
                member.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                status = member.script.pop(0) if member.script else 200
                body = {"kv_transfer_params": {"remote_engine_id": "e"}} if status == 200 else \
                    {"error": {"message": f"scripted {status}"}}
                reply(self, status, json.dumps(body).encode(), "application/json")

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(Handler)


@pytest.fixture
def members() -> Iterator[list[Member]]:
    made: list[Member] = []
    yield made
    for member in made:
        member.close()


def pair(members: list[Member], prefill: list[int], decode: list[int]) -> tuple[Member, Member]:
    members.extend([Member(prefill), Member(decode)])
    return members[-2], members[-1]


def test_a_failed_pull_is_tried_again_with_a_new_prefill_leg(members: list[Member]) -> None:
    prefill, decode = pair(members, [], [502])
    done = hand_off(prefill.url, decode.url, 10)
    assert len(prefill.bodies) == len(decode.bodies) == 2
    assert len(done.failed_pulls) == 1 and "502" in done.failed_pulls[0] and decode.url in done.failed_pulls[0]
    assert done.seconds > 0
    # Each decode leg carries the params its own prefill leg returned.
    assert all(b["kv_transfer_params"]["remote_engine_id"] == "e" for b in decode.bodies)


def test_pulls_failing_every_time_fail_the_warm_up_naming_each(members: list[Member]) -> None:
    prefill, decode = pair(members, [], [502] * PULL_ATTEMPTS)
    with pytest.raises(WarmUpFailed) as failed:
        hand_off(prefill.url, decode.url, 10)
    assert str(failed.value).count("answered 502") == PULL_ATTEMPTS
    assert len(decode.bodies) == PULL_ATTEMPTS


def test_a_failed_prefill_leg_is_not_tried_again(members: list[Member]) -> None:
    prefill, decode = pair(members, [500], [])
    with pytest.raises(WarmUpFailed, match=f"prefill leg on {prefill.url} answered 500"):
        hand_off(prefill.url, decode.url, 10)
    assert len(prefill.bodies) == 1 and not decode.bodies


def test_a_pair_that_pulls_at_once_reports_no_failed_pull(members: list[Member]) -> None:
    prefill, decode = pair(members, [], [])
    done = warm_pairs([prefill.url], [decode.url], 10)[(prefill.url, decode.url)]
    assert done.failed_pulls == () and len(decode.bodies) == 1
