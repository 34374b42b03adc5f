"""Run every rule against one server, print one line per rule with its evidence, and give the exit code:
0 when nothing failed, 1 when a rule failed, 2 when the kit could not start (no model, no render)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TextIO

import httpx

from pdserve.conformance.rules import RULES, Rule
from pdserve.conformance.server import Failed, NotApplicable, Server, SetupError, Unsupported
from pdserve.conformance.wire import Wire

PASS, FAIL, UNSUPPORTED, NOT_APPLICABLE = "pass", "FAIL", "unsupported", "n/a"


@dataclass(frozen=True)
class Result:
    rule: Rule
    status: str
    evidence: str


def run_rule(server: Server, rule: Rule) -> Result:
    try:
        return Result(rule, PASS, rule.check(server))
    except Failed as e:
        return Result(rule, FAIL, str(e))
    except Unsupported as e:
        return Result(rule, UNSUPPORTED, str(e))
    except NotApplicable as e:
        return Result(rule, NOT_APPLICABLE, str(e))
    except (httpx.HTTPError, KeyError, TypeError, ValueError, IndexError) as e:
        # A malformed answer (a missing key, a wrong type, a dropped connection) breaks the rule too.
        return Result(rule, FAIL, f"{type(e).__name__}: {e}")


def run_all(server: Server, rules: Iterable[Rule], out: TextIO) -> list[Result]:
    results = []
    for rule in rules:
        result = run_rule(server, rule)
        results.append(result)
        print(f"{result.status:<11} {rule.id:<36} {rule.says}\n{'':<12}{result.evidence}", file=out, flush=True)
    return results


def add_conformance_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="the server's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument(
        "--parsers",
        nargs="*",
        default=[],
        help="the parsers the server runs (e.g. qwen3 hermes): enables the parser rules",
    )
    p.add_argument("--api-key", default=None)
    p.add_argument("--rule", action="append", default=None, help="run only this rule id (repeatable)")


def run_conformance(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    wire = Wire(args.url, api_key=args.api_key)
    try:
        server = Server.discover(wire, frozenset(args.parsers))
    except (SetupError, httpx.HTTPError) as e:
        print(f"pdserve conformance: cannot start: {e}", file=sys.stderr)
        return 2
    try:
        rules = [r for r in RULES if args.rule is None or r.id in args.rule]
        print(
            f"conformance of {args.url} (model {server.model!r}, parsers {sorted(server.parsers) or 'none'}): "
            f"{len(rules)} rules",
            file=out,
        )
        results = run_all(server, rules, out)
    finally:
        wire.close()
    counts = {s: sum(r.status == s for r in results) for s in (PASS, FAIL, UNSUPPORTED, NOT_APPLICABLE)}
    print("summary: " + ", ".join(f"{n} {s}" for s, n in counts.items()), file=out)
    return 1 if counts[FAIL] else 0
