"""The fleet under faults: 2 prefill and 2 decode members on four test hosts, the render server and the
proxies on a fifth (tests/fleet/hosts.py), KV over TCP between hosts. For every fault a client gets the
right answer (equal to the uninterrupted greedy one) or an error naming the cause within the stated time,
never a wrong 200 or a hang, and afterwards every member's running, held and lease gauges are back to 0
within one lease (``--kv-lease-s``).

Streams run in the three decode-leg modes: ``derender`` (chat through the inline proxy, reasoning and tool
parsers on), ``text`` (completions, inline) and ``tokens`` (chat through ``--mode derender-tier``).
qwen3-tiny in float32, as tests/e2e/test_migration.py (which says why a resumed greedy answer is the same).

With ``PDSERVE_FLEET_REPORT=path`` each fault test appends its row (what the client saw, time to recover)
to that JSON-lines file: docs/reliability.md's "Fleet faults" table comes from it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.broken_streams import assembled, stream
from tests.fleet.fleet import (
    CHAT,
    COMPLETION,
    MODEL,
    PULL_TIMEOUT_S,
    STREAM,
    Fleet,
    metric,
    metric_on_host,
    running_fleet,
)
from tests.fleet.hosts import MEMBER_PORT, HostMember
from tests.serverproc import metric_sum
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(900)

LEGS = {
    "derender": ("inline", "/v1/chat/completions", CHAT),
    "text": ("inline", "/v1/completions", COMPLETION),
    "tokens": ("derender-tier", "/v1/chat/completions", CHAT),
}
# Prompts long enough that their KV takes seconds over a 1 mbit/s link (faults during the pull).
_LONG_TEXT = " ".join(f"item {i}," for i in range(200))
_LONG_CHAT = CHAT | {"messages": [{"role": "user", "content": _LONG_TEXT + " Weather in Paris?"}], "max_tokens": 40}
LONG_LEGS = {
    "derender": ("inline", "/v1/chat/completions", _LONG_CHAT),
    "text": ("inline", "/v1/completions", {"model": MODEL, "prompt": _LONG_TEXT} | STREAM | {"max_tokens": 40}),
    "tokens": ("derender-tier", "/v1/chat/completions", _LONG_CHAT),
}
REPORT = os.environ.get("PDSERVE_FLEET_REPORT")
# Every fault against every decode-leg mode with PDSERVE_FLEET_ALL=1 (and whenever the report is written);
# else a covering subset: every mode under a killed decode member, and each other fault against one mode, a
# different one per fault. What a mode changes (how the leg resumes) is the same code whatever broke it; a
# cross product here is 10 more fleet runs (about 2.5 minutes of `make test` on 2 CPUs).
ALL_PAIRS = bool(os.environ.get("PDSERVE_FLEET_ALL") or REPORT)


def pairs(legs: list[str], faults: list[str], subset: list[tuple[str, str]]) -> list[Any]:
    """``(leg, fault)`` parameters with ids ``leg-fault``: every pair, or (by default) ``subset``."""
    chosen = [(leg, fault) for leg in legs for fault in faults] if ALL_PAIRS else subset
    return [pytest.param(leg, fault, id=f"{leg}-{fault}") for leg, fault in chosen]


def uncached(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` under a salt of its own: no member's prefix cache holds its blocks, so its prefill computes the
    whole prompt and its decode leg pulls every block over the link (a warm decode cache would pull one)."""
    return body | {"cache_salt": f"fault-{uuid.uuid4().hex}"}


def report(fault: str, leg: str, saw: str, recover_s: float, command: str) -> None:
    """A row of docs/reliability.md's table (only when PDSERVE_FLEET_REPORT names a file)."""
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(json.dumps({"fault": fault, "leg": leg, "saw": saw, "recover_s": round(recover_s, 2),
                                "command": command}) + "\n")


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    with running_fleet() as made:
        yield made


@pytest.fixture
def healthy(fleet: Fleet) -> Iterator[Fleet]:
    """The fleet, whole again after the test (a member it broke restarted, links cleared)."""
    yield fleet
    for host in (*(m.host for m in fleet.members), fleet.front):
        host.link_up()
        host.clear_link()
    for member in fleet.members:
        if member.proc is None or member.proc.poll() is not None or metric(member, "pdserve_running_requests") < 0:
            fleet.restart(member)


# ------------------------------------------------------------ streams


def migrations(fleet: Fleet, mode: str, cause: str) -> float:
    return metric_sum(fleet.proxies[mode].url, "pdserve_proxy_migrations_total", f'cause="{cause}",outcome="moved"',
                      missing=0)


# ------------------------------------------------------------ (a), (b): a decode member killed or hung


