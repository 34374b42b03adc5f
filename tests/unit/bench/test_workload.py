"""The bench serve datasets: output length distributions and prompt files."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.bench.workload import file_chats, output_lengths, random_chats


@given(st.integers(1, 5000), st.floats(0.0, 0.99), st.integers(0, 2**32))
def test_output_lengths_stay_within_vllms_range(mean: int, ratio: float, seed: int) -> None:
    lengths = output_lengths(50, mean, ratio, random.Random(seed))
    low, high = max(1, round(mean * (1 - ratio))), max(1, round(mean * (1 + ratio)))
    assert len(lengths) == 50 and all(low <= n <= high for n in lengths)


def test_output_lengths_refuse_a_ratio_of_one() -> None:
    with pytest.raises(ValueError, match="range-ratio"):
        output_lengths(1, 10, 1.0, random.Random(0))


def test_random_chats_are_distinct_user_turns() -> None:
    chats = random_chats(3, 120, random.Random(0))
    contents = [c["messages"][0]["content"] for c in chats]
    assert len(set(contents)) == 3 and all(len(c.split()) > 60 for c in contents)


def test_file_chats_take_messages_or_a_prompt_and_name_a_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join([
        json.dumps({"messages": [{"role": "user", "content": "a"}], "max_tokens": 7, "temperature": 0}),
        "",
        json.dumps({"prompt": "b"}),
    ]))
    assert file_chats(str(path)) == [
        ({"messages": [{"role": "user", "content": "a"}], "temperature": 0}, 7),
        ({"messages": [{"role": "user", "content": "b"}]}, None),
    ]
    path.write_text(json.dumps({"text": "no messages"}) + "\n")
    with pytest.raises(ValueError, match=r"prompts.jsonl:1: a line needs 'messages'"):
        file_chats(str(path))
