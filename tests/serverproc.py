"""Start real ``pdserve`` processes on loopback for e2e tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A ``pdserve`` subprocess; ``url`` once healthy. Use as a context manager."""

    def __init__(self, *args: str, api_key: str | None = None, startup_timeout: float = 120.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self._args = list(args)
        self._timeout = startup_timeout
        self._log = tempfile.NamedTemporaryFile(prefix="pdserve-", suffix=".log", delete=False)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ServerProcess:
        cmd = [sys.executable, "-m", "pdserve.serve.cli", *self._args, "--port", str(self.port)]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        deadline = time.monotonic() + self._timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pdserve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"pdserve did not become healthy in {self._timeout}s:\n{self.log()}")

    def log(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
