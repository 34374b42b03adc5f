"""Real ``pdserve`` processes on loopback for e2e tests (the benchmark's launcher, plus test niceties)."""

from __future__ import annotations

from pdserve.bench.loadgen import ServerProcess as _Launcher


class ServerProcess(_Launcher):
    """``ServerProcess(*cli_args)`` started by ``with`` (or ``start()``); ``url`` once healthy."""

    def __init__(self, *args: str, api_key: str | None = None, startup_timeout: float = 120.0):
        self.api_key = api_key
        super().__init__("test", [*args, *(["--api-key", api_key] if api_key else [])])
        self._timeout = startup_timeout

    def start(self) -> ServerProcess:
        self.spawn()
        try:
            self.wait_healthy(self._timeout)
        except Exception:
            self.stop()
            raise
        return self

    def log(self) -> str:
        return self.log_tail(100_000)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