SIGNALS = {"a-killed": signal.SIGKILL, "b-hung": signal.SIGSTOP}


@pytest.mark.parametrize(("leg", "fault"), pairs(list(LEGS), list(SIGNALS), [
    ("derender", "a-killed"), ("text", "a-killed"), ("tokens", "a-killed"), ("tokens", "b-hung")]))
def test_a_decode_member_killed_or_hung_mid_stream(healthy: Fleet, leg: str, fault: str) -> None:
    sig = SIGNALS[fault]
    mode, path, body = LEGS[leg]
    url = healthy.proxies[mode].url + path
    want = assembled(stream(url, body))
    cause = "dropped" if sig == signal.SIGKILL else "stalled"
    moved = migrations(healthy, mode, cause)
    broken: list[HostMember] = []
    start = time.monotonic()

    def fault() -> None:
        broken.append(healthy.serving())
        os.kill(broken[0].pid, sig)

    got = assembled(stream(url, body, fault))
    took = time.monotonic() - start
    assert got == want
    assert migrations(healthy, mode, cause) == moved + 1
    healthy.restart(broken[0])
    healthy.assert_nothing_leaked()
    what = "SIGKILL" if sig == signal.SIGKILL else "SIGSTOP"
    report(f"({'a' if sig == signal.SIGKILL else 'b'}) decode member {what} mid-stream", leg,
           f"the whole answer, equal to the uninterrupted one (moved: {cause})", took,
           f"pytest tests/fleet/test_faults.py -k '{leg} and {fault}'")


# ------------------------------------------------------------ (c), (d), (f): the KV's source goes away


def _during_the_pull(fleet: Fleet, leg: str, prefill_fault: Callable[[HostMember], None]
                     ) -> tuple[list[dict[str, Any]], float, HostMember]:
    """A completions stream whose prompt's KV crawls over the prefill hosts' slowed links; the fault hits the
    prefill member that holds it once the decode leg is under way (pulling): a lease alone is not enough, as
    the prefill's answer may still be on its way to the proxy, which would then send the leg to the other
    prefill member (a retry, not the fault under test). The events, the seconds the stream took, the member
    hit."""
    for prefill in fleet.prefills:
        prefill.host.slow_link(rate="1mbit")
    start = time.monotonic()
    hit: list[HostMember] = []

    def fault() -> None:
        fleet.serving()
        held = wait_until(lambda: [p for p in fleet.prefills if metric_on_host(p, "pdserve_kv_held_requests") == 1],
                          "a prefill member holds the prompt's KV")
        wait_until(lambda: any(metric(d, "pdserve_running_requests") >= 1 for d in fleet.decodes),
                   "the decode leg reached a decode member")
        hit.append(held[0])
        prefill_fault(held[0])

    mode, path, body = LONG_LEGS[leg]
    events = stream(fleet.proxies[mode].url + path, uncached(body), fault, after_output=False)
    took = time.monotonic() - start
    for prefill in fleet.prefills:
        prefill.host.link_up()
        prefill.host.clear_link()
    return events, took, hit[0]


def _whole_or_named(fleet: Fleet, mode: str, events: list[dict[str, Any]], want: dict[str, Any],
                    moved_before: float, pulls_failed: float) -> str:
    """The answer is whole, or the error names the KV pull; what the client saw, for the report. A whole
    answer moved exactly when a decode member's pull failed (an error event): a member killed once its
    last KV bytes were in its kernel's socket buffer still delivers them (TCP sends them on after the
    process is gone), and then the pull succeeds and nothing moves."""
    last = events[-1]
    if "error" in last:
        assert last["error"]["code"] >= 500 and "KV" in last["error"]["message"], last
        return f"an error event naming it: {last['error']['message'][:80]}…"
    assert assembled(events) == want

    def failed_and_moved() -> tuple[bool, float]:
        return (sum(metric(d, "pdserve_kv_pulls_failed_total") for d in fleet.decodes) > pulls_failed,
                migrations(fleet, mode, "error_event"))

    # A member's KV counters reach its /metrics with its engine's next stats report, which may come after the
    # error event that moved the stream (a failed run read the failure 0 and the move 1, then 1 and 1): so
    # both are read until they agree, for a few seconds, and then they must.
    deadline = time.monotonic() + 5
    while (counts := failed_and_moved())[1] != moved_before + counts[0] and time.monotonic() < deadline:
        time.sleep(0.1)
    failed, moved = counts
    assert moved == moved_before + failed, _kv_counters(fleet, mode)
    if not failed:
        return "the whole answer: the KV had left the prefill host before it died (TCP delivered it), nothing moved"
    return "the whole answer: the decode member failed the pull (an error event), the stream moved"


