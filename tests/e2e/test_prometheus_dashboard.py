"""``pdserve up --prometheus`` and the Grafana dashboard (deploy/grafana/pdserve.json) against a real Prometheus.

Grafana is not packaged here, so the dashboard is checked where its numbers come from: a real ``pdserve up``
fleet (qwen3-tiny, P/D with NIXL KV pulls, the proxy behind an API key) runs with the Prometheus ``up`` starts
beside it; traffic goes through the proxy in two rounds (so every labelled series exists in one scrape and has
grown by the next: ``rate`` sees an increase), and then every target expression of every panel, with the
dashboard's variables substituted as Grafana would, goes through Prometheus' ``/api/v1/query`` and must return
at least one finite sample. Where the ``prometheus`` binary is missing, the tests that need it skip and say how
to install it.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from pdserve.topology.members import MemberSpec
from pdserve.topology.plan import TopologyRequest, plan
from pdserve.topology.prometheus import INSTALL_HINT, prepare
from pdserve.topology.supervise import monitoring_lines
from tests.upproc import Up, alive, start_up
from tests.waiting import wait_until

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "pdserve.json"
MODEL = "qwen3-tiny"
API_KEY = "dashboard-test-key"
POOLS = {"render", "prefill", "decode", "proxy"}
# Grafana's $__rate_interval is at least four scrape intervals; a minute spans both traffic rounds of this test.
RATE_INTERVAL = "1m"
PROMETHEUS_LINE = re.compile(r"^  prometheus\s+(http://\S+)\s+pid (\d+)$", re.MULTILINE)
SCRAPE_LINE = re.compile(r"^  scrape\s+(\S+)$", re.MULTILINE)
# A system prompt of several KV blocks, the same in every chat: the prefix cache hit rate panel has hits to show.
MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You are a painter who answers in one short line. " * 8},
    {"role": "user", "content": "Name three colours."},
]

needs_prometheus = pytest.mark.skipif(
    shutil.which("prometheus") is None or shutil.which("promtool") is None,
    reason=f"needs Debian's prometheus package (the prometheus and promtool binaries): {INSTALL_HINT}",
)


def _specs() -> list[MemberSpec]:
    return plan(TopologyRequest(model=MODEL, tokenizer_dir="/models/q", prefill=1, decode=2), lambda k: 9000 + k)


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())  # type: ignore[no-any-return]


def panel_queries(dashboard: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(panel title, refId, expression) for every target, each variable replaced as Grafana does with "All"
    selected (a query variable's allValue) and ``$__rate_interval`` set to :data:`RATE_INTERVAL`."""
    values = {"__rate_interval": RATE_INTERVAL}
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            values[var["name"]] = var["allValue"]

    def substitute(expr: str) -> str:
        return re.sub(r"\$\{?(\w+)\}?", lambda m: values[m.group(1)], expr)

    return [(panel["title"], target["refId"], substitute(target["expr"]))
            for panel in dashboard["panels"] for target in panel["targets"]]


def query(prometheus: str, expr: str) -> list[dict[str, Any]]:
    answer = httpx.get(prometheus + "/api/v1/query", params={"query": expr}, timeout=10).json()
    assert answer["status"] == "success", (expr, answer)
    return answer["data"]["result"]  # type: ignore[no-any-return]


def scalar(prometheus: str, expr: str) -> float:
    result = query(prometheus, expr)
    return float(result[0]["value"][1]) if result else 0.0


def test_the_dashboard_is_importable_into_grafana() -> None:
    """What Grafana 10's import needs: unique panel ids and refIds, and every query on the ``datasource``
    variable (so the importer picks the Prometheus), none on a fixed datasource uid."""
    dashboard = _dashboard()
    variables = {var["name"]: var for var in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        refs = [target["refId"] for target in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for item in (panel, *panel["targets"]):
            assert item["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]


def test_without_the_binary_the_configuration_is_written_and_up_says_why(tmp_path: Path) -> None:
    monitoring = prepare(_specs(), tmp_path, API_KEY, binary=None)
    assert monitoring.process is None and monitoring.config == tmp_path / "prometheus" / "prometheus.yml"
    lines = "\n".join(monitoring_lines(monitoring))
    assert "prometheus not started: no prometheus binary on PATH" in lines and INSTALL_HINT in lines
    assert str(monitoring.config) in lines
    jobs = {job["job_name"]: job for job in json.loads(monitoring.config.read_text())["scrape_configs"]}
    assert sorted(jobs) == ["pdserve-decode", "pdserve-prefill", "pdserve-proxy", "pdserve-render"]
    assert [c["labels"] for c in jobs["pdserve-decode"]["static_configs"]] == [
        {"pool": "decode", "member": "decode-0"}, {"pool": "decode", "member": "decode-1"}]
    # The key is in a file only Prometheus' user reads, never in the configuration.
    key_file = Path(jobs["pdserve-proxy"]["authorization"]["credentials_file"])
    assert key_file.read_text() == API_KEY and API_KEY not in monitoring.config.read_text()
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert not any("authorization" in job for name, job in jobs.items() if name != "pdserve-proxy")


@needs_prometheus
def test_promtool_accepts_the_configuration(tmp_path: Path) -> None:
    config = prepare(_specs(), tmp_path, API_KEY, binary=None).config
    checked = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True, text=True, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[Up, str]]:
    """The fleet and its Prometheus' URL."""
    topology, _ = start_up(MODEL, "--port", "0", "--prometheus", "--api-key", API_KEY)
    try:
        found = PROMETHEUS_LINE.search(topology.output)
        assert found, f"pdserve up printed no prometheus line:\n{topology.output}"
        yield topology, found.group(1)
    finally:
        topology.stop()


def _traffic(client: openai.OpenAI) -> None:
    """A chat stream, a batch chat and a batch completion, all P/D: a prefill leg, a KV pull, a decode leg."""
    for _ in client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, stream=True):
        pass
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8)
    client.completions.create(model=MODEL, prompt="The colours of the rainbow are", max_tokens=8)


