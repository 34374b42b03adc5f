"""pdserve and vLLM side by side, in one ``pdserve bench serve`` run (issue 11's measurement).

Both serve the same qwen3-tiny weights (head_dim 32, which vLLM-CPU's attention needs; fp32 on both), are
started pinned to CPU 0 (engines and their thread pools sized there), then have their API processes moved
to CPU 1, where the load generator runs too; so API-process CPU per token is read apart from the engines'.
Needs ``make vllm-env``. Usage::

    .venv/bin/python scripts/bench_vs_vllm.py [--num-prompts N] [--output-len N] [--concurrency 1,8] [-- EXTRA]

EXTRA goes to ``pdserve bench serve`` (e.g. ``--save-result --result-filename F``). With ``--bench multiturn``
the arms run ``pdserve bench multiturn`` instead (conversations with a shared system prompt: prefix caching),
and ``--baseline-args`` adds a pdserve arm from this tree with more flags (``--no-enable-prefix-caching``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from pdserve.bench.cpu import listeners

ROOT = Path(__file__).resolve().parents[1]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pdserve" / "bench-qwen3-tiny-hd32"
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", "PYTHONUNBUFFERED": "1"}
PARSERS = ["--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--enable-auto-tool-choice"]


def model_dir() -> Path:
    if not (CACHE / "config.json").is_file():
        from pdserve.checkpoints.builtin import build_qwen3_tiny

        CACHE.mkdir(parents=True, exist_ok=True)
        build_qwen3_tiny(CACHE, head_dim=32)
    return CACHE


def start(cmd: list[str], log: Path, env: dict[str, str], cwd: Path = ROOT) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(["taskset", "-c", "0", *cmd], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **env}, cwd=cwd)


def wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{url}: exited at startup; see {log}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    sys.exit(f"{url}: not healthy after {timeout_s:.0f}s; see {log}")


def move_api_processes(port: int, cpu: int) -> list[int]:
    """Pin the processes listening on ``port`` (the API servers) to ``cpu``, with all their threads."""
    pids = listeners(port)
    for pid in pids:
        subprocess.run(["taskset", "-a", "-p", "-c", str(cpu), str(pid)], check=True, capture_output=True)
    return pids


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--modes", default="tokens", help="generate output modes, comma-separated; vLLM 0.32's generate serves tokens and text, and its "
                             "derender arm is skipped (bench serve's preflight says why)")
    parser.add_argument("--pdserve-port", type=int, default=18810)
    parser.add_argument("--vllm-port", type=int, default=18811)
    parser.add_argument("--no-vllm", action="store_true", help="pdserve alone, pinned the same way")
    parser.add_argument("--model", default=None,
                        help="a HF model dir both servers load (default: qwen3-tiny with head_dim 32, built here); "
                             "e.g. ~/.cache/pdserve/models/smollm2-135m for the engines at a real model's pace")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--no-parsers", action="store_true",
                        help="serve without the qwen3 + hermes parsers (a model whose vocabulary lacks their tags)")
    parser.add_argument("--baseline-tree", type=Path, default=None,
                        help="also serve pdserve from this checkout (another commit's worktree), pinned the same way, "
                             "for a before/after arm in the same run")
    parser.add_argument("--baseline-port", type=int, default=18812)
    parser.add_argument("--baseline-args", default=None,
                        help="also serve pdserve from this tree with these extra flags (space-separated), pinned the same way")
    parser.add_argument("--bench", choices=("serve", "multiturn"), default="serve")
    parser.add_argument("extra", nargs="*")
    args = parser.parse_args()
    if not VLLM_PY.is_file() and not args.no_vllm:
        sys.exit("no .venv-vllm: run `make vllm-env` first")
    model = str(Path(args.model).expanduser()) if args.model else str(model_dir())
    # Room for the longest output plus a prompt of bench serve's random dataset.
    max_model_len = str(max(2048, args.output_len + 1024))
    parsers = [] if args.no_parsers else PARSERS
    name = Path(model).name if args.model else "qwen3-tiny"
    common = ["--served-model-name", name, "--max-model-len", max_model_len, "--dtype", args.dtype,
              "--max-num-seqs", "16", *parsers, "--host", "127.0.0.1"]
    if args.bench == "multiturn":
        common.append("--enable-prompt-tokens-details")  # both report the positions read from the prefix cache
    pd_log, vllm_log = Path("/tmp/bench-vs-vllm-pdserve.log"), Path("/tmp/bench-vs-vllm-vllm.log")
    servers = [start([sys.executable, "-m", "pdserve.cli", "serve", model, *common, "--port", str(args.pdserve_port)],
                     pd_log, {})]
    ports, logs_of, labels = [args.pdserve_port], [pd_log], ["pdserve"]
    if args.baseline_tree is not None:
        base_log = Path("/tmp/bench-vs-vllm-baseline.log")
        servers.append(start([sys.executable, "-m", "pdserve.cli", "serve", model, *common, "--port",
                              str(args.baseline_port)], base_log, {}, cwd=args.baseline_tree.resolve()))
        ports.append(args.baseline_port)
        logs_of.append(base_log)
        labels.append("pdserve (baseline tree)")
    if args.baseline_args is not None:
        base_log = Path("/tmp/bench-vs-vllm-baseline.log")
        servers.append(start([sys.executable, "-m", "pdserve.cli", "serve", model, *common, *args.baseline_args.split(),
                              "--port", str(args.baseline_port)], base_log, {}))
        ports.append(args.baseline_port)
        logs_of.append(base_log)
        labels.append(f"pdserve {args.baseline_args}")
    if not args.no_vllm:
        servers.append(start([str(VLLM_PY), str(ROOT / "scripts" / "vllm_cli.py"), "serve", model, *common,
                              "--enforce-eager", "--enable-scale-out", "--port", str(args.vllm_port)],
                             vllm_log, VLLM_ENV))
        ports.append(args.vllm_port)
        logs_of.append(vllm_log)
        labels.append("vLLM")
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    try:
        for url, proc, log in zip(urls, servers, logs_of, strict=True):
            wait_healthy(url, proc, log)
        for port in ports:
            print(f"API processes on :{port} moved to CPU 1: {move_api_processes(port, 1)}", flush=True)
        arms = [a for u in urls for a in ("--base-url", u)]
        if args.bench == "multiturn":
            bench = [sys.executable, "-m", "pdserve.cli", "bench", "multiturn", *arms, "--label", ",".join(labels),
                     *args.extra]
        else:
            bench = [sys.executable, "-m", "pdserve.cli", "bench", "serve", *arms,
                     "--endpoint", "generate", "--output-mode", args.modes, "--max-concurrency", args.concurrency,
                     "--num-prompts", str(args.num_prompts), "--random-output-len", str(args.output_len),
                     "--ignore-eos", "--disable-tqdm", *args.extra]
        return subprocess.run(["taskset", "-c", "1", *bench], check=False).returncode
    finally:
        for proc in servers:
            proc.terminate()
        for proc in servers:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    raise SystemExit(main())
