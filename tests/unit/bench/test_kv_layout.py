"""``pdserve bench kv-layout`` on the tiny model: every shape measured three ways, the copies, and its section."""

from __future__ import annotations

from pathlib import Path

from pdserve.cli import main


def test_the_bench_measures_every_shape_and_writes_its_section(tmp_path: Path) -> None:
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\n## Other\n\nkept\n")
    assert main(["bench", "kv-layout", "--model", "qwen3-tiny", "--dtype", "float32", "--repeats", "1",
                 "--docs", str(docs)]) == 0
    text = docs.read_text()
    assert "## Other\n\nkept" in text and "## Paged KV on this CPU (pdserve bench kv-layout)" in text
    table = [line for line in text.splitlines() if line.startswith(("| 1 ", "| 8 "))]
    assert [line.split(" | ")[:2] for line in table] == [["| 1", "256"], ["| 1", "1024"], ["| 8", "256"], ["| 8", "1024"]]
    for line in table:  # every cell a measured time, the paged ones with their share of the step
        cells = line.strip("| ").split(" | ")
        assert all(cell.split(" ms")[0].replace(".", "").isdigit() for cell in cells[2:])
        assert all("% of the step)" in cell for cell in cells[4:])
    mixed = [line for line in text.splitlines() if line.startswith(("| one of", "| 1024 down", "| eight of"))]
    assert [line.split(" | ")[0] for line in mixed] == ["| one of 1024, seven of 256", "| 1024 down to 128",
                                                       "| eight of 512"]
    for line in mixed:  # the engine's runs and one padded call, both measured
        assert all(cell.removesuffix(" ms").replace(".", "").isdigit() for cell in line.strip("| ").split(" | ")[1:])
    assert "1024-position prompt's KV saved into blocks" in text
