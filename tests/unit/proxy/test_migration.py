"""Resumption: which streams may move, the new leg's body, and a resumed tokens leg's usage."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.proxy.migration import Resumption

BODY = {"token_ids": [1, 2], "sampling_params": {"max_tokens": 6, "min_tokens": 1}, "kv_transfer_params": {"k": 1},
        "output_mode": "tokens", "stream": True}


def _seen(resumption: Resumption, *chunks: list[int] | None) -> Resumption:
    for ids in chunks:
        resumption.saw({"choices": [{"index": 0, "token_ids": ids}]})
    return resumption


@pytest.mark.parametrize("sampling, mode, why", [
    ({"n": 2}, "derender", "n > 1"),
    ({"stop": ["x"]}, "text", "stop strings"),
    ({"stop": ["x"]}, "tokens", None),  # the proxy carries the /derender state: nothing runs ahead
    ({"stop": ["x"], "include_stop_str_in_output": True}, "text", None),
    ({"max_tokens": 2}, "tokens", "every token it may generate was sent"),
])
def test_what_may_move(sampling: dict[str, Any], mode: str, why: str | None) -> None:
    refusal = _seen(Resumption({"sampling_params": sampling}, mode, 1), [5], [6]).refusal()  # type: ignore[arg-type]
    assert (refusal is None) if why is None else (why in str(refusal))


def test_withheld_ids_and_the_limit_stop_a_move() -> None:
    assert "withholds token ids" in str(_seen(Resumption({}, "derender", 1), [5], None).refusal())
    assert "--migration-limit 0" in str(Resumption({}, "derender", 0).refusal())


def test_a_tokens_leg_resumes_without_prior_output_chunks_and_its_usage_counts_them() -> None:
    resumption = _seen(Resumption({"sampling_params": BODY["sampling_params"]}, "tokens", 2), [5], [6, 7])
    body = resumption.body(BODY)
    assert body["token_ids"] == [1, 2, 5, 6, 7] and "prior_output_chunks" not in body
    assert body["sampling_params"] == {"max_tokens": 3, "min_tokens": 0, "prompt_logprobs": None}
    assert body["kv_transfer_params"] is None
    usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    adjusted = resumption.adjusted({"choices": [], "usage": usage, "prompt_token_ids": [1, 2, 5, 6, 7]})
    assert adjusted == {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8}}
    # A second move counts every id sent so far, from both legs.
    _seen(resumption, [8])
    assert resumption.body(BODY)["token_ids"] == [1, 2, 5, 6, 7, 8]
    assert resumption.adjusted({"usage": {"prompt_tokens": 6, "completion_tokens": 1}})["usage"] == \
        {"prompt_tokens": 2, "completion_tokens": 5}
