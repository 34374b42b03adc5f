"""Tables, the docs section swap, arms from flags and the request bodies each arm sends."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest

from pdserve.bench import report
from pdserve.bench.loadgen import Arm, Prompt, generate_body, openai_body
from pdserve.bench.report import markdown_table, replace_section
from pdserve.bench.results import results_table
from pdserve.bench.serve_bench import add_serve_args, arms_from_args
from pdserve.bench.servers import BenchError, start_all
from pdserve.topology.process import ServerProcess

HEADING = "## Some benchmark"
ENGINE_SECTION = "## Engine (pdserve bench engine)\n\nengine numbers stay here\n"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return parser.parse_args(argv)


def test_markdown_table_escapes_pipes_and_checks_width() -> None:
    table = markdown_table(["a", "b"], [["1", "x|y"]])
    assert table.splitlines() == ["| a | b |", "| --- | --- |", "| 1 | x\\|y |"]
    with pytest.raises(ValueError):
        markdown_table(["a", "b"], [["only one"]])


def test_replace_section_keeps_every_other_section() -> None:
    doc = f"# pdserve benchmarks\n\n{HEADING}\n\nold numbers\n\n```\n## not a heading inside a fence\n```\n\n{ENGINE_SECTION}"
    new = replace_section(doc, HEADING, "new numbers")
    assert new == f"# pdserve benchmarks\n\n{HEADING}\n\nnew numbers\n\n{ENGINE_SECTION}"
    assert replace_section(new, HEADING, "new numbers") == new
    appended = replace_section(f"# t\n\n{ENGINE_SECTION}", HEADING, "numbers")
    assert appended == f"# t\n\n{ENGINE_SECTION}\n{HEADING}\n\nnumbers\n"


def test_write_section_creates_the_file_with_a_title(tmp_path: Path) -> None:
    path = tmp_path / "docs" / "benchmarks.md"
    report.write_section(path, HEADING, "numbers")
    assert path.read_text() == f"# pdserve benchmarks\n\n{HEADING}\n\nnumbers\n"


def test_a_server_that_fails_to_start_is_reported_with_its_log() -> None:
    server = ServerProcess("broken", ["serve", "--engine", "no-such-engine"])
    try:
        with pytest.raises(BenchError, match="broken server exited at startup(.|\\n)*no-such-engine"):
            start_all([server], timeout_s=60)
    finally:
        server.stop()


def test_arms_are_urls_times_modes_and_labels_name_the_url_when_several() -> None:
    arms = arms_from_args(parse("--base-url", "http://a:1", "--base-url", "http://b:2/", "--output-mode", "tokens,text"))
    assert [(a.base_url, a.modes) for a in arms] == [("http://a:1", ("tokens",)), ("http://a:1", ("text",)),
                                                     ("http://b:2", ("tokens",)), ("http://b:2", ("text",))]
    assert arms[1].label == "text @ a:1"
    single = arms_from_args(parse("--base-url", "http://a:1", "--mix", "tokens,text,tokens,derender"))
    assert len(single) == 1 and [single[0].mode_of(i) for i in range(5)] == ["tokens", "text", "tokens", "derender",
                                                                              "tokens"]
    tier = arms_from_args(parse("--base-url", "http://a:1", "--endpoint", "tier", "--derender-url", "http://d:3"))
    assert tier[0].urls == ("http://a:1", "http://d:3")
    intervals = arms_from_args(parse("--base-url", "http://a:1", "--output-mode", "tokens,text", "--logprobs", "2",
                                     "--stream-interval", "1,8"))
    assert [(a.label, a.sampling) for a in intervals] == [
        ("tokens / interval 1", {"logprobs": 2, "stream_interval": 1}),
        ("text / interval 1", {"logprobs": 2, "stream_interval": 1}),
        ("tokens / interval 8", {"logprobs": 2, "stream_interval": 8}),
        ("text / interval 8", {"logprobs": 2, "stream_interval": 8})]
    widths = arms_from_args(parse("--base-url", "http://a:1", "--output-mode", "text", "--logprobs", "none,20"))
    assert [(a.label, a.sampling) for a in widths] == [("text", {}), ("text + logprobs=20", {"logprobs": 20})]
    proxy = Arm("p", "http://proxy:1", endpoint="chat", backends=("http://render:2", "http://proxy:1"))
    assert proxy.urls == ("http://proxy:1", "http://render:2")  # its members' CPU is charged to it too


def test_bad_flags_are_refused_with_the_flag_named() -> None:
    for argv in (["--output-mode", "txt"], ["--endpoint", "/v1/embeddings"], ["--max-concurrency", "x"]):
        with pytest.raises(SystemExit):
            parse("--base-url", "http://a:1", *argv)
    with pytest.raises(ValueError, match="tier baseline streams"):
        Arm("x", "http://a:1", endpoint="tier", stream=False)


RENDERED = {"request_id": "r", "token_ids": [1, 2, 3], "model": "m", "stream": False,
            "sampling_params": {"temperature": 0.0, "skip_special_tokens": False, "max_tokens": 99},
            "parse_context": {"tools": None}, "output_mode": "tokens"}
PROMPT = Prompt(chat={"messages": [{"role": "user", "content": "hi"}]}, rendered=RENDERED, max_tokens=7,
                ignore_eos=True)


def test_generate_body_per_mode() -> None:
    arm = Arm("a", "http://a:1", sampling={"logprobs": 20})
    derender = generate_body(arm, PROMPT, "derender")
    assert derender["output_mode"] == "derender" and derender["parse_context"] == {"tools": None}
    assert derender["sampling_params"] == {"temperature": 0.0, "skip_special_tokens": False, "max_tokens": 7,
                                           "ignore_eos": True, "logprobs": 20}
    assert derender["stream"] is True and derender["stream_options"] == {"include_usage": True}
    assert "request_id" not in derender and "model" not in derender
    text = generate_body(arm, PROMPT, "text")
    assert "parse_context" not in text and "skip_special_tokens" not in text["sampling_params"]
    batch = generate_body(Arm("b", "http://a:1", stream=False), PROMPT, "tokens")
    assert "stream" not in batch and "stream_options" not in batch


def test_openai_bodies_count_tokens_through_continuous_usage() -> None:
    chat = openai_body(Arm("c", "http://a:1", endpoint="chat"), PROMPT)
    assert chat["messages"] == PROMPT.chat["messages"] and chat["max_tokens"] == 7 and chat["ignore_eos"] is True
    assert chat["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    completions = openai_body(Arm("c", "http://a:1", endpoint="completions", stream=False), PROMPT)
    assert completions["prompt"] == [1, 2, 3] and "stream" not in completions


def test_results_table_shows_nan_as_a_dash_and_flags_a_slow_client() -> None:
    cell = {"load": "C=1", "label": "tokens", "completed": 2, "failed": 1, "total_output_tokens": 10,
            "median_ttft_ms": 1.0, "p99_ttft_ms": 2.0, "median_tpot_ms": math.nan, "p99_tpot_ms": math.nan,
            "median_itl_ms": 3.0, "p99_itl_ms": 4.0, "median_e2el_ms": 5.0, "output_throughput": 6.0,
            "client_cpu_us_per_output_token": 7.0, "client_fell_behind": True}
    row = results_table({"cells": [cell]}).splitlines()[2]
    assert "2 (1 failed)" in row and "— / —" in row and "client fell behind" in row


def test_scenarios_document_lists_every_scenario_and_what_was_not_measured() -> None:
    from pdserve.bench.scenarios import QUICK, SCENARIOS, Section, document

    doc = document(QUICK, {"1": Section("the table", "tokens won")}, {"2": "the run failed: no proxy"},
                   "engine numbers", "pdserve bench scenarios --quick", 90.0, "shared host")
    assert doc.startswith("# pdserve benchmarks\n")
    assert "* **(1) Output modes on the torch engine**: tokens won" in doc
    assert "not measured: the run failed: no proxy" in doc
    assert all(f"## ({s.key}) {s.title}" in doc for s in SCENARIOS)
    assert doc.index("## (7)") < doc.index("## Engine (pdserve bench engine)\n\nengine numbers")
    assert "* Note: shared host" in doc and "`pdserve bench scenarios --quick`" in doc and "* Host: " in doc
