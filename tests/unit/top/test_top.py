"""``pdserve top`` against a fake fleet: real loopback servers serving a proxy's and its members' /metrics,
their figures changed between scrapes."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from pdserve.cli import main
from pdserve.top.cli import CLEAR_LINE, HOME, Screen, watch
from pdserve.top.scrape import FleetScraper
from pdserve.top.view import Count, MemberRow, Snapshot, build_snapshot, render_lines

from .fleet import FakeProxy, Fleet, dead_url, silent_url


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    made = Fleet()
    yield made
    made.close()


def rows_by_url(snapshot: Snapshot) -> dict[tuple[str, str], MemberRow]:
    return {(r.pool, r.url): r for r in snapshot.members}


def test_two_scrapes_give_the_interval_p50s_counts_and_new_counts(fleet: Fleet) -> None:
    with FleetScraper(fleet.proxy.url, timeout_s=1.0) as scraper:
        before = scraper.scrape()
        fleet.traffic()
        now = scraper.scrape()
    snap = build_snapshot(fleet.proxy.url, now, before)
    assert snap.interval_s is not None and snap.interval_s > 0
    assert [(r.pool, r.url) for r in snap.members] == [
        ("render", fleet.render.url), ("prefill", fleet.prefill.url), ("decode", fleet.decode.url),
        ("decode", fleet.decode2.url), ("decode", fleet.dead),
    ]
    rows = rows_by_url(snap)
    prefill, decode, idle, dead = (rows["prefill", fleet.prefill.url], rows["decode", fleet.decode.url],
                                   rows["decode", fleet.decode2.url], rows["decode", fleet.dead])
    # The interval's 10 fast observations only, not the 100 slow ones before it (a p50 since start: 1.75 s).
    assert prefill.ttft_p50 == pytest.approx(0.175)  # (0.1, 0.25] bucket, rank 5 of 10
    assert decode.tpot_p50 == pytest.approx(0.0175)  # (0.01, 0.025]
    assert decode.kv_pull_p50 == pytest.approx(0.00375)  # (0.0025, 0.005]
    assert idle.ttft_p50 is None and idle.tpot_p50 is None and idle.kv_pull_p50 is None  # nothing new
    assert decode.kv_pulls is not None and (decode.kv_pulls.total, decode.kv_pulls.new) == (25, 5)
    assert decode.kv_pulls_failed is not None and decode.kv_pulls_failed.total == 0
    assert decode.kv_pulled_bytes is not None and decode.kv_pulled_bytes.new == 5 << 20
    assert (decode.healthy, decode.in_flight, decode.requests, decode.running, decode.waiting) == (True, 4, 4, 3, 1)
    assert (prefill.healthy, prefill.in_flight, prefill.requests) == (True, 1, 0)
    assert rows["render", fleet.render.url].running is None  # no engine: its column stays empty
    # The dead member: down in the proxy's rotation, its errors counted there, its own page unreachable.
    assert (dead.healthy, dead.reachable, dead.reason) == (False, False, "connection refused")
    assert (dead.errors.total, dead.errors.new) == (5, 2)
    assert dead.error_causes == {"unreachable": 5}
    proxy = snap.proxy
    assert proxy.running == 4
    assert proxy.requests is not None and (proxy.requests.total, proxy.requests.new) == (51, 10)
    assert proxy.requests_per_s == pytest.approx(10 / snap.interval_s)
    assert proxy.server_errors is not None and (proxy.server_errors.total, proxy.server_errors.new) == (1, 0)
    assert proxy.migrations is not None and proxy.migrations["moved"].total == 1
    assert proxy.leg_p50 is not None and list(proxy.leg_p50) == ["decode"]  # the only leg observed
    assert proxy.leg_p50["decode"] == pytest.approx(0.375)
    assert proxy.retries == Count(0.0, 0.0)  # none counted yet: the series is not even exported

    text = "\n".join(render_lines(snap))
    assert "new in the last" in text
    table = {line.split()[1]: line for line in text.splitlines() if line.startswith(("render ", "prefill ", "decode "))}
    assert table[fleet.dead].split()[2:] == ["down", "0", "5", "+2", "unreachable", "(connection", "refused)"]
    assert table[fleet.decode.url].split()[2:] == [
        "up", "4", "0", "4", "3", "1", "-", "18ms", "25", "+5", "0", "3.8ms", "25", "+5"]
    assert table[fleet.prefill.url].split()[2:7] == ["up", "1", "0", "0", "0"]
    assert "175ms" in table[fleet.prefill.url]
    assert f"decode {fleet.dead}: unreachable 5" in text
    assert "migrations 1 +1 moved" in text and "leg p50 decode 375ms" in text


def test_one_scrape_gives_totals_and_p50s_since_start(fleet: Fleet) -> None:
    fleet.traffic()
    with FleetScraper(fleet.proxy.url) as scraper:
        snap = build_snapshot(fleet.proxy.url, scraper.scrape())
    rows = rows_by_url(snap)
    assert snap.interval_s is None and snap.proxy.requests_per_s is None
    assert rows["prefill", fleet.prefill.url].ttft_p50 == pytest.approx(1 + 1.5 * 45 / 100)  # rank 55 of 110
    decode = rows["decode", fleet.decode.url]
    assert decode.kv_pulls is not None and (decode.kv_pulls.total, decode.kv_pulls.new) == (25, None)
    lines = render_lines(snap)
    assert "since start" in lines[0]
    assert not any(re.search(r" \+\d", line) for line in lines)  # no "+N" without a previous scrape


def test_a_member_that_never_answers_is_unreachable_after_the_timeout() -> None:
    proxy = FakeProxy()
    try:
        with silent_url() as silent:
            proxy.add("decode", silent)
            started = time.monotonic()
            with FleetScraper(proxy.url, timeout_s=0.3) as scraper:
                snap = build_snapshot(proxy.url, scraper.scrape())
            assert time.monotonic() - started < 3
        [row] = snap.members
        assert (row.healthy, row.reachable, row.reason) == (True, False, "timed out")
        assert "unreachable (timed out)" in "\n".join(render_lines(snap))
    finally:
        proxy.server.close()


def test_an_unreachable_proxy_is_said_and_once_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["top", dead_url(), "--once", "--timeout", "0.5"]) == 1
    out = capsys.readouterr().out
    assert "proxy  unreachable (connection refused)" in out


def test_once_prints_one_plain_block_and_exits_0(fleet: Fleet, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["top", fleet.proxy.url, "--once"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out
    assert out.count("pdserve top") == 1 and out.endswith("\n\n")
    for url in (fleet.render.url, fleet.prefill.url, fleet.decode.url, fleet.decode2.url, fleet.dead):
        assert url in out


def test_the_loop_prints_one_plain_block_per_refresh_with_the_interval_figures(fleet: Fleet) -> None:
    out = io.StringIO()
    pauses: list[float] = []

    def sleep(seconds: float) -> None:  # between the two refreshes: the interval's traffic
        pauses.append(seconds)
        fleet.traffic()

    with FleetScraper(fleet.proxy.url) as scraper:
        assert watch(scraper.scrape, fleet.proxy.url, Screen(out), 2.0, once=False, sleep=sleep, refreshes=2) == 0
    text = out.getvalue()
    assert "\x1b" not in text
    _, first, second = text.split("pdserve top")
    assert "since start" in first and "new in the last" in second
    assert "1.75s" in first and "1.75s" not in second  # TTFT: since start the slow history dominates
    assert "175ms" in second and "25 +5" in second
    assert len(pauses) == 1 and 1.0 < pauses[0] <= 2.0  # the interval less the scrape's time


def test_a_terminal_is_redrawn_in_place_and_ctrl_c_exits_0(fleet: Fleet) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Tty()

    def interrupted(seconds: float) -> None:
        raise KeyboardInterrupt

    with FleetScraper(fleet.proxy.url) as scraper:
        assert watch(scraper.scrape, fleet.proxy.url, Screen(out), 2.0, once=False, sleep=interrupted) == 0
    text = out.getvalue()
    assert HOME in text and CLEAR_LINE in text and text.endswith("\x1b[?25h")  # the cursor is given back


def test_ctrl_c_stops_the_command_with_exit_code_0(fleet: Fleet) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "top", fleet.proxy.url, "--interval", "0.1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline().startswith("pdserve top")  # it runs
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=10) == 0
        assert process.stderr is not None and "Traceback" not in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