def _scraped_requests(prometheus: str) -> float:
    return scalar(prometheus, 'sum(pdserve_proxy_requests_total{job="pdserve-proxy"})')


@needs_prometheus
def test_every_member_is_scraped_with_its_pool(fleet: tuple[Up, str]) -> None:
    topology, prometheus = fleet
    config = SCRAPE_LINE.search(topology.output)
    assert config and Path(config.group(1)).is_file(), topology.output

    def targets() -> list[dict[str, Any]]:
        active = httpx.get(prometheus + "/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
        return active if len(active) == 4 and all(t["health"] == "up" for t in active) else []

    active = wait_until(targets, "Prometheus scrapes all four members (the proxy with its bearer token)")
    assert {(t["labels"]["pool"], t["labels"]["member"]) for t in active} == {
        ("render", "render"), ("prefill", "prefill-0"), ("decode", "decode-0"), ("proxy", "proxy")}
    # The dashboard's pool variable, label_values(up{job=~"pdserve-.*"}, pool):
    pools = httpx.get(prometheus + "/api/v1/label/pool/values", params={"match[]": 'up{job=~"pdserve-.*"}'},
                      timeout=10).json()["data"]
    assert set(pools) == POOLS
    # The proxy's per-member series keep the pool of the member they describe (its job honours their labels).
    members = query(prometheus, "count by (pool) (pdserve_proxy_member_healthy)")
    assert {sample["metric"]["pool"] for sample in members} == POOLS - {"proxy"}


@needs_prometheus
def test_every_panel_query_returns_data_after_traffic(fleet: tuple[Up, str]) -> None:
    topology, prometheus = fleet
    client = openai.OpenAI(base_url=topology.members["proxy"][0] + "/v1", api_key=API_KEY, max_retries=0)
    _traffic(client)  # round one: every series the traffic makes appears in a scrape...
    wait_until(lambda: _scraped_requests(prometheus) >= 3, "Prometheus scraped the first round of requests")
    _traffic(client)  # ...and round two makes it grow, so rate() over it is not 0
    _traffic(client)
    wait_until(lambda: _scraped_requests(prometheus) >= 9, "Prometheus scraped the second round of requests")
    empty = []
    for title, ref, expr in panel_queries(_dashboard()):
        assert "$" not in expr, (title, ref, expr)
        values = [float(sample["value"][1]) for sample in query(prometheus, expr)]
        if not any(math.isfinite(v) for v in values):
            empty.append(f"{title} [{ref}]: {expr} -> {values}")
    assert empty == [], "panels with no finite sample:\n" + "\n".join(empty)
    hit_rate = next(expr for title, _, expr in panel_queries(_dashboard()) if title.startswith("Prefix cache"))
    rates = {sample["metric"]["pool"]: float(sample["value"][1]) for sample in query(prometheus, hit_rate)}
    assert rates["prefill"] > 0, rates  # the repeated system prompt came from the cache


@needs_prometheus
def test_prometheus_stops_with_the_fleet(fleet: tuple[Up, str]) -> None:
    topology, prometheus = fleet
    found = PROMETHEUS_LINE.search(topology.output)
    assert found
    pid = int(found.group(2))
    topology.stop()
    assert topology.proc.returncode == 0 and "stopped" in topology.output
    wait_until(lambda: not alive(pid), f"Prometheus (pid {pid}) is gone")
    with pytest.raises(httpx.ConnectError):
        httpx.get(prometheus + "/-/ready", timeout=2)
