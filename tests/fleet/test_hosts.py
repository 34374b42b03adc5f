"""The test-host harness itself, and the first thing it is for: a P/D hand-off whose KV crosses a link.

Members run on their own hosts (network namespaces on one bridge, tests/fleet/hosts.py), bound to their
host's address; the test process reaches them over its own link to the bridge. Checked: hosts reach each
other, a partition cuts a host off and healing it brings it back, a slow link (``tbf``) slows what
crosses it, the prefill's KV reaches the decode host over TCP (UCX) and the answer equals the decode
server's coupled one, and nothing the harness made outlives it.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from pdserve.proxy.legs import decode_body, prefill_body
from tests.fleet.hosts import FleetHosts, HostMember, python_on, require_namespaces
from tests.serverproc import metric_sum
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(600)

MODEL = "qwen3-tiny"
# float32: the decode leg's first token comes from a decode step over pulled KV, the coupled answer's from a
# prefill; in float32 the two agree bit for bit (tests/e2e/test_kv_handoff.py).
ENGINE = (MODEL, "--dtype", "float32", "--kv-transfer", "nixl")
PROMPT = {"token_ids": list(range(1000, 1200)), "sampling_params": {"max_tokens": 8, "temperature": 0}}


@pytest.fixture
def hosts() -> Iterator[FleetHosts]:
    require_namespaces()
    with FleetHosts(2) as made:
        yield made
    assert made.leftovers() == []


def reachable(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_hosts_reach_each_other_a_partition_cuts_one_off_and_healing_brings_it_back(hosts: FleetHosts) -> None:
    a, b = hosts.hosts
    member = HostMember(a, "scripted", ["serve", "--engine", "scripted"])
    member.spawn()
    try:
        member.wait_healthy(120)
        probe = f"import urllib.request as u; print(u.urlopen('{member.url}/health', timeout=5).status)"
        assert python_on(b, probe).stdout.strip() == "200"
        a.link_down()
        assert not reachable(member.url)
        assert python_on(b, probe).returncode != 0
        a.link_up()
        assert reachable(member.url)
    finally:
        member.stop()


def hand_off(prefill: HostMember, decode: HostMember, salt: str) -> dict[str, object]:
    """A P/D request under a ``cache_salt`` of its own: no prefix cache holds its blocks, so the prefill computes
    the whole prompt and the decode leg pulls all of its KV over the link."""
    body = PROMPT | {"cache_salt": salt}
    r = httpx.post(prefill.url + "/inference/v1/generate", json=prefill_body(body), timeout=120)
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params["remote_host"] == prefill.host.address  # the decode host pulls from the prefill host
    r = httpx.post(decode.url + "/inference/v1/generate", json=decode_body(body, "tokens", params), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_the_kv_crosses_the_link_and_a_slow_link_slows_the_pull(hosts: FleetHosts) -> None:
    a, b = hosts.hosts
    prefill = HostMember(a, "prefill", ["serve", *ENGINE, "--tokens-only", "--kv-role", "prefill",
                                        "--kv-host", a.address])
    decode = HostMember(b, "decode", ["serve", *ENGINE, "--kv-role", "decode", "--kv-host", b.address])
    try:
        for member in (prefill, decode):
            member.spawn()
        for member in (prefill, decode):
            member.wait_healthy(300)
        coupled = httpx.post(decode.url + "/inference/v1/generate", json=PROMPT, timeout=120).json()
        answers, seconds = [], []
        for pulls, slow in enumerate((False, True), start=1):
            if slow:
                a.slow_link(rate="1mbit")
            pulled, took = metric_sum(decode.url, "pdserve_kv_pulled_bytes_total"), \
                metric_sum(decode.url, "pdserve_kv_pull_seconds_sum")
            answers.append(hand_off(prefill, decode, f"pull-{pulls}")["choices"])
            # The engine core reports its counters with its heartbeat (every 0.5 s).
            wait_until(lambda n=pulls: metric_sum(decode.url, "pdserve_kv_pulls_ok_total") == n, f"{pulls} pull(s) counted")
            size = metric_sum(decode.url, "pdserve_kv_pulled_bytes_total") - pulled
            seconds.append(metric_sum(decode.url, "pdserve_kv_pull_seconds_sum") - took)
            assert size > 0
        assert answers[0] == answers[1] == coupled["choices"]
        # 1 mbit/s is 125 kB/s: the slowed pull takes at least the KV's size over that rate.
        assert seconds[1] >= size / 125_000 > seconds[0], seconds
    finally:
        a.clear_link()
        for member in (prefill, decode):
            member.stop()
