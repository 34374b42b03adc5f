"""Starting the peers of the interop suite: a vLLM server (through scripts/vllm_cli.py, the console-script
workaround) and pdserve servers, on one shared model dir."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil

from pdserve.checkpoints.builtin import build_qwen3_tiny
from tests.serverproc import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
VLLM_CLI = ROOT / "scripts" / "vllm_cli.py"
MODEL_NAME = "qwen3-tiny"
MAX_MODEL_LEN = 2048
# fp32 on both sides: in bf16 the two engines' kernels round differently, and a random model's near-ties
# then flip greedy tokens; the comparisons are about the protocol, not about bf16 kernels.
DTYPE_ARGS = ("--dtype", "float32")
PARSER_ARGS = ("--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--enable-auto-tool-choice")
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
}


def build_shared_model_dir(out: Path) -> Path:
    build_qwen3_tiny(out, head_dim=32)
    return out


class VllmPeer(ServerProcess):
    """``vllm serve DIR --enable-scale-out`` on a free loopback port (healthy after ~60 s on 2 cores)."""

    def __init__(self, model_dir: Path, *args: str, env: dict[str, str] | None = None) -> None:
        super().__init__("vllm", startup_timeout=600.0)
        self._env = env or {}
        self._cmd = [
            sys.executable,
            str(VLLM_CLI),
            "serve",
            str(model_dir),
            "--served-model-name",
            MODEL_NAME,
            "--max-model-len",
            str(MAX_MODEL_LEN),
            *DTYPE_ARGS,
            "--enforce-eager",
            "--enable-scale-out",
            *args,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]

    def spawn(self) -> None:
        env = {**os.environ, **VLLM_ENV, **self._env, "PYTHONUNBUFFERED": "1"}
        with self.log_path.open("wb") as log:
            # Its own process group, as the launcher's children: stop() takes vLLM's engine core with it.
            self.proc = subprocess.Popen(self._cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)


def pdserve(model_dir: Path, *args: str) -> ServerProcess:
    """A pdserve server on the shared model dir, serving it under vLLM's model name."""
    return ServerProcess(
        "serve",
        str(model_dir),
        "--served-model-name",
        MODEL_NAME,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        *DTYPE_ARGS,
        *args,
        startup_timeout=600.0,
    )


def engine_core_beside_its_worker(server: ServerProcess) -> None:
    """Move the vLLM engine core of ``server`` (``--engine vllm``) onto its worker's CPUs.

    Why: vLLM binds its worker's OpenMP threads to all CPUs but the one it reserves for the engine core, and
    both processes busy-poll while a request runs. On a 2-CPU machine nothing is left for the frontend and the
    kernel's loopback work: measured here, one stream's chunks then stopped for up to 7 s and a TCP connect to
    the server waited as long (SYNs retried at 1, 3 and 7 s), in about half the streams. With the engine core
    on the worker's CPU, 4 streams of 4 ran steadily (a 2,035-token stream 8.5 s instead of 7.6). This is
    reference/vllm-peer.md's advice (pin the engine core and worker to one core), applied to the one server
    whose test races a running stream (the conformance kit's abort).
    """
    assert server.proc is not None
    children = psutil.Process(server.proc.pid).children(recursive=True)
    workers = [p for p in children if p.name().startswith("VLLM::Worker")]
    assert workers, f"no vLLM worker under pid {server.proc.pid}: {[p.name() for p in children]}"
    cpus = set(workers[0].cpu_affinity())
    for core in (p for p in children if p.name().startswith("VLLM::EngineCore")):
        for thread in core.threads():
            os.sched_setaffinity(thread.id, cpus)
