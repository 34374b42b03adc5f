"""free_port: loopback ports below the kernel's ephemeral range, each handed out once, free when picked."""

from __future__ import annotations

import random
import socket

import pytest

from pdserve.topology import process
from pdserve.topology.process import FREE_PORT_FLOOR, free_port


def test_ports_are_below_the_ephemeral_range_distinct_and_bindable() -> None:
    ceiling = process._ephemeral_floor()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(FREE_PORT_FLOOR <= port < ceiling for port in ports)
    for port in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_or_handed_out_before_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        busy = listener.getsockname()[1]
        given = free_port()
        picks = iter([busy, given, FREE_PORT_FLOOR + 7])
        monkeypatch.setattr(random, "randrange", lambda low, high: next(picks))
        monkeypatch.setattr(process, "_ephemeral_floor", lambda: 65000)  # the listener's port is in range
        assert free_port() == FREE_PORT_FLOOR + 7  # neither the busy port nor the one handed out already
