"""Wire types: defaults, validators and the output_mode discriminator."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pdserve.protocol.generate import GenerateRequest, generate_response_adapter, generate_stream_response_adapter
from pdserve.protocol.sampling import SamplingParams


def test_max_tokens_none_when_omitted_and_unknown_keys_dropped() -> None:
    sp = SamplingParams.model_validate({"temperature": 0, "mystery": 1})
    assert sp.max_tokens is None and "mystery" not in sp.model_dump()
    assert SamplingParams.model_validate({"stop": "x"}).stop == ["x"]
    assert SamplingParams.model_validate({"stop_token_ids": [3, 3, 4]}).stop_token_ids == [3, 4]
    assert SamplingParams.model_validate({"logprobs": True}).logprobs == 1


def test_request_rules() -> None:
    base = {"token_ids": [1, 2], "sampling_params": {}}
    assert GenerateRequest.model_validate(base).output_mode == "tokens"
    with pytest.raises(ValidationError, match="detokenize"):
        GenerateRequest.model_validate({**base, "output_mode": "text", "sampling_params": {"detokenize": False}})
    with pytest.raises(ValidationError, match="chat_request"):
        GenerateRequest.model_validate({**base, "chat_request": {"messages": []}})
    with pytest.raises(ValidationError, match="not both"):
        GenerateRequest.model_validate(
            {**base, "output_mode": "derender", "chat_request": {"messages": []}, "parse_context": {}}
        )
    # parse_context without derender is ignored (render always emits it).
    assert GenerateRequest.model_validate({**base, "parse_context": {}}).parse_context is not None


def test_kv_transfer_params_top_level_wins() -> None:
    req = GenerateRequest.model_validate(
        {"token_ids": [1], "sampling_params": {"extra_args": {"kv_transfer_params": {"a": 1}}}}
    )
    assert req.effective_kv_transfer_params() == {"a": 1}
    req = GenerateRequest.model_validate(
        {"token_ids": [1], "kv_transfer_params": {"b": 2},
         "sampling_params": {"extra_args": {"kv_transfer_params": {"a": 1}}}}
    )
    assert req.effective_kv_transfer_params() == {"b": 2}


def test_missing_output_mode_means_tokens() -> None:
    body = {"request_id": "r", "usage": {}, "choices": [{"index": 0, "token_ids": [1]}]}
    assert generate_response_adapter.validate_python(body).output_mode == "tokens"
    chunk = {"request_id": "r", "output_mode": "text", "choices": [{"index": 0, "text": "x", "token_ids": []}]}
    assert generate_stream_response_adapter.validate_python(chunk).choices[0].text == "x"
