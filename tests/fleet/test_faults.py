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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fleet.hosts import MEMBER_PORT, FleetHosts, Host, HostMember, require_namespaces
from tests.serverproc import metric_sum
from tests.sse import parse_sse
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(900)

MODEL = "qwen3-tiny"
LEASE_S = 10.0
PULL_TIMEOUT_S = 5.0
ENGINE = (MODEL, "--dtype", "float32", "--kv-transfer", "nixl", "--kv-lease-s", str(LEASE_S),
          "--kv-pull-timeout-s", str(PULL_TIMEOUT_S))
PARSERS = ("--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--enable-auto-tool-choice")
STALL_S = 2.0
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
STREAM = {"max_tokens": 300, "ignore_eos": True, "temperature": 0, "stream": True,
          "stream_options": {"include_usage": True}, "return_token_ids": True}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER]} | STREAM
COMPLETION = {"model": MODEL, "prompt": "Tell me about Paris."} | STREAM
LEGS = {
    "derender": ("inline", "/v1/chat/completions", CHAT),
    "text": ("inline", "/v1/completions", COMPLETION),
    "tokens": ("derender-tier", "/v1/chat/completions", CHAT),
}
# A prompt long enough that its KV takes seconds over a 1 mbit/s link (faults during the pull).
LONG_PROMPT = {"model": MODEL, "prompt": " ".join(f"item {i}," for i in range(200))} | STREAM | {"max_tokens": 40}
REPORT = os.environ.get("PDSERVE_FLEET_REPORT")


def report(fault: str, leg: str, saw: str, recover_s: float, command: str) -> None:
    """A row of docs/reliability.md's table (only when PDSERVE_FLEET_REPORT names a file)."""
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(json.dumps({"fault": fault, "leg": leg, "saw": saw, "recover_s": round(recover_s, 2),
                                "command": command}) + "\n")


class Fleet:
    """The members on their hosts, the proxies, and what a fault test needs to break and mend them."""

    def __init__(self, hosts: FleetHosts):
        p0, p1, d0, d1, front = hosts.hosts
        self.front = front
        self.prefills = [self._member(h, "prefill", "--tokens-only", "--kv-role", "prefill") for h in (p0, p1)]
        self.decodes = [self._member(h, "decode", "--kv-role", "decode", *PARSERS) for h in (d0, d1)]
        self.render = HostMember(front, "render", ["launch", "render", "--tokenizer", _model_dir(), *PARSERS])
        self.proxies = {mode: self.proxy(mode, port=MEMBER_PORT + 1 + i)
                        for i, mode in enumerate(("inline", "derender-tier"))}

    @staticmethod
    def _member(host: Host, name: str, *args: str) -> HostMember:
        return HostMember(host, name, ["serve", *ENGINE, "--kv-host", host.address, *args])

    def proxy(self, mode: str, port: int, *extra: str, decodes: list[str] | None = None) -> HostMember:
        decode_urls = decodes or [d.url for d in self.decodes]
        return HostMember(self.front, f"proxy-{mode}", [
            "proxy", "--render", self.render.url, "--prefill", ",".join(p.url for p in self.prefills),
            "--decode", ",".join(decode_urls), "--mode", mode, "--health-interval-s", "0.2",
            "--stall-timeout-s", str(STALL_S), *extra], port=port)

    @property
    def members(self) -> list[HostMember]:
        return [*self.prefills, *self.decodes, self.render]

    def start(self) -> None:
        for member in self.members:
            member.spawn()
        for member in self.members:
            member.wait_healthy(300)
        for proxy in self.proxies.values():
            proxy.spawn()
        for proxy in self.proxies.values():
            proxy.wait_healthy(120)

    def stop(self) -> None:
        for member in [*self.proxies.values(), *self.members]:
            member.stop()

    def restart(self, member: HostMember) -> None:
        """A member back after a fault (killed, stopped): the proxies see it healthy again."""
        if member.proc is not None and member.proc.poll() is None:
            os.kill(member.pid, signal.SIGCONT)
        else:
            member.spawn()
        member.wait_healthy(300)
        for proxy in self.proxies.values():
            for pool in ("prefill", "decode", "render"):
                name = f'pdserve_proxy_member_healthy{{pool="{pool}",url="{member.url}"}}'
                if name in httpx.get(proxy.url + "/metrics", timeout=10).text:
                    wait_until(lambda n=name, p=proxy: metric_sum(p.url, n) == 1, f"{member.url} back in rotation")

    def serving(self) -> HostMember:
        """The decode member that runs the one request in flight."""
        running = wait_until(lambda: [d for d in self.decodes if _metric(d, "pdserve_running_requests") == 1],
                             "a decode member runs the request")
        assert len(running) == 1
        return running[0]

    def assert_nothing_leaked(self) -> float:
        """Every member's running, held and lease gauges at 0 within one lease; the seconds it took."""
        start = time.monotonic()
        gauges = ("pdserve_running_requests", "pdserve_engine_running_requests", "pdserve_engine_waiting_requests",
                  "pdserve_kv_held_requests", "pdserve_kv_held_blocks")
        for member in [*self.prefills, *self.decodes]:
            for gauge in gauges:
                wait_until(lambda m=member, g=gauge: _metric(m, g) == 0, f"{gauge} of {member.url} at 0",
                           bound_s=LEASE_S + 5)
        for proxy in self.proxies.values():
            wait_until(lambda p=proxy: _metric(p, "pdserve_proxy_running_requests") == 0, "the proxy idle")
        return time.monotonic() - start


