"""What the prefill leg resets and what the decode leg carries, for any rendered request."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from pdserve.protocol.generate import GenerateRequest
from pdserve.proxy.legs import (
    DERENDER_ONLY_FIELDS,
    PREFILL_DROPPED_FIELDS,
    PREFILL_DROPPED_SAMPLING,
    decode_body,
    prefill_body,
)

SAMPLING = st.fixed_dictionaries({}, optional={
    "n": st.integers(1, 4),
    "max_tokens": st.integers(1, 500),
    "min_tokens": st.integers(0, 50),
    "temperature": st.floats(0, 2),
    "stop": st.lists(st.text(min_size=1, max_size=5), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 1000), max_size=3),
    "bad_words": st.lists(st.text(min_size=1, max_size=5), max_size=2),
    "include_stop_str_in_output": st.booleans(),
    "logprobs": st.integers(0, 5),
    "prompt_logprobs": st.integers(0, 5),
    "seed": st.integers(0, 2**31),
    "skip_special_tokens": st.booleans(),
    "output_kind": st.sampled_from([1, 2]),
    "extra_args": st.just({"script_index": 1}),
})
RENDERED = st.fixed_dictionaries({
    "request_id": st.just("chatcmpl-abc"),
    "token_ids": st.lists(st.integers(0, 1000), min_size=1, max_size=8),
    "sampling_params": SAMPLING,
    "model": st.sampled_from([None, "m"]),
    "stream": st.booleans(),
}, optional={
    "stream_options": st.just({"include_usage": True}),
    "parse_context": st.just({"tools": None, "tool_choice": "none"}),
    "reasoning_parser_kwargs": st.just({"chat_template_kwargs": {}}),
    "reasoning_ended": st.booleans(),
    "return_token_ids": st.booleans(),
    "kv_transfer_params": st.just({"from": "client"}),
    "cache_salt": st.just("salt"),
})


@given(RENDERED)
def test_the_prefill_leg_fills_kv_and_nothing_else(rendered: dict[str, Any]) -> None:
    body = prefill_body(rendered)
    assert body["output_mode"] == "tokens" and body["stream"] is False and body["return_token_ids"] is None
    assert body["kv_transfer_params"] == {"do_remote_decode": True}
    sampling = body["sampling_params"]
    assert sampling["max_tokens"] == 1 and sampling["n"] == 1
    assert not set(PREFILL_DROPPED_FIELDS) & body.keys()
    assert not set(PREFILL_DROPPED_SAMPLING) & sampling.keys()
    # The prompt and everything else that shapes the prompt's KV travel unchanged.
    for key in ("request_id", "token_ids", "model", "cache_salt"):
        assert body.get(key) == rendered.get(key)
    kept = set(rendered["sampling_params"]) - set(PREFILL_DROPPED_SAMPLING) - {"max_tokens", "n"}
    assert {k: sampling[k] for k in kept} == {k: rendered["sampling_params"][k] for k in kept}
    GenerateRequest.model_validate(body)  # still a valid generate request
    assert rendered.get("kv_transfer_params") in (None, {"from": "client"})  # the input is not mutated


@given(RENDERED, st.sampled_from(["tokens", "text", "derender"]),
       st.none() | st.just({"remote_engine_id": "e", "remote_block_ids": [[1, 2]], "do_remote_prefill": True}))
def test_the_decode_leg_is_the_rendered_request_plus_the_prefills_params(
    rendered: dict[str, Any], mode: str, kv: dict[str, Any] | None
) -> None:
    body = decode_body(rendered, mode, kv)  # type: ignore[arg-type]
    assert body["output_mode"] == mode and body["kv_transfer_params"] == kv
    dropped = set() if mode == "derender" else set(DERENDER_ONLY_FIELDS)
    expected = {k: v for k, v in rendered.items() if k not in dropped} | {"output_mode": mode, "kv_transfer_params": kv}
    assert body == expected
    if mode == "derender":
        for key in ("parse_context", "reasoning_parser_kwargs", "reasoning_ended"):
            assert body.get(key) == rendered.get(key)
