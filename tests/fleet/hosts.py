"""Test hosts on one machine: network namespaces joined by a bridge, with pdserve members running "on" them.

Why: P/D's failures live between hosts (a KV pull over a real link, a partition, a slow link), and every
other P/D test runs on loopback. Each :class:`Host` is a network namespace with one interface (``eth0``) on a
bridge that lives in a namespace of its own (the switch); the test process reaches the hosts through one
more link from the root namespace to that bridge. Addresses come from 198.18.0.0/15, the block reserved
for network test benches: one /24 per harness, its third octet drawn at random so two harnesses on a machine
do not collide. A member runs under ``ip netns exec``, bound to its host's address (``--host``,
``--kv-host``), with ``UCX_TLS=tcp`` so that the KV it hands off crosses the link instead of a
shared-memory transport.

:class:`FleetHosts` creates only what it removes, removes it on exit even when the test failed (and at
interpreter exit, should the exit be skipped), and its members talk only to its own hosts and loopback.
It needs root and ``ip``/``tc`` (CI has both); :func:`require_namespaces` skips naming what is missing.

Faults (reference/fleet-testing.md: this kernel has no ``netem``): :meth:`Host.link_down` (partition),
:meth:`Host.slow_link` (a ``tbf`` rate limit), signals to a member's process group (hung, killed, drained).
"""

from __future__ import annotations

import atexit
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from pdserve.topology.process import ServerProcess

MEMBER_PORT = 8000  # every host has its own network namespace: the same port on each


def require_namespaces() -> None:
    """Skip the calling test, naming why, where test hosts cannot be made."""
    if os.geteuid() != 0:
        pytest.skip("test hosts need root (network namespaces); CI runs as root")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"test hosts need {' and '.join(missing)} (iproute2)")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class Host:
    """One test host: a network namespace, its address and its one link."""

    netns: str
    address: str
    bridge_side: str  # its link's other end, on the switch's bridge
    switch: str

    def run(self, *cmd: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """``cmd`` on this host."""
        return subprocess.run(["ip", "netns", "exec", self.netns, *cmd], check=False, capture_output=True,
                              text=True, timeout=timeout)

    def link_down(self) -> None:
        """A partition: nothing reaches this host or leaves it until :meth:`link_up`."""
        _ip("-n", self.switch, "link", "set", self.bridge_side, "down")

    def link_up(self) -> None:
        _ip("-n", self.switch, "link", "set", self.bridge_side, "up")

    def slow_link(self, rate: str = "1mbit", burst: str = "32kbit", latency: str = "400ms") -> None:
        """A slow link: what leaves this host is limited to ``rate`` (a ``tbf`` qdisc on its interface)."""
        subprocess.run(["tc", "-n", self.netns, "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", rate,
                        "burst", burst, "latency", latency], check=True, capture_output=True)

    def clear_link(self) -> None:
        subprocess.run(["tc", "-n", self.netns, "qdisc", "del", "dev", "eth0", "root"], check=False,
                       capture_output=True)


class HostMember(ServerProcess):
    """``pdserve ARGS`` on a test host, listening on the host's address (``url``), KV over TCP (UCX)."""

    def __init__(self, host: Host, name: str, args: Sequence[str], port: int = MEMBER_PORT,
                 env: dict[str, str] | None = None) -> None:
        super().__init__(name, [*args, "--host", host.address, "--port", str(port)], port=port, address=False)
        self.host = host
        self.url = f"http://{host.address}:{port}"
        settings = {"UCX_TLS": "tcp", **(env or {})}
        # ``ip netns exec`` and ``env`` exec what follows: the server keeps the pid and process group.
        self._cmd = ["ip", "netns", "exec", host.netns, "env", *(f"{k}={v}" for k, v in settings.items()),
                     *self._cmd]


@dataclass
class FleetHosts:
    """``count`` test hosts on one bridge, reachable from this process (see the module docstring)."""

    count: int
    hosts: list[Host] = field(default_factory=list)
    _tag: str = field(default_factory=lambda: f"{os.getpid() % 10000:04d}{random.randrange(100):02d}")
    _made: list[tuple[str, str]] = field(default_factory=list)  # ("netns" | "link", name), in creation order

    def __post_init__(self) -> None:
        self.subnet = f"198.18.{random.randrange(1, 255)}"

    @property
    def switch(self) -> str:
        return f"pdt{self._tag}sw"

    def __enter__(self) -> FleetHosts:
        atexit.register(self.remove)
        try:
            self._make()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(("netns", name))
        _ip("-n", name, "link", "set", "lo", "up")

    def _make(self) -> None:
        self._netns(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        # This process's link to the bridge (its end stays in the root namespace).
        root_end, switch_end = f"pdt{self._tag}r", f"pdt{self._tag}rs"
        _ip("link", "add", root_end, "type", "veth", "peer", "name", switch_end)
        self._made.append(("link", root_end))
        self._plug(switch_end)
        _ip("addr", "add", f"{self.subnet}.254/24", "dev", root_end)
        _ip("link", "set", root_end, "up")
        for i in range(self.count):
            netns, host_end, switch_end = f"pdt{self._tag}h{i}", f"pdt{self._tag}h{i}", f"pdt{self._tag}s{i}"
            self._netns(netns)
            _ip("link", "add", host_end, "type", "veth", "peer", "name", switch_end)
            _ip("link", "set", host_end, "netns", netns)
            self._plug(switch_end)
            _ip("-n", netns, "link", "set", host_end, "name", "eth0")
            address = f"{self.subnet}.{i + 1}"
            _ip("-n", netns, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", netns, "link", "set", "eth0", "up")
            self.hosts.append(Host(netns, address, switch_end, self.switch))

    def _plug(self, switch_end: str) -> None:
        _ip("link", "set", switch_end, "netns", self.switch)
        _ip("-n", self.switch, "link", "set", switch_end, "master", "br0")
        _ip("-n", self.switch, "link", "set", switch_end, "up")

    def remove(self) -> None:
        """Remove every namespace and link this harness made (deleting a namespace removes the links in it)."""
        while self._made:
            kind, name = self._made.pop()
            args = ["netns", "del", name] if kind == "netns" else ["link", "del", name]
            subprocess.run(["ip", *args], check=False, capture_output=True)
        atexit.unregister(self.remove)

    def leftovers(self) -> list[str]:
        """Namespaces or links of this harness that exist now (none once it is removed)."""
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        tag = f"pdt{self._tag}"
        return [line for line in (names + links).splitlines() if tag in line]


def python_on(host: Host, code: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Python ``code`` run on ``host`` (this interpreter)."""
    return host.run(sys.executable, "-c", code, timeout=timeout)