def _metric(member: HostMember, name: str) -> float:
    try:
        return metric_sum(member.url, name)
    except httpx.HTTPError:
        return -1.0  # not answering (stopped, restarting): not 0


def _model_dir() -> str:
    from pdserve.checkpoints.resolve import resolve_model

    return str(resolve_model(MODEL))


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    require_namespaces()
    with FleetHosts(5) as hosts:
        made = Fleet(hosts)
        try:
            made.start()
            yield made
        finally:
            made.stop()
    assert hosts.leftovers() == []


@pytest.fixture
def healthy(fleet: Fleet) -> Iterator[Fleet]:
    """The fleet, whole again after the test (a member it broke restarted, links cleared)."""
    yield fleet
    for host in (*(m.host for m in fleet.members), fleet.front):
        host.link_up()
        host.clear_link()
    for member in fleet.members:
        if member.proc is None or member.proc.poll() is not None or _metric(member, "pdserve_running_requests") < 0:
            fleet.restart(member)


# ------------------------------------------------------------ streams


def assembled(events: list[dict[str, Any]]) -> dict[str, Any]:
    """What a client makes of a stream: text, reasoning, content, tool calls, ids, finish, usage."""
    out: dict[str, Any] = {"text": "", "reasoning": "", "content": "", "tools": {}, "ids": [], "finish": None,
                           "usage": None}
    for event in events:
        assert "error" not in event, event
        out["usage"] = event.get("usage") or out["usage"]
        for choice in event.get("choices", []):
            out["finish"] = choice.get("finish_reason") or out["finish"]
            out["text"] += choice.get("text") or ""
            out["ids"] += choice.get("token_ids") or []
            delta = choice.get("delta") or {}
            out["reasoning"] += delta.get("reasoning") or delta.get("reasoning_content") or ""
            out["content"] += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                tool = out["tools"].setdefault(call["index"], {"name": "", "arguments": ""})
                tool["name"] += (call.get("function") or {}).get("name") or ""
                tool["arguments"] += (call.get("function") or {}).get("arguments") or ""
    return out


def _carries_output(line: str) -> bool:
    event = json.loads(line[len("data: "):])
    return any(c.get("text") or c.get("token_ids") for c in event.get("choices") or [])


def stream(url: str, body: dict[str, Any], fault: Callable[[], None] | None = None, *, after_output: bool = True,
           timeout: float = 120) -> list[dict[str, Any]]:
    """A stream's events; ``fault()`` runs once output arrived (``after_output``) or once the stream opened."""
    with httpx.stream("POST", url, json=body, timeout=timeout) as r:
        if r.status_code != 200:
            return [json.loads(r.read())]
        lines = r.iter_lines()
        head: list[str] = []
        if fault is not None:
            if after_output:
                for line in lines:
                    head.append(line)
                    if line.startswith("data: {") and _carries_output(line):
                        break
            fault()
        events, done = parse_sse(head + list(lines))
    assert done, "the stream ended without [DONE]"
    return events


def migrations(fleet: Fleet, mode: str, cause: str) -> float:
    text = httpx.get(fleet.proxies[mode].url + "/metrics", timeout=10).text
    name = f'pdserve_proxy_migrations_total{{cause="{cause}",outcome="moved"}}'
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


# ------------------------------------------------------------ (a), (b): a decode member killed or hung


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["a-killed", "b-hung"])
@pytest.mark.parametrize("leg", list(LEGS))
def test_a_decode_member_killed_or_hung_mid_stream(healthy: Fleet, leg: str, sig: signal.Signals) -> None:
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
           f"pytest tests/fleet/test_faults.py -k '{leg} and {'a-killed' if sig == signal.SIGKILL else 'b-hung'}'")


# ------------------------------------------------------------ (c), (d), (f): the KV's source goes away


