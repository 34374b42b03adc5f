"""``pdserve bench interference`` on the tiny model: a row per budget, both readings of the ITL ratio, its section."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.cli import main


def test_the_bench_measures_every_budget_and_writes_both_ratios(tmp_path: Path) -> None:
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\n## Other\n\nkept\n")
    assert main(["bench", "interference", "--model", "qwen3-tiny", "--dtype", "float32", "--prompt-tokens", "256",
                 "--streams", "2", "--budgets", "512,32", "--docs", str(docs)]) == 0
    text = docs.read_text()
    assert "## Other\n\nkept" in text and "## A long prompt among running streams (pdserve bench interference)" in text
    rows = [line.strip("| ").split(" | ") for line in text.splitlines() if line.startswith(("| 512 ", "| 32 "))]
    assert [row[0] for row in rows] == ["512 (one step: no chunking)", "32"]
    for _budget, gaps, before, against_before, against_while, ttft in rows:
        p50, p99, longest = (float(ms) for ms in gaps.removesuffix(" ms").split(" / "))
        pace = float(before.removesuffix(" ms"))
        assert p50 <= p99 <= longest and float(ttft.removesuffix(" ms").replace(",", "")) > 0
        # The ratios come from unrounded times; the cells are rounded to whole ms and the ratios to 0.1.
        assert within_rounding(float(against_before.removesuffix("×")), p99, pace)
        assert within_rounding(float(against_while.removesuffix("×")), p99, p50)


@pytest.mark.parametrize(("flags", "named"), [
    (["--budgets", "64,8"], "--budgets 8: a step's token budget must be at least the engine's 16 slots"),
    (["--budgets", "64,lots"], "--budgets takes whole numbers"),
    (["--streams", "16"], "--streams must be 1 to 15"),
    (["--streams", "0"], "--streams must be 1 to 15"),
    (["--prompt-tokens", "0"], "--prompt-tokens must be at least 1"),
])
def test_arguments_a_run_would_fail_on_are_refused_before_it_starts(flags: list[str], named: str, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    docs = tmp_path / "benchmarks.md"
    assert main(["bench", "interference", "--model", "qwen3-tiny", "--docs", str(docs), *flags]) == 2
    captured = capsys.readouterr()
    assert named in captured.err and "--max-num-batched-tokens" not in captured.out  # no budget ran
    assert not docs.exists()


def within_rounding(ratio: float, top_ms: float, bottom_ms: float) -> bool:
    """Whether ``ratio`` can be top / bottom for times that round to ``top_ms`` and ``bottom_ms``."""
    low = (top_ms - 0.5) / (bottom_ms + 0.5) - 0.05
    high = (top_ms + 0.5) / max(bottom_ms - 0.5, 1e-9) + 0.05
    return low <= ratio <= high
