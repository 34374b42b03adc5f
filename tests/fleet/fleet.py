"""The fault suite's fleet: 2 prefill and 2 decode members on four test hosts, the render server and the
proxies (``--mode inline`` and ``--mode derender-tier``) on a fifth (tests/fleet/hosts.py), KV over TCP
between hosts. Used by tests/fleet/test_faults.py and the fleet soak (tests/soak/test_fleet_soak.py)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from tests.broken_streams import WEATHER
from tests.fleet.hosts import MEMBER_PORT, FleetHosts, Host, HostMember, require_namespaces
from tests.serverproc import metric_sum, samples_sum
from tests.waiting import wait_until

MODEL = "qwen3-tiny"
LEASE_S = 10.0
PULL_TIMEOUT_S = 5.0
# float32 and --batch-invariant: a request's bits do not depend on what else runs (a prompt prefilled in a
# batch, a sequence decoded among others, docs/engine.md), so its greedy answer under load (the soak, fault
# (g)) is the one it gets alone, even where qwen3-tiny's near-uniform logits nearly tie.
ENGINE = (MODEL, "--dtype", "float32", "--batch-invariant", "--kv-transfer", "nixl", "--kv-lease-s", str(LEASE_S),
          "--kv-pull-timeout-s", str(PULL_TIMEOUT_S))
PARSERS = ("--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--enable-auto-tool-choice")
STALL_S = 2.0
STREAM = {"max_tokens": 300, "ignore_eos": True, "temperature": 0, "stream": True,
          "stream_options": {"include_usage": True}, "return_token_ids": True}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER]} | STREAM
COMPLETION = {"model": MODEL, "prompt": "Tell me about Paris."} | STREAM


class Fleet:
    """The members on their hosts, the proxies, and what a fault test needs to break and mend them."""

    def __init__(self, hosts: FleetHosts):
        p0, p1, d0, d1, front = hosts.hosts
        self.front = front
        self.prefills = [self._member(h, "prefill", "--tokens-only", "--kv-role", "prefill") for h in (p0, p1)]
        self.decodes = [self._member(h, "decode", "--kv-role", "decode", *PARSERS) for h in (d0, d1)]
        self.render = HostMember(front, "render", ["launch", "render", "--tokenizer", model_dir(), *PARSERS])
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
        running = wait_until(lambda: [d for d in self.decodes if metric(d, "pdserve_running_requests") == 1],
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
                wait_until(lambda m=member, g=gauge: metric(m, g) == 0, f"{gauge} of {member.url} at 0",
                           bound_s=LEASE_S + 5)
        for proxy in self.proxies.values():
            wait_until(lambda p=proxy: metric(p, "pdserve_proxy_running_requests") == 0, "the proxy idle")
        return time.monotonic() - start


def metric(member: HostMember, name: str) -> float:
    try:
        return metric_sum(member.url, name)
    except httpx.HTTPError:
        return -1.0  # not answering (stopped, restarting): not 0


def metric_on_host(member: HostMember, name: str) -> float:
    """:func:`metric` read on the member's own host (over its loopback, not its link): a fault test that
    slows a host's link must not put its own scrapes on it, where they queue before the traffic under test
    and lose packets to the rate limit (TCP then backs off for seconds before that traffic moves again)."""
    got = member.host.run("curl", "--silent", "--fail", "--max-time", "10", member.url + "/metrics", timeout=15)
    if got.returncode != 0:
        return -1.0
    return samples_sum(got.stdout, name, where=member.url)


def model_dir() -> str:
    from pdserve.checkpoints.resolve import resolve_model

    return str(resolve_model(MODEL))


@contextmanager
def running_fleet() -> Iterator[Fleet]:
    """The fleet on fresh hosts, everything it made removed afterwards."""
    require_namespaces()
    with FleetHosts(5) as hosts:
        made = Fleet(hosts)
        try:
            made.start()
            yield made
        finally:
            made.stop()
    assert hosts.leftovers() == []