def _during_the_pull(fleet: Fleet, prefill_fault: Callable[[HostMember], None]
                     ) -> tuple[list[dict[str, Any]], float, HostMember]:
    """A completions stream whose prompt's KV crawls over the prefill hosts' slowed links; the fault hits the
    prefill member that holds it once the decode leg is under way (pulling). The events, the seconds the
    stream took, the member hit."""
    for prefill in fleet.prefills:
        prefill.host.slow_link(rate="1mbit")
    start = time.monotonic()
    hit: list[HostMember] = []

    def fault() -> None:
        fleet.serving()
        held = wait_until(lambda: [p for p in fleet.prefills if _metric(p, "pdserve_kv_held_requests") == 1],
                          "a prefill member holds the prompt's KV")
        hit.append(held[0])
        prefill_fault(held[0])

    events = stream(fleet.proxies["inline"].url + "/v1/completions", LONG_PROMPT, fault, after_output=False)
    took = time.monotonic() - start
    for prefill in fleet.prefills:
        prefill.host.link_up()
        prefill.host.clear_link()
    return events, took, hit[0]


def _whole_or_named(fleet: Fleet, events: list[dict[str, Any]], want: dict[str, Any], moved_before: float) -> str:
    """The answer is whole (the failed pull was an error event and the stream moved), or the error names
    the KV pull; what the client saw, for the report."""
    last = events[-1]
    if "error" in last:
        assert last["error"]["code"] >= 500 and "KV" in last["error"]["message"], last
        return f"an error event naming it: {last['error']['message'][:80]}…"
    assert assembled(events) == want
    assert migrations(fleet, "inline", "error_event") == moved_before + 1
    return "the whole answer: the decode member failed the pull (an error event), the stream moved"


def test_c_a_prefill_member_killed_before_the_pull_finished(healthy: Fleet) -> None:
    want = assembled(stream(healthy.proxies["inline"].url + "/v1/completions", LONG_PROMPT))
    moved = migrations(healthy, "inline", "error_event")
    events, took, hit = _during_the_pull(healthy, lambda p: os.kill(p.pid, signal.SIGKILL))
    saw = _whole_or_named(healthy, events, want, moved)
    healthy.restart(hit)
    healthy.assert_nothing_leaked()
    report("(c) prefill member killed after its answer, during the pull", "text", saw, took,
           "pytest tests/fleet/test_faults.py -k test_c_")


def test_d_the_prefill_hosts_link_down_during_a_pull(healthy: Fleet) -> None:
    """The pull hangs until --kv-pull-timeout-s (5 s here), then fails like (c)."""
    want = assembled(stream(healthy.proxies["inline"].url + "/v1/completions", LONG_PROMPT))
    moved = migrations(healthy, "inline", "error_event")
    events, took, _ = _during_the_pull(healthy, lambda p: p.host.link_down())
    saw = _whole_or_named(healthy, events, want, moved)
    assert took >= PULL_TIMEOUT_S
    healthy.assert_nothing_leaked()
    report("(d) the prefill host's link down during a pull (--kv-pull-timeout-s 5)", "text", saw, took,
           "pytest tests/fleet/test_faults.py -k test_d_")


def test_e_a_slow_kv_link_slows_the_answer_and_changes_nothing_else(healthy: Fleet) -> None:
    url = healthy.proxies["inline"].url + "/v1/completions"
    start = time.monotonic()
    want = assembled(stream(url, LONG_PROMPT))
    fast = time.monotonic() - start
    for prefill in healthy.prefills:
        prefill.host.slow_link(rate="1mbit")
    start = time.monotonic()
    got = assembled(stream(url, LONG_PROMPT))
    slow = time.monotonic() - start
    assert got == want and slow > fast
    healthy.assert_nothing_leaked()
    report("(e) a slow KV link (tbf 1 mbit/s on the prefill hosts)", "text",
           f"the whole answer, {slow:.1f} s instead of {fast:.1f} s", slow,
           "pytest tests/fleet/test_faults.py -k test_e_")


def test_f_a_prefill_member_restarted_while_its_leases_are_held(healthy: Fleet) -> None:
    """Leases of the old engine die with it: the decode leg that pulls one fails, and the stream moves."""
    want = assembled(stream(healthy.proxies["inline"].url + "/v1/completions", LONG_PROMPT))
    moved = migrations(healthy, "inline", "error_event")

    def restart(prefill: HostMember) -> None:
        prefill.stop(grace_s=0)
        prefill.spawn()

    events, took, hit = _during_the_pull(healthy, restart)
    saw = _whole_or_named(healthy, events, want, moved)
    healthy.restart(hit)
    healthy.assert_nothing_leaked()
    report("(f) a prefill member restarted (new engine id) while its lease is held", "text", saw, took,
           "pytest tests/fleet/test_faults.py -k test_f_")


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
    drained = wait_until(lambda: [d for d in healthy.decodes if _metric(d, "pdserve_running_requests") >= 1],
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
        text = httpx.get(proxy.url + "/metrics", timeout=10).text
        name = f'pdserve_proxy_migrations_total{{cause="{cause}",outcome="moved"}} '
        assert float(next(x for x in text.splitlines() if x.startswith(name)).split()[-1]) >= 1
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
