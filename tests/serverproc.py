"""Real ``pdserve`` processes on loopback for e2e tests (the benchmark's launcher, plus test niceties)."""

from __future__ import annotations

import re

import httpx

from pdserve.bench.servers import ServerProcess as _Launcher


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

    def metric(self, name: str, missing: float | None = None, via: httpx.Client | None = None) -> float:
        """The value of one ``/metrics`` sample, ``name`` written as exposed (labels included).

        A labelled counter has no sample until it is first counted: pass ``missing=0`` for it,
        so that a misspelt name still fails everywhere else. ``via``: ask over that client's
        open connection (with several frontends, that is how to ask one particular process).
        """
        url = self.url + "/metrics"
        if via is None:
            text = httpx.get(url, headers=self.headers, timeout=10).text
        else:
            text = via.get(url, headers=self.headers, timeout=10).text
        found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        if found is None and missing is not None:
            return missing
        assert found, f"{name} missing from /metrics"
        return float(found.group(1))

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
