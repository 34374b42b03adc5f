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
    from pdserve.bench.interference import add_interference_args
    from pdserve.bench.kv_layout import add_kv_layout_args
    from pdserve.bench.multiturn import add_multiturn_args
    from pdserve.bench.scenarios import add_scenarios_args
    from pdserve.bench.serve_bench import add_serve_args
    from pdserve.conformance.runner import add_conformance_args
    from pdserve.proxy.cli import add_proxy_args
    from pdserve.schema import add_schema_args
    from pdserve.top.cli import add_top_args
    from pdserve.topology.cli import add_up_args

    parser = argparse.ArgumentParser(prog="pdserve", description="P/D generate server with inline text/derender output")
    sub = parser.add_subparsers(dest="command", required=True)
    add_server_commands(sub)
    bench = sub.add_parser("bench", help="benchmarks; numbers go to docs/benchmarks.md")
    benches = bench.add_subparsers(dest="bench", required=True)
    add_engine_args(benches.add_parser("engine", help="torch engine decode tok/s (batch 1, 8) and TTFT"))
    add_interference_args(benches.add_parser("interference", help="a long prompt arriving while streams decode: their "
                                             "ITL per --max-num-batched-tokens"))
    add_kv_layout_args(benches.add_parser("kv-layout", help="what paged KV would cost a decode step here, against the "
                                          "copies contiguous rows pay"))
    add_multiturn_args(benches.add_parser("multiturn", help="conversations with a shared system prompt: TTFT per turn "
                                          "(prefix caching), servers side by side"))
    add_serve_args(benches.add_parser("serve", help="streaming load generator (vllm bench serve's flags)"))
    add_scenarios_args(benches.add_parser("scenarios", help="every scenario side by side; rewrites docs/benchmarks.md"))
    add_conformance_args(sub.add_parser("conformance", help="check a server against the generate protocol's wire rules"))
    add_schema_args(sub.add_parser("schema", help="write JSON Schema for every wire type"))
    add_proxy_args(sub.add_parser("proxy", help="OpenAI front of a P/D topology: render, prefill leg, decode leg"))
    add_up_args(sub.add_parser("up", help="a local P/D topology: render, prefill and decode servers, the proxy "
                               "(unknown flags go to the prefill and decode servers)"))
    add_top_args(sub.add_parser("top", help="a live view of a proxy's fleet from its and its members' /metrics"))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "up":  # only `up` passes unknown flags on (to its servers)
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(
        level=getattr(args, "log_level", "warning").upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.command in ("serve", "launch"):
        return run_server_command(args)
    if args.command == "conformance":
        from pdserve.conformance.runner import run_conformance

        return run_conformance(args)
    if args.command == "schema":
        from pdserve.schema import run_schema

        return run_schema(args)
    if args.command == "proxy":
        from pdserve.proxy.cli import run_proxy

        return run_proxy(args)
    if args.command == "up":
        from pdserve.topology.cli import run_up

        return run_up(args, extra)
    if args.command == "top":
        from pdserve.top.cli import run_top

        return run_top(args)
    if args.bench == "engine":
        from pdserve.bench.engine import run_engine_bench_cli

        return run_engine_bench_cli(args)
    if args.bench == "interference":
        from pdserve.bench.interference import run_interference_cli

        return run_interference_cli(args)
    if args.bench == "kv-layout":
        from pdserve.bench.kv_layout import run_kv_layout_cli

        return run_kv_layout_cli(args)
    if args.bench == "multiturn":
        from pdserve.bench.multiturn import run_multiturn_cli

        return run_multiturn_cli(args)
    if args.bench == "serve":
        from pdserve.bench.serve_bench import run_serve_bench

        return run_serve_bench(args, (argv if argv is not None else sys.argv[1:])[2:])
    from pdserve.bench.scenarios import run_scenarios

    return run_scenarios(args)


if __name__ == "__main__":
    sys.exit(main())
