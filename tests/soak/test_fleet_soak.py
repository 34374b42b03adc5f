"""The fleet soak (issue 29): 2,000 streamed requests at concurrency 32 over the three decode-leg modes
(derender chat, text completions, tokens chat through --mode derender-tier), on the fault suite's fleet of
test hosts (tests/fleet/test_faults.py), while a loop kills one member (SIGKILL: a decode member, then a
prefill member, in turn) every few seconds and restarts it.

Every answer is checked against the uninterrupted greedy answer to its request: 0 wrong answers (a 200
whose stream differs) and 0 hangs (a client waiting past its timeout) are the bar; requests that ended in a
clear error are counted as failed. The moved, retried and failed counts are printed (``make soak-fleet``).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.broken_streams import assembled, stream
from tests.fleet.fleet import CHAT, COMPLETION, Fleet, running_fleet
from tests.serverproc import metric_sum

pytestmark = pytest.mark.timeout(3600)

TOTAL, CONCURRENCY = int(os.environ.get("PDSERVE_SOAK_REQUESTS", "2000")), 32
KILL_EVERY_S = 4.0
CLIENT_TIMEOUT_S = 120.0
SHORT = {"max_tokens": 48}
TOPICS = ["Paris", "the sea", "a clock", "rain", "bread", "a violin", "winter", "trains"]


def _requests() -> list[tuple[str, str, str, dict[str, Any]]]:
    """(leg, proxy mode, path, body): the three modes over eight prompts each."""
    out = []
    for topic in TOPICS:
        chat = CHAT | SHORT | {"messages": [{"role": "user", "content": f"Tell me about {topic}."}]}
        completion = COMPLETION | SHORT | {"prompt": f"A few words about {topic}:"}
        out += [("derender", "inline", "/v1/chat/completions", chat),
                ("text", "inline", "/v1/completions", completion),
                ("tokens", "derender-tier", "/v1/chat/completions", chat)]
    return out


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    with running_fleet() as made:
        yield made


def _metric_total(fleet: Fleet, name: str, labels: str = "") -> float:
    """``name``'s samples with ``labels``, summed over both proxies."""
    return sum(metric_sum(proxy.url, name, labels, missing=0) for proxy in fleet.proxies.values())


def _difference(leg: str, got: dict[str, Any], want: dict[str, Any]) -> str:
    """Where a wrong answer departs from the right one (ids, and the fields that differ)."""
    fields = [k for k in want if got.get(k) != want[k]]
    ids, right = got["ids"], want["ids"]
    at = next((n for n, (a, b) in enumerate(zip(ids, right)) if a != b), min(len(ids), len(right)))
    return (f"{leg}: fields {fields}; {len(ids)} ids against {len(right)}, first differing at {at}: "
            f"{ids[max(0, at - 3):at + 4]} against {right[max(0, at - 3):at + 4]}")


def test_the_fleet_soak(fleet: Fleet) -> None:
    requests = _requests()
    want = {i: assembled(stream(fleet.proxies[mode].url + path, body)) for i, (_, mode, path, body) in enumerate(requests)}
    outcome: Counter[str] = Counter()
    wrong: list[str] = []
    errors: Counter[str] = Counter()
    stop = threading.Event()
    kills: list[str] = []

    def killer() -> None:
        for member in itertools.cycle([fleet.decodes[0], fleet.prefills[0], fleet.decodes[1], fleet.prefills[1]]):
            if stop.wait(KILL_EVERY_S):
                return
            os.kill(member.pid, signal.SIGKILL)
            kills.append(member.url)
            assert member.proc is not None
            member.proc.wait()
            member.spawn()
            member.wait_healthy(300)

    def one(n: int) -> None:
        i = n % len(requests)
        _, mode, path, body = requests[i]
        try:
            events = stream(fleet.proxies[mode].url + path, body, timeout=CLIENT_TIMEOUT_S,
                            headers={"x-request-id": f"soak-{n}"})
        except httpx.TimeoutException:
            outcome["hung"] += 1
            return
        except (httpx.HTTPError, AssertionError, json.JSONDecodeError) as e:  # broke off, or a bare error page
            outcome["broken"] += 1
            errors[f"{type(e).__name__}: {e}"[:120]] += 1
            return
        last = events[-1]
        if "error" in last:
            outcome["failed"] += 1
            errors[str(last["error"].get("message"))[:120]] += 1
        elif (got := assembled(events)) == want[i]:
            outcome["right"] += 1
        else:
            outcome["wrong"] += 1
            others = [j for j, w in want.items() if w == got]
            wrong.append(f"#{n} " + _difference(requests[i][0], got, want[i]) + f"; equals the answer to {others}")

    thread = threading.Thread(target=killer, daemon=True)
    start = time.monotonic()
    thread.start()
    try:
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            list(pool.map(one, range(TOTAL)))
    finally:
        stop.set()
        thread.join(360)
    took = time.monotonic() - start
    moved = _metric_total(fleet, "pdserve_proxy_migrations_total", 'outcome="moved"')
    not_moved = _metric_total(fleet, "pdserve_proxy_migrations_total") - moved
    retried = _metric_total(fleet, "pdserve_proxy_retries_total")
    before_first_byte = _metric_total(fleet, "pdserve_proxy_member_errors_total", 'cause="unreachable"') + \
        _metric_total(fleet, "pdserve_proxy_member_errors_total", 'cause="status_503"')
    print(f"\nfleet soak: {TOTAL} streamed requests at C={CONCURRENCY} in {took:.0f} s, {len(kills)} kills "
          f"(one every {KILL_EVERY_S:g} s, restarted): {dict(outcome)}; moved mid-stream {moved:.0f}, "
          f"not moved {not_moved:.0f}, legs re-sent after a member died mid-request {retried:.0f}, "
          f"connect errors/503s sent on before the first byte {before_first_byte:.0f}")
    for message, count in errors.most_common(10):
        print(f"  {count} x {message}")
    for line in wrong[:10]:
        print(f"  wrong: {line}")
    if wrong:
        print("  wrong by leg:", Counter(line.split()[1] for line in wrong))
        for member in [*fleet.prefills, *fleet.decodes]:
            print(f"  --- {member.url} log: " + member.log_tail(3000).replace("\n", "\n      "))
    if outcome["broken"]:
        for mode, proxy in fleet.proxies.items():
            text = proxy.log_tail(10**8)
            at = text.find("Traceback")
            print(f"  --- proxy {mode} log, first traceback: " + text[at:at + 6000].replace("\n", "\n      "))
    assert outcome["wrong"] == 0 and outcome["hung"] == 0 and outcome["broken"] == 0, dict(outcome)
    assert not [m for m in errors if "internal error" in m], "a proxy bug, not a fault's clear error"
    assert sum(outcome.values()) == TOTAL and len(kills) >= 3