def _kv_counters(fleet: Fleet, mode: str) -> str:
    """The proxy's moves and each member's pulls and leases: what a failed assertion needs to say."""
    moves = httpx.get(fleet.proxies[mode].url + "/metrics", timeout=10).text
    lines = [line for line in moves.splitlines() if line.startswith(("pdserve_proxy_migrations_total", "pdserve_proxy_retries_total", "pdserve_proxy_member_errors"))]
    for m in fleet.members:
        try:
            text = httpx.get(m.url + "/metrics", timeout=10).text
        except httpx.HTTPError as e:
            text = repr(e)
        lines.append(f"{m.url}: " + " ".join(line for line in text.splitlines() if line.startswith("pdserve_kv_")))
    return "\n".join(lines)


def _restart_now(prefill: HostMember) -> None:
    prefill.stop(grace_s=0)
    prefill.spawn()


# What takes the KV's source away during the pull: the title of its row, and how.
SOURCE_FAULTS: dict[str, tuple[str, Callable[[HostMember], None]]] = {
    "c-killed": ("(c) prefill member killed after its answer, during the pull", lambda p: os.kill(p.pid, signal.SIGKILL)),
    "d-link-down": ("(d) the prefill host's link down during a pull (--kv-pull-timeout-s 5)", lambda p: p.host.link_down()),
    "f-restarted": ("(f) a prefill member restarted (new engine id) while its lease is held", _restart_now),
}


@pytest.mark.parametrize(("leg", "fault"), pairs(list(LONG_LEGS), list(SOURCE_FAULTS), [
    ("derender", "c-killed"), ("text", "d-link-down"), ("tokens", "f-restarted")]))
def test_the_kv_source_goes_away_during_the_pull(healthy: Fleet, leg: str, fault: str) -> None:
    """(c) the peer is gone, (d) it went silent until --kv-pull-timeout-s, (f) it runs a new engine whose
    leases are not the old one's: the decode member fails the leg with an error event, the stream moves (or,
    for (c) and (f), the KV was already on the wire and arrives whole: nothing moves)."""
    title, hit_it = SOURCE_FAULTS[fault]
    mode, path, body = LONG_LEGS[leg]
    want = assembled(stream(healthy.proxies[mode].url + path, body))
    moved = migrations(healthy, mode, "error_event")
    pulls_failed = sum(metric(d, "pdserve_kv_pulls_failed_total") for d in healthy.decodes)
    events, took, hit = _during_the_pull(healthy, leg, hit_it)
    saw = _whole_or_named(healthy, mode, events, want, moved, pulls_failed)
    if fault == "d-link-down":
        assert took >= PULL_TIMEOUT_S
    healthy.restart(hit)
    healthy.assert_nothing_leaked()
    report(title, leg, saw, took, f"pytest tests/fleet/test_faults.py -k '{leg} and {fault}'")


@pytest.mark.parametrize("leg", list(LONG_LEGS) if ALL_PAIRS else ["derender"])
def test_e_a_slow_kv_link_slows_the_answer_and_changes_nothing_else(healthy: Fleet, leg: str) -> None:
    mode, path, body = LONG_LEGS[leg]
    url = healthy.proxies[mode].url + path
    start = time.monotonic()
    want = assembled(stream(url, uncached(body)))
    fast = time.monotonic() - start
    for prefill in healthy.prefills:
        prefill.host.slow_link(rate="1mbit")
    start = time.monotonic()
    got = assembled(stream(url, uncached(body)))
    slow = time.monotonic() - start
    assert got == want and slow > fast
    healthy.assert_nothing_leaked()
    report("(e) a slow KV link (tbf 1 mbit/s on the prefill hosts)", leg,
           f"the whole answer, {slow:.1f} s instead of {fast:.1f} s", slow,
           f"pytest tests/fleet/test_faults.py -k 'test_e_ and {leg}'")


# ------------------------------------------------------------ (g) a decode member drained under load


def test_g_a_decode_member_drained_under_load(healthy: Fleet) -> None:
    """SIGTERM to a decode member with streams on both: its streams finish (--shutdown-timeout), new legs go
    to the other member (503 before the first byte: not a move), and every answer is whole."""
    url = healthy.proxies["inline"].url + "/v1/chat/completions"
    want = assembled(stream(url, CHAT))
    answers: list[dict[str, Any]] = []
    errors: list[BaseException] = []

    def client() -> None:
        try:
            for _ in range(3):
                answers.append(assembled(stream(url, CHAT)))
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=client) for _ in range(4)]
    start = time.monotonic()
    for t in threads:
        t.start()
    drained = wait_until(lambda: [d for d in healthy.decodes if metric(d, "pdserve_running_requests") >= 1],
                         "streams on a decode member")[0]
    os.kill(drained.pid, signal.SIGTERM)
    for t in threads:
        t.join(300)
    took = time.monotonic() - start
    assert not errors and len(answers) == 12 and all(a == want for a in answers)
    assert drained.proc is not None and drained.proc.wait(60) is not None
    healthy.restart(drained)
    healthy.assert_nothing_leaked()
    report("(g) decode member SIGTERM (drain) under load, 4 clients", "derender", "12 of 12 answers whole", took,
           "pytest tests/fleet/test_faults.py -k test_g_")


