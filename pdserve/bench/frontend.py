"""``pdserve bench frontend``: inline output vs the per-chunk ``/derender`` round trip, side by side.

The RFC claims that a decode server returning text (``output_mode="text"``) or
parsed chat deltas (``output_mode="derender"``) beats the vLLM baseline, where
the client streams ``tokens`` and POSTs every SSE chunk to a stateless derender
server that replays the output so far on each call. This module is the command
line; the jobs live next to it:

* :mod:`pdserve.bench.servers`: server processes and their CPU; :mod:`pdserve.bench.workload`: the scripts;
* :mod:`pdserve.bench.loadgen`: the five client arms;
* :mod:`pdserve.bench.verify`: every output checked against its script and the other arms;
* :mod:`pdserve.bench.orchestrate`: both servers, warm-up, rounds → cells → arms;
* :mod:`pdserve.bench.writeup`: ratios, tables, prose and JSON from one run's numbers;
* docs/benchmark-methodology.md: what each number means and why the method is what it is.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from pdserve.bench.loadgen import Arm
from pdserve.bench.orchestrate import DEFAULT_PROFILE, QUICK_PROFILE, Profile, run
from pdserve.bench.report import write_section
from pdserve.bench.servers import BenchError
from pdserve.bench.writeup import command_line, docs_section, pair_ratios, result_json

SECTION_HEADING = "## Inline vs per-chunk derender (pdserve bench frontend)"
DEFAULT_DOCS = Path("docs/benchmarks.md")


def _int_list(value: str) -> tuple[int, ...]:
    try:
        items = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from None
    if not items or any(v < 1 for v in items):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {value!r}")
    return items


def _arm_list(value: str) -> tuple[Arm, ...]:
    names = {a.name.lower(): a for a in Arm}
    try:
        arms = tuple(names[v.strip().lower()] for v in value.split(",") if v.strip())
    except KeyError as e:
        raise argparse.ArgumentTypeError(f"unknown arm {e.args[0]!r}; choose from {', '.join(names)}") from None
    if not arms:
        raise argparse.ArgumentTypeError("--arms selects no arm")
    return arms


def add_frontend_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``pdserve bench frontend``; unset ones come from the default or the ``--quick`` profile."""
    d = DEFAULT_PROFILE
    parser.add_argument("--quick", action="store_true",
                        help="sub-minute smoke run (tiny outputs, 1-2 requests per arm); writes docs only with --docs")
    parser.add_argument("--lengths", type=_int_list, help=f"output lengths in tokens, comma-separated "
                        f"(default {','.join(map(str, d.lengths))})")
    parser.add_argument("--concurrency", type=_int_list, help="concurrent streams per cell, comma-separated "
                        f"(default {','.join(map(str, d.concurrency))})")
    parser.add_argument("--rounds", type=int, help=f"rounds; each runs every arm in every cell (default {d.rounds})")
    parser.add_argument("--step-ms", type=float, help=f"scripted engine pace in ms per token (default {d.step_ms:g})")
    parser.add_argument("--scripts-per-length", type=int,
                        help=f"distinct outputs per length (default {d.scripts_per_length})")
    parser.add_argument("--time-budget-s", type=float, help="start no new round this many seconds after the warm-up "
                        f"(default {d.time_budget_s:g}); round 1 always completes")
    parser.add_argument("--arms", type=_arm_list, default=tuple(Arm),
                        help="comma-separated subset of: " + ", ".join(a.name.lower() for a in Arm))
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--request-timeout-s", type=float, default=300.0, help="per HTTP request")
    parser.add_argument("--json", type=Path, default=None, help="also write the raw results as JSON here")
    parser.add_argument("--docs", type=Path, default=None,
                        help=f"markdown file whose '{SECTION_HEADING.removeprefix('## ')}' section is replaced "
                        f"(default {DEFAULT_DOCS}, or none with --quick)")
    parser.add_argument("--no-docs", action="store_true", help="do not write any docs file")


def resolve_profile(args: argparse.Namespace) -> Profile:
    """The profile (``--quick`` or default) with every explicitly given flag applied on top."""
    base = QUICK_PROFILE if args.quick else DEFAULT_PROFILE
    profile = Profile(
        lengths=args.lengths or base.lengths,
        concurrency=args.concurrency or base.concurrency,
        rounds=base.rounds if args.rounds is None else args.rounds,
        step_ms=base.step_ms if args.step_ms is None else args.step_ms,
        scripts_per_length=base.scripts_per_length if args.scripts_per_length is None else args.scripts_per_length,
        time_budget_s=base.time_budget_s if args.time_budget_s is None else args.time_budget_s,
    )
    if profile.rounds < 1 or profile.scripts_per_length < 1 or profile.step_ms < 0:
        raise BenchError("--rounds and --scripts-per-length must be >= 1 and --step-ms >= 0")
    return profile


def run_frontend_bench(args: argparse.Namespace) -> int:
    """Run the benchmark, print the section, write docs/JSON. 0 on success, 1 when the run failed."""
    try:
        profile = resolve_profile(args)
        command = command_line(profile, args.arms, args.seed)
        print(f"running: {command}", flush=True)
        result = run(profile, tuple(args.arms), args.seed, args.request_timeout_s)
    except BenchError as e:
        print(f"pdserve bench frontend: FAILED: {e}", file=sys.stderr)
        return 1
    ratios = pair_ratios(result)
    section = docs_section(result, command, ratios)
    print(SECTION_HEADING + "\n\n" + section)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result_json(result, command, ratios), indent=2))
        print(f"wrote {args.json}")
    docs = None if args.no_docs else (args.docs or (None if args.quick else DEFAULT_DOCS))
    if docs is not None:
        write_section(docs, SECTION_HEADING, section)
        print(f"wrote {docs}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench frontend",
                                     description="inline output vs per-chunk derender, side by side")
    add_frontend_args(parser)
    return run_frontend_bench(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
