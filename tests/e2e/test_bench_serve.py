"""``pdserve bench serve`` against a scripted server of known pace: the metrics must match the script.

The scripted engine emits one token every ``--step-ms``, so every request's TPOT is at least that step
(the engine sleeps it), and a one-hop client's TPOT matches the pace the server itself reports
(``--enable-per-request-metrics``); token counts are exact (``max_tokens`` below the script's length ends
every request by length). Correctness of the instrument, not speed.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.serverproc import ServerProcess

STEP_MS = 10.0
MAX_TOKENS = 12
NUM_PROMPTS = 3
ARMS = ["tokens", "text", "derender", "chat", "completions", "tokens + /derender (chat) per chunk"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str, Path]:
    tmp = tmp_path_factory.mktemp("bench")
    script = tmp / "script.jsonl"
    script.write_text(json.dumps({"text": "counting: " + " ".join(str(i) for i in range(60))}) + "\n")
    with ServerProcess("serve", "--engine", "scripted", "--tokenizer", "qwen3", "--script", str(script),
                       "--step-ms", f"{STEP_MS:g}", "--reasoning-parser", "qwen3",
                       "--enable-per-request-metrics") as server:
        result_file, plots = tmp / "result.json", tmp / "plots"
        cmd = [sys.executable, "-m", "pdserve.cli", "bench", "serve", "--base-url", server.url,
               "--endpoint", "generate,chat,completions,tier", "--output-mode", "tokens,text,derender",
               "--max-concurrency", "1,2", "--num-prompts", str(NUM_PROMPTS), "--random-input-len", "24",
               "--random-output-len", str(MAX_TOKENS), "--slo", "ttft=60000,tpot=60000", "--idle-window-s", "0.2",
               "--save-result", "--result-filename", str(result_file), "--plot-dir", str(plots), "--disable-tqdm"]
        done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stdout + done.stderr + server.log()
    return json.loads(result_file.read_text()), done.stdout, plots


def test_every_arm_and_load_completed_with_exact_token_counts(run: tuple[dict, str, Path]) -> None:
    result, _, _ = run
    cells = result["cells"]
    assert sorted({c["label"] for c in cells}) == sorted(ARMS)
    assert sorted({c["max_concurrency"] for c in cells}) == [1, 2]
    for cell in cells:
        where = f"{cell['label']} {cell['load']}"
        assert cell["completed"] == NUM_PROMPTS and cell["failed"] == 0, (where, cell["errors"])
        assert cell["total_output_tokens"] == NUM_PROMPTS * MAX_TOKENS, where
        assert cell["total_input_tokens"] > 0
        assert cell["request_goodput"] == pytest.approx(cell["request_throughput"])  # an SLO nobody misses


def test_tpot_follows_the_scripted_pace(run: tuple[dict, str, Path]) -> None:
    for cell in run[0]["cells"]:
        where = f"{cell['label']} {cell['load']}"
        tpot = cell["median_tpot_ms"]
        if cell["label"].startswith("tokens + /derender"):
            # Two hops: a first chunk whose /derender call is late (a loaded host) delays the first token while
            # the next ones queue behind it and then come at once, so TPOT (after the first token) can read
            # under the pace (9.45 ms of 10 in one CI run); the E2EL bound below still holds the pace.
            assert tpot > 0, where
        else:
            assert tpot >= STEP_MS * 0.95, where  # the engine sleeps a step between tokens
            # One hop: the client sees the server's pace, give or take the jitter of the first and last
            # arrival spread over 11 gaps. Compared with the server's own figure, not a fixed number, so a
            # loaded host slows both alike.
            server = cell["median_server_mean_itl_ms"]
            assert abs(tpot - server) <= STEP_MS + 0.3 * server, (where, tpot, server)
        assert cell["median_ttft_ms"] <= cell["median_e2el_ms"], where
        assert cell["median_e2el_ms"] >= (MAX_TOKENS - 1) * STEP_MS * 0.95, where


def test_server_timing_cpu_and_client_health_are_reported(run: tuple[dict, str, Path]) -> None:
    # /proc reports CPU in 10 ms ticks: one cell of 36 tokens may show none once the idle rate is subtracted,
    # so each cell's figure is checked for sense and the run's for being measured at all.
    api_cpu = [cell["api_cpu_us_per_output_token"] for cell in run[0]["cells"]]
    assert sum(api_cpu) > 0, api_cpu  # one process: the scripted engine runs in it
    for cell in run[0]["cells"]:
        where = f"{cell['label']} {cell['load']}"
        assert cell["server_metrics_requests"] == NUM_PROMPTS, where
        server_ttft = cell["median_server_time_to_first_token_ms"]
        assert 0 <= server_ttft <= cell["median_ttft_ms"], where
        assert cell["median_server_generation_time_ms"] >= (MAX_TOKENS - 1) * STEP_MS * 0.95, where
        assert cell["api_cpu_us_per_output_token"] >= 0, where
        assert not math.isnan(cell["client_cpu_us_per_output_token"])
        assert isinstance(cell["client_fell_behind"], bool)
        assert len(cell["itl_cdf_ms"]) == 101 and cell["itl_cdf_ms"] == sorted(cell["itl_cdf_ms"])


def test_table_and_plots_are_written(run: tuple[dict, str, Path]) -> None:
    _, stdout, plots = run
    assert "| load | arm |" in stdout
    for name in ("latency_vs_concurrency.png", "itl_distribution.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_unreachable_server_fails_the_run_with_a_message() -> None:
    from pdserve.topology.process import free_port

    url = f"http://127.0.0.1:{free_port()}"
    done = subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "serve", "--base-url", url, "--num-prompts",
                           "1", "--disable-tqdm"], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert f"FAILED: render at {url} failed" in done.stderr


def test_an_arm_whose_mode_a_server_refuses_is_skipped_not_mislabelled(tmp_path: Path) -> None:
    script = tmp_path / "script.jsonl"
    script.write_text(json.dumps({"text": "one two three four five six"}) + "\n")
    base = ("serve", "--engine", "scripted", "--tokenizer", "qwen3", "--script", str(script), "--step-ms", "1")
    with ServerProcess(*base) as full, ServerProcess(*base, "--tokens-only") as tokens_only:
        result_file = tmp_path / "result.json"
        cmd = [sys.executable, "-m", "pdserve.cli", "bench", "serve", "--base-url", full.url,
               "--base-url", tokens_only.url, "--output-mode", "tokens,text", "--num-prompts", "2",
               "--random-input-len", "8", "--random-output-len", "4", "--idle-window-s", "0.1",
               "--result-filename", str(result_file), "--disable-tqdm"]
        done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    full_at, tokens_only_at = (urlsplit(u).netloc for u in (full.url, tokens_only.url))
    result = json.loads(result_file.read_text())
    assert sorted(c["label"] for c in result["cells"]) == sorted(
        [f"tokens @ {full_at}", f"text @ {full_at}", f"tokens @ {tokens_only_at}"])
    assert all(c["completed"] == 2 and c["failed"] == 0 for c in result["cells"])
    [skipped] = result["skipped_arms"]
    assert skipped["label"] == f"text @ {tokens_only_at}"
    assert "answered 400 to output_mode='text'" in skipped["reason"] and "tokens-only" in skipped["reason"]
    assert f"skipped arm 'text @ {tokens_only_at}'" in done.stderr
