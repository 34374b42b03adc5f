"""The proxy's routing under an uneven load: one decode host's link slowed with ``tbf``, ``--routing p2c``
against ``--routing round-robin`` over the same pools, in one ``pdserve bench serve`` run.

Hosts (network namespaces, tests/fleet/hosts.py; needs root): host 0 runs the render and prefill servers,
hosts 1 and 2 a decode server each, host 1's link limited to RATE. The two proxies run here, on loopback,
and reach the hosts over the harness's link. Torch engine, qwen3-tiny in float32.

    sudo .venv/bin/python scripts/bench_routing.py [--rate 256kbit] [--num-prompts 64] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.topology.process import ServerProcess, start_all, stop_all  # noqa: E402
from tests.fleet.hosts import FleetHosts, HostMember  # noqa: E402

ENGINE = ("qwen3-tiny", "--dtype", "float32", "--kv-transfer", "nixl")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", default="256kbit", help="the slowed decode host's link rate (tc tbf)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", default="8")
    p.add_argument("--result", default="/tmp/bench-routing.json")
    p.add_argument("--round-robin-first", action="store_true", help="run the round-robin arm first")
    args = p.parse_args()
    routings = ("round-robin", "p2c") if args.round_robin_first else ("p2c", "round-robin")
    with FleetHosts(3) as hosts:
        front, slow, fast = hosts.hosts
        members = [
            HostMember(front, "render", ["launch", "render", "--tokenizer", "qwen3"], port=8001),
            HostMember(front, "prefill", ["serve", *ENGINE, "--tokens-only", "--kv-role", "prefill",
                                          "--kv-host", front.address], port=8002),
            *(HostMember(h, f"decode-{i}", ["serve", *ENGINE, "--kv-role", "decode", "--kv-host", h.address])
              for i, h in enumerate((slow, fast))),
        ]
        render, prefill, *decodes = members
        pools = ["--render", render.url, "--prefill", prefill.url, "--decode", ",".join(d.url for d in decodes)]
        proxies = [ServerProcess(f"proxy-{r}", ["proxy", *pools, "--routing", r]) for r in routings]
        try:
            start_all(members, 300)
            start_all(proxies, 60)
            slow.slow_link(rate=args.rate)
            print(f"decode hosts: {decodes[0].url} (link {args.rate}), {decodes[1].url}; proxies: "
                  + ", ".join(f"{x.name} {x.url}" for x in proxies), flush=True)
            return subprocess.run([
                sys.executable, "-m", "pdserve.cli", "bench", "serve", *(f"--base-url={x.url}" for x in proxies),
                "--endpoint", "chat", "--render-url", render.url, "--max-concurrency", args.concurrency,
                "--num-prompts", str(args.num_prompts), "--num-warmups", "4", "--random-input-len", "128",
                "--random-output-len", "32", "--ignore-eos", "--no-server-cpu", "--save-result",
                "--result-filename", args.result, "--disable-tqdm",
            ], check=False).returncode
        finally:
            slow.clear_link()
            stop_all([*proxies, *members])


if __name__ == "__main__":
    sys.exit(main())
