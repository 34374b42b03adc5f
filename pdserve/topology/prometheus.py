"""``pdserve up --prometheus``: a Prometheus scrape configuration for every member of the topology, written
into its run directory, and a Prometheus beside the fleet where the ``prometheus`` binary is installed.

Why a real Prometheus: ``pdserve top`` shows the fleet now, Prometheus keeps its history, and the Grafana
dashboard (``deploy/grafana/pdserve.json``) reads the labels this configuration sets. Every target carries
``pool`` (``render``, ``prefill``, ``decode``, ``proxy``) and ``member`` (``decode-0``), so panels group by
pool. The proxy's job honours the labels it exports: its per-member series already have a ``pool`` label
(the pool of the member the proxy sent a request to), which the target's ``pool="proxy"`` would otherwise
rename to ``exported_pool``; its other series take ``pool="proxy"``. Only the proxy sits behind ``--api-key``
(the servers listen on loopback without one): its job authenticates with a bearer token read from a file
beside the configuration (mode 0600), so the configuration itself holds no secret.

The configuration is JSON, which is YAML too (Prometheus reads it as such): written without a YAML
library, with every string quoted correctly.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from pdserve.topology.members import MemberSpec
from pdserve.topology.process import LOOPBACK, ServerProcess, free_port

SCRAPE_INTERVAL = "1s"  # a short interval: a panel moves seconds after traffic, on a fleet that lives minutes
INSTALL_HINT = "apt-get install -y --no-install-recommends prometheus"
JOB_PREFIX = "pdserve-"


def scrape_config(specs: list[MemberSpec], key_file: Path | None) -> dict[str, Any]:
    """One job per role (``pdserve-render``, ..., ``pdserve-proxy``), one target per member, labelled
    as the module docstring says; ``key_file``: the proxy's bearer token, if it has an API key."""
    jobs: dict[str, dict[str, Any]] = {}
    for spec in specs:
        job = jobs.setdefault(spec.role, {"job_name": JOB_PREFIX + spec.role, "static_configs": []})
        job["static_configs"].append({"targets": [f"{LOOPBACK}:{spec.port}"],
                                      "labels": {"pool": spec.role, "member": spec.name}})
        if spec.role == "proxy":
            job["honor_labels"] = True
            if key_file is not None:
                job["authorization"] = {"type": "Bearer", "credentials_file": str(key_file)}
    return {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "scrape_timeout": SCRAPE_INTERVAL,
                   "evaluation_interval": SCRAPE_INTERVAL},
        "scrape_configs": list(jobs.values()),
    }


def write_config(specs: list[MemberSpec], directory: Path, api_key: str | None) -> Path:
    """``directory/prometheus.yml`` (and ``directory/proxy-api-key``, mode 0600, with an API key); its path."""
    directory.mkdir(parents=True, exist_ok=True)
    key_file = None
    if api_key is not None:
        key_file = directory / "proxy-api-key"
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(api_key)
    config = directory / "prometheus.yml"
    config.write_text(json.dumps(scrape_config(specs, key_file), indent=2) + "\n")
    return config


class PrometheusProcess(ServerProcess):
    """The ``prometheus`` binary as a member-like child: its own process group, its log beside the members'
    logs, healthy once ``/-/ready`` answers 200, stopped with the fleet (SIGTERM: it flushes its data)."""

    def __init__(self, binary: str, config: Path, data_dir: Path, log_path: Path, port: int) -> None:
        super().__init__("prometheus", (), port=port, address=False, log_path=log_path)
        self._cmd = [binary, f"--config.file={config}", f"--storage.tsdb.path={data_dir}",
                     f"--web.listen-address={LOOPBACK}:{port}"]

    def is_healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/-/ready", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False


@dataclass(frozen=True)
class Monitoring:
    """What ``--prometheus`` set up: the configuration, and the process to start or why there is none."""

    config: Path
    process: PrometheusProcess | None
    not_started: str = ""  # why ``process`` is None


def prepare(specs: list[MemberSpec], run_dir: Path, api_key: str | None, binary: str | None) -> Monitoring:
    """Write the configuration under ``run_dir/prometheus``; a Prometheus on a free loopback port (not
    started) if ``binary`` (the ``prometheus`` found on PATH) is not None."""
    directory = run_dir / "prometheus"
    config = write_config(specs, directory, api_key)
    if binary is None:
        return Monitoring(config, None, f"no prometheus binary on PATH (Debian: {INSTALL_HINT})")
    return Monitoring(config, PrometheusProcess(binary, config, directory / "data", run_dir / "prometheus.log",
                                                free_port()))
