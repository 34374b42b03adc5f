"""``pdserve`` command line: the server roles (:mod:`pdserve.serve.cli`) and ``bench``.

It sits above both the serve and bench packages, so neither imports the other.
"""

from __future__ import annotations

import argparse
import logging
import sys

from pdserve.serve.cli import add_server_commands, run_server_command


def build_parser() -> argparse.ArgumentParser:
    # Imported here, not at the top: spawned frontend processes re-import this module as their
    # __main__, and the bench modules (httpx clients, workloads) would only slow their start.
    from pdserve.bench.engine import add_engine_args
    from pdserve.bench.frontend import add_frontend_args

    parser = argparse.ArgumentParser(prog="pdserve", description="P/D generate server with inline text/derender output")
    sub = parser.add_subparsers(dest="command", required=True)
    add_server_commands(sub)
    bench = sub.add_parser("bench", help="benchmarks; numbers go to docs/benchmarks.md")
    benches = bench.add_subparsers(dest="bench", required=True)
    add_engine_args(benches.add_parser("engine", help="torch engine decode tok/s (batch 1, 8) and TTFT"))
    add_frontend_args(benches.add_parser("frontend", help="inline text/derender vs per-chunk /derender"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(args, "log_level", "warning").upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.command in ("serve", "launch"):
        return run_server_command(args)
    if args.bench == "engine":
        from pdserve.bench.engine import run_engine_bench_cli

        return run_engine_bench_cli(args)
    from pdserve.bench.frontend import run_frontend_bench

    return run_frontend_bench(args)


if __name__ == "__main__":
    sys.exit(main())