# ------------------------------------------------------------ (h) the render server down


def test_h_the_render_server_down(healthy: Fleet) -> None:
    """Nothing can be rendered: a 503 naming the render pool at once; a derender-tier stream that needs
    /derender mid-stream ends with an error event naming it."""
    tier = healthy.proxies["derender-tier"].url + "/v1/chat/completions"

    def kill_render() -> None:
        os.kill(healthy.render.pid, signal.SIGKILL)
        healthy.render.proc.wait()  # type: ignore[union-attr]

    events = stream(tier, CHAT, kill_render)
    assert "error" in events[-1] and healthy.render.url in events[-1]["error"]["message"], events[-1]
    start = time.monotonic()
    r = httpx.post(healthy.proxies["inline"].url + "/v1/chat/completions", json=CHAT, timeout=30)
    took = time.monotonic() - start
    assert r.status_code == 503 and "render" in r.json()["error"]["message"], r.text
    healthy.restart(healthy.render)
    assert "error" not in stream(tier, CHAT)[-1]
    healthy.assert_nothing_leaked()
    report("(h) the render server down", "tokens, derender", "503 naming the render pool (new requests); an "
           "error event naming it (a derender-tier stream mid-way)", took, "pytest tests/fleet/test_faults.py -k test_h_")


# ------------------------------------------------------------ (i) the proxy stopped with streams open


def test_i_the_proxy_stopped_with_streams_open(healthy: Fleet) -> None:
    proxy = healthy.proxy("inline", MEMBER_PORT + 9, "--shutdown-timeout", "1")
    proxy.spawn()
    proxy.wait_healthy(120)
    start = time.monotonic()
    try:
        events = stream(proxy.url + "/v1/chat/completions", CHAT | {"max_tokens": 3000},
                        lambda: os.kill(proxy.pid, signal.SIGTERM))
        took = time.monotonic() - start
        assert events[-1]["error"]["code"] == 503 and "shutting down" in events[-1]["error"]["message"]
        assert proxy.proc is not None and proxy.proc.wait(30) is not None
    finally:
        proxy.stop()
    healthy.assert_nothing_leaked()
    report("(i) the proxy SIGTERM with a stream open (--shutdown-timeout 1)", "derender",
           "an error event naming the shutdown after the drain time, then [DONE]; the decode leg aborted", took,
           "pytest tests/fleet/test_faults.py -k test_i_")


# ------------------------------------------------------------ (j) a member that sends garbage


@pytest.mark.parametrize("fault", ["garbage", "truncated"])
def test_j_a_decode_member_that_sends_garbage_or_a_truncated_body(healthy: Fleet, fault: str) -> None:
    host = healthy.decodes[0].host
    port = MEMBER_PORT + 7
    faulty = subprocess.Popen(["ip", "netns", "exec", host.netns, sys.executable, "-m", "tests.fleet.faulty_member",
                               "--host", host.address, "--port", str(port), "--fault", fault],
                              cwd=Path(__file__).parents[2])
    url = f"http://{host.address}:{port}"
    proxy = healthy.proxy("inline", MEMBER_PORT + 8, "--routing", "round-robin",
                          decodes=[url, healthy.decodes[1].url])
    try:
        wait_until(lambda: _answers(url), "the faulty member listens")
        proxy.spawn()
        proxy.wait_healthy(120)
        cause = "garbage" if fault == "garbage" else "dropped"
        want = assembled(stream(healthy.proxies["inline"].url + "/v1/completions", COMPLETION))
        start = time.monotonic()
        for _ in range(2):  # round-robin: one of two goes to the faulty member
            assert assembled(stream(proxy.url + "/v1/completions", COMPLETION)) == want
        took = time.monotonic() - start
        assert metric_sum(proxy.url, "pdserve_proxy_migrations_total", f'cause="{cause}",outcome="moved"') >= 1
    finally:
        proxy.stop()
        faulty.kill()
        faulty.wait()
    healthy.assert_nothing_leaked()
    report(f"(j) a decode member that answers 200 with {'an event that is not JSON' if fault == 'garbage' else 'a body cut off'}",
           "text", f"the whole answer (moved: {cause})", took, f"pytest tests/fleet/test_faults.py -k '{fault}'")


def _answers(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
