"""``pdserve bench frontend``: the helpers that turn measurements into docs, and one real quick run.

Timings are never asserted (DESIGN.md: measure in benchmarks, not in tests);
the quick run checks the result structure and that correctness checks ran.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.bench import frontend, orchestrate, report
from pdserve.bench.frontend import SECTION_HEADING, add_frontend_args, resolve_profile, run_frontend_bench
from pdserve.bench.loadgen import Arm, Job, RequestRecord, assemble_message, generate_body
from pdserve.bench.orchestrate import Profile, RunResult
from pdserve.bench.report import markdown_table, percentile, replace_section, request_latency
from pdserve.bench.servers import (
    CLOCK_TICKS,
    BenchError,
    ServerProcess,
    process_tree_cpu_seconds,
    start_all,
    stat_fields,
)
from pdserve.bench.verify import Verifier
from pdserve.bench.workload import build_scripts
from pdserve.bench.writeup import METHODOLOGY_LINK, docs_section
from pdserve.text.tokenizer import Tokenizer

ENGINE_SECTION = "## Engine (pdserve bench engine)\n\nengine numbers stay here\n"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_frontend_args(parser)
    return parser.parse_args(argv)


# ---------------------------------------------------------------- percentiles and latencies


def test_percentile_interpolates_between_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile(values, 100) == 4.0
    assert percentile([7.0], 99) == 7.0


def test_percentile_of_nothing_is_nan_and_range_is_checked() -> None:
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_latency_counts_token_ids_not_chunks() -> None:
    # 1 id at 0.1 s, a held-back chunk releasing 2 ids at 0.3 s, a chunk without ids, 1 id at 0.35 s.
    lat = request_latency(0.0, [(0.1, 1), (0.3, 2), (0.32, 0), (0.35, 1)], 0.4)
    assert lat.ttft == pytest.approx(0.1)
    assert lat.itl == pytest.approx([0.2, 0.0, 0.05])
    assert sum(lat.itl) == pytest.approx(0.35 - 0.1)
    assert lat.tpot == pytest.approx(0.25 / 3)
    assert lat.e2e == pytest.approx(0.4)


def test_latency_first_chunk_with_several_ids_and_no_tokens() -> None:
    lat = request_latency(1.0, [(1.5, 3)], 2.0)
    assert lat.ttft == pytest.approx(0.5) and lat.itl == [0.0, 0.0] and lat.tpot == 0.0
    with pytest.raises(ValueError):
        request_latency(0.0, [(0.1, 0)], 0.2)


# ---------------------------------------------------------------- CPU from /proc


def _stat(pid: int, comm: str, ppid: int, utime: int, stime: int, cutime: int = 0, cstime: int = 0) -> str:
    # Fields 3..17: state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime cutime cstime.
    return f"{pid} ({comm}) S {ppid} 1 1 0 -1 0 0 0 0 0 {utime} {stime} {cutime} {cstime} 20 0 1 0\n"


def test_stat_fields_survive_odd_command_names() -> None:
    assert stat_fields(_stat(42, "py thon) (x", 7, 10, 5, 3, 2)) == (7, 20)


def test_process_tree_sums_descendants_only(tmp_path: Path) -> None:
    procs = {
        10: _stat(10, "server", 1, 100, 50, 20, 5),  # reaped children already inside cutime/cstime
        11: _stat(11, "worker", 10, 30, 10),
        12: _stat(12, "grand child", 11, 4, 1),
        13: _stat(13, "unrelated", 1, 999, 999),
    }
    for pid, line in procs.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(line)
    (tmp_path / "self").mkdir()  # non-numeric entries are skipped
    (tmp_path / "14").mkdir()  # a process that exited between listing and reading
    expected = (100 + 50 + 20 + 5 + 30 + 10 + 4 + 1) / CLOCK_TICKS
    assert process_tree_cpu_seconds(10, tmp_path) == pytest.approx(expected)
    assert process_tree_cpu_seconds(12, tmp_path) == pytest.approx(5 / CLOCK_TICKS)
    with pytest.raises(BenchError):
        process_tree_cpu_seconds(99, tmp_path)


def test_process_tree_counts_a_finished_child() -> None:
    # The child burns some CPU and reports what the kernel charged it (os.times, in seconds);
    # once reaped, that CPU must show up in the parent's tree (up to a tick of rounding per field).
    burn = (
        "import os, time\nt = time.process_time()\nwhile time.process_time() - t < 0.2:\n    pass\n"
        "c = os.times()\nprint(c.user + c.system)\n"
    )
    before = process_tree_cpu_seconds(os.getpid())
    child = subprocess.run([sys.executable, "-c", burn], check=True, capture_output=True, text=True)
    charged = float(child.stdout)
    assert charged > 0
    assert process_tree_cpu_seconds(os.getpid()) - before >= charged - 2 / CLOCK_TICKS


def test_a_server_that_fails_to_start_is_reported_with_its_log() -> None:
    server = ServerProcess("broken", ["serve", "--engine", "no-such-engine"])
    try:
        with pytest.raises(BenchError, match="broken server exited at startup(.|\\n)*no-such-engine"):
            start_all([server], timeout_s=60)
    finally:
        server.stop()


# ---------------------------------------------------------------- markdown and the docs section


def test_markdown_table_escapes_pipes_and_checks_width() -> None:
    table = markdown_table(["a", "b"], [["1", "x|y"]])
    assert table.splitlines() == ["| a | b |", "| --- | --- |", "| 1 | x\\|y |"]
    with pytest.raises(ValueError):
        markdown_table(["a", "b"], [["only one"]])


def test_replace_section_keeps_every_other_section() -> None:
    doc = (
        "# pdserve benchmarks\n\n"
        f"{SECTION_HEADING}\n\nold numbers\n\n```\n## not a heading inside a fence\n```\n\n"
        f"{ENGINE_SECTION}"
    )
    new = replace_section(doc, SECTION_HEADING, "new numbers")
    assert new == f"# pdserve benchmarks\n\n{SECTION_HEADING}\n\nnew numbers\n\n{ENGINE_SECTION}"
    assert replace_section(new, SECTION_HEADING, "new numbers") == new


def test_replace_section_appends_when_missing_or_last() -> None:
    doc = f"# pdserve benchmarks\n\n{ENGINE_SECTION}"
    appended = replace_section(doc, SECTION_HEADING, "numbers")
    assert appended == f"{doc}\n{SECTION_HEADING}\n\nnumbers\n"
    assert replace_section(appended, SECTION_HEADING, "fresh") == f"{doc}\n{SECTION_HEADING}\n\nfresh\n"


def test_write_docs_creates_the_file_with_a_title(tmp_path: Path) -> None:
    path = tmp_path / "docs" / "benchmarks.md"
    report.write_section(path, frontend.SECTION_HEADING, "numbers")
    assert path.read_text() == f"# pdserve benchmarks\n\n{SECTION_HEADING}\n\nnumbers\n"


def test_docs_section_prints_the_server_flags_the_run_used() -> None:
    # The generate server gets --max-num-seqs max(64, C): a hand-written command line said 64 whatever C.
    profile = Profile(lengths=(32,), concurrency=(1, 100), rounds=1, step_ms=7.5, scripts_per_length=1,
                      time_budget_s=1.0)
    result = RunResult(profile, [], {}, rounds_done=1, wall_s=1.0, checked=0, compared=0)
    section = docs_section(result, "pdserve bench frontend", {})
    assert "--max-num-seqs 100" in section and "--max-num-seqs 64" not in section
    assert "--step-ms 7.5" in section and "one token every 7.5 ms" in section


def test_docs_section_links_the_methodology_page() -> None:
    profile = orchestrate.QUICK_PROFILE
    section = docs_section(RunResult(profile, [], {}, 1, 1.0, 0, 0), "pdserve bench frontend", {})
    assert METHODOLOGY_LINK in section
    target = METHODOLOGY_LINK.split("(")[1].rstrip(")")
    page = Path(__file__).resolve().parents[3] / "docs" / target
    assert page.read_text().startswith("# How `pdserve bench frontend` measures")


# ---------------------------------------------------------------- arms, profiles, verification


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.load("qwen3")


def test_generate_body_per_arm() -> None:
    rendered = {"request_id": "chatcmpl-1", "model": "m", "token_ids": [1, 2], "parse_context": {"tools": None},
                "sampling_params": {"skip_special_tokens": False, "extra_args": {"script_index": 3}}}
    job = Job(script_index=3, rendered=rendered, chat_request={"messages": []})
    bodies = {arm: generate_body(arm, job) for arm in Arm}
    for body in bodies.values():
        assert body["stream"] is True and "request_id" not in body and "model" not in body
        assert body["sampling_params"]["extra_args"] == {"script_index": 3}
    assert bodies[Arm.DERENDER]["output_mode"] == "derender"
    assert bodies[Arm.DERENDER]["parse_context"] == {"tools": None}
    assert bodies[Arm.TEXT]["output_mode"] == "text"
    assert "skip_special_tokens" not in bodies[Arm.TEXT]["sampling_params"]
    for arm in (Arm.TOKENS, Arm.TOKENS_CHAT_DERENDER, Arm.TOKENS_COMPLETIONS_DERENDER):
        assert bodies[arm]["output_mode"] == "tokens" and "parse_context" not in bodies[arm]


def test_profiles_and_explicit_flags() -> None:
    assert resolve_profile(parse()) == orchestrate.DEFAULT_PROFILE
    assert resolve_profile(parse("--quick")) == orchestrate.QUICK_PROFILE
    custom = resolve_profile(parse("--quick", "--lengths", "32,48", "--rounds", "2"))
    assert custom.lengths == (32, 48) and custom.rounds == 2 and custom.step_ms == orchestrate.QUICK_PROFILE.step_ms
    with pytest.raises(SystemExit):
        parse("--arms", "tokens,nope")


def test_assemble_message_folds_deltas_and_pins_tool_call_ids() -> None:
    deltas = [
        {"role": "assistant", "reasoning": "think"}, {"reasoning": "ing"}, {"content": "hi"},
        {"tool_calls": [{"index": 0, "id": "chatcmpl-tool-a", "function": {"name": "f", "arguments": "{\"x\""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]},
    ]
    assert assemble_message(deltas) == {"content": "hi", "reasoning": "thinking", "tool_calls": [("f", '{"x": 1}')]}
    moved = deltas + [{"tool_calls": [{"index": 0, "id": "chatcmpl-tool-b"}]}]
    with pytest.raises(BenchError, match="changed its id"):
        assemble_message(moved)


def _record(arm: Arm, index: int, ids: list[int], **fields: object) -> RequestRecord:
    record = RequestRecord(arm=arm, script_index=index, start=0.0, end=1.0, arrivals=[(0.5, len(ids))],
                           token_ids=list(ids))
    for name, value in fields.items():
        setattr(record, name, value)
    return record


def test_verifier_accepts_equal_outputs_and_rejects_drift(tokenizer: Tokenizer) -> None:
    scripts = build_scripts(tokenizer, (48,), 2, seed=1)
    answer, call = scripts
    ids = [tokenizer.encode(s.output) for s in scripts]
    verifier = Verifier(tokenizer, scripts)
    text = tokenizer.decode(ids[0][:-1], skip_special_tokens=True)
    verifier.check(_record(Arm.TOKENS, 0, ids[0]))
    verifier.check(_record(Arm.TOKENS_COMPLETIONS_DERENDER, 0, ids[0], text=text, finish_reason="stop"))
    verifier.check(_record(Arm.TEXT, 0, ids[0], text=text, finish_reason="stop"))
    arguments = json.dumps(call.tool_call[1]) if call.tool_call else ""
    deltas = [{"reasoning": f"\n{call.reasoning}\n"},
              {"tool_calls": [{"index": 0, "id": "chatcmpl-tool-1",
                               "function": {"name": "run_python", "arguments": arguments}}]}]
    verifier.check(_record(Arm.DERENDER, 1, ids[1], deltas=deltas, finish_reason="tool_calls"))
    assert (verifier.checked, verifier.compared) == (4, 3)

    with pytest.raises(BenchError, match="text differs from the script"):
        verifier.check(_record(Arm.TEXT, 0, ids[0], text=text + "!", finish_reason="stop"))
    with pytest.raises(BenchError, match="differs from inline derender"):
        verifier.check(_record(Arm.TOKENS_CHAT_DERENDER, 1, ids[1], deltas=deltas, finish_reason="stop"))
    with pytest.raises(BenchError, match="token ids differ"):
        verifier.check(_record(Arm.TOKENS, 1, ids[1][:-1]))
    with pytest.raises(BenchError, match="content differs"):
        verifier.check(_record(Arm.DERENDER, 0, ids[0], deltas=[{"reasoning": answer.reasoning}],
                               finish_reason="stop"))


# ---------------------------------------------------------------- one real quick run


def test_quick_run_end_to_end(tmp_path: Path) -> None:
    docs = tmp_path / "benchmarks.md"
    docs.write_text(f"# pdserve benchmarks\n\n{ENGINE_SECTION}")
    out = tmp_path / "frontend.json"
    assert run_frontend_bench(parse("--quick", "--json", str(out), "--docs", str(docs))) == 0

    result = json.loads(out.read_text())
    profile = orchestrate.QUICK_PROFILE
    assert [(c["length"], c["concurrency"]) for c in result["cells"]] == [
        (n, c) for n in profile.lengths for c in profile.concurrency
    ]
    requests_per_round = sum(profile.concurrency) * len(profile.lengths)
    for cell in result["cells"]:
        assert set(cell["arms"]) == {a.name.lower() for a in Arm}
        for arm in cell["arms"].values():
            assert arm["requests"] == cell["concurrency"] * result["rounds_done"]
            assert arm["output_tokens"] >= arm["requests"] * min(profile.lengths)
            for metric in ("ttft", "itl", "tpot", "e2e"):
                assert set(arm[metric]) == {"p50", "p90", "p99"}
            assert arm["cpu_generate"] >= 0 and arm["cpu_derender"] >= 0
        assert set(cell["baseline_over_inline"]) == {"text", "derender"}
    # Every request (one warm-up per arm plus every measured one) was verified, and every
    # text/message output was compared with the other arms' output of the same script.
    arms = len(Arm)
    assert result["correctness"]["requests_checked"] == arms * (1 + requests_per_round * result["rounds_done"])
    assert result["correctness"]["outputs_compared_across_arms"] == (arms - 1) * (
        1 + requests_per_round * result["rounds_done"]
    )

    written = docs.read_text()
    assert written.startswith("# pdserve benchmarks\n\n" + ENGINE_SECTION)
    assert SECTION_HEADING in written and "pdserve bench frontend --lengths" in written
    assert written.count(SECTION_HEADING) == 1
    for arm in Arm:
        assert arm.value in written
