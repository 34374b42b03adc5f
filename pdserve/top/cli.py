"""``pdserve top URL``: flags and the refresh loop.

Only argparse is imported at module level: ``pdserve``'s parser imports :func:`add_top_args` for every
command, and httpx and the scraper are needed only when ``top`` runs.

On a terminal each refresh redraws the screen in place (cursor home, each line cleared to its end, the
rest of the screen cleared: no flicker, no scrollback growth) with lines cut to the terminal's width so
none wraps; anywhere else (a pipe, a log file) each refresh is a plain block of lines with no escape
codes, followed by a blank line.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from pdserve.top.scrape import FleetScrape

DEFAULT_INTERVAL_S = 2.0
DEFAULT_TIMEOUT_S = 1.0

# ANSI: cursor home, clear to the end of the line, clear to the end of the screen, clear all, cursor off/on.
HOME, CLEAR_LINE, CLEAR_BELOW, CLEAR_SCREEN = "\x1b[H", "\x1b[K", "\x1b[J", "\x1b[2J"
HIDE_CURSOR, SHOW_CURSOR = "\x1b[?25l", "\x1b[?25h"


def _positive(value: str) -> float:
    number = float(value)
    if not number > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value!r}")
    return number


def _url(value: str) -> str:
    if not value.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"expected the proxy's http(s):// URL, got {value!r}")
    return value.rstrip("/")


def add_top_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", type=_url, help="the proxy's base URL, e.g. http://127.0.0.1:8000 (its members are "
                   "found in its /metrics)")
    p.add_argument("--interval", type=_positive, default=DEFAULT_INTERVAL_S,
                   help="seconds between refreshes; rates and p50s cover this interval "
                   f"(default {DEFAULT_INTERVAL_S:g})")
    p.add_argument("--once", action="store_true",
                   help="print one snapshot and exit: totals and p50s since each process started")
    p.add_argument("--timeout", type=_positive, default=DEFAULT_TIMEOUT_S,
                   help="seconds to wait for each /metrics; slower is shown as unreachable "
                   f"(default {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--api-key", default=None, help="sent as a bearer token to the proxy and the members")


class Screen:
    """Writes each refresh to ``out``: redrawn in place on a terminal, appended as plain lines elsewhere."""

    def __init__(self, out: TextIO, tty: bool | None = None) -> None:
        self.out = out
        self.tty = out.isatty() if tty is None else tty
        self._started = False

    def show(self, lines: list[str]) -> None:
        if not self.tty:
            self.out.write("\n".join(lines) + "\n\n")
        else:
            width = shutil.get_terminal_size().columns
            prefix = "" if self._started else HIDE_CURSOR + CLEAR_SCREEN
            body = "".join(line[: max(width - 1, 1)] + CLEAR_LINE + "\n" for line in lines)
            self.out.write(prefix + HOME + body + CLEAR_BELOW)
        self._started = True
        self.out.flush()

    def close(self) -> None:
        if self.tty and self._started:
            self.out.write(SHOW_CURSOR)
            self.out.flush()


def watch(scrape: Callable[[], FleetScrape], proxy_url: str, screen: Screen, interval_s: float, once: bool,
          sleep: Callable[[float], None] = time.sleep, refreshes: int | None = None) -> int:
    """Scrape, render, wait ``interval_s``, until Ctrl-C (exit 0). ``once``: one snapshot, exit 1 if the
    proxy did not answer (a script can tell). ``refreshes`` bounds the loop (tests)."""
    from pdserve.top.view import build_snapshot, render_lines

    before: FleetScrape | None = None
    shown = 0
    try:
        while True:
            now = scrape()
            snapshot = build_snapshot(proxy_url, now, before)
            screen.show(render_lines(snapshot))
            shown += 1
            if once:
                return 0 if snapshot.proxy.reachable else 1
            if refreshes is not None and shown >= refreshes:
                return 0
            before = now
            sleep(max(interval_s - (time.monotonic() - now.at), 0.0))  # a steady cadence, scrape time included
    except KeyboardInterrupt:
        return 0
    finally:
        screen.close()


def run_top(args: argparse.Namespace, out: TextIO | None = None) -> int:
    from pdserve.top.scrape import FleetScraper

    stream = out if out is not None else sys.stdout
    try:
        with FleetScraper(args.url, timeout_s=args.timeout, api_key=args.api_key) as scraper:
            return watch(scraper.scrape, args.url, Screen(stream), args.interval, args.once)
    except KeyboardInterrupt:  # Ctrl-C while starting or closing, outside the loop's own handler
        return 0
    except BrokenPipeError:  # `pdserve top URL | head`: the reader left, which is not an error
        if stream is sys.stdout:  # Python would report the pipe again while flushing stdout at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
