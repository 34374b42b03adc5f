"""Wire SamplingParams: vLLM 0.33's ranges and normalization, refused fields, and the JSON /render emits."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from pdserve.protocol.generate import GenerateRequest
from pdserve.protocol.limits import WIRE_INT_MAX, WIRE_INT_MIN
from pdserve.protocol.openai import ChatCompletionRequest, CompletionRequest
from pdserve.protocol.sampling import SamplingParams


def rejects(fields: dict, needle: str) -> str:
    with pytest.raises(ValidationError) as info:
        SamplingParams.model_validate(fields)
    message = str(info.value)
    assert needle in message, message
    return message


@given(st.floats(min_value=-2.0, max_value=2.0), st.floats(min_value=-2.0, max_value=2.0))
def test_presence_and_frequency_in_range_are_kept(presence: float, frequency: float) -> None:
    sp = SamplingParams.model_validate({"presence_penalty": presence, "frequency_penalty": frequency})
    assert (sp.presence_penalty, sp.frequency_penalty) == (presence, frequency)


@given(st.floats(allow_nan=False).filter(lambda v: abs(v) > 2.0), st.sampled_from(["presence", "frequency"]))
def test_penalties_outside_range_name_the_field(value: float, which: str) -> None:
    rejects({f"{which}_penalty": value}, f"{which}_penalty")


@given(st.floats(min_value=1e-6, max_value=1e6))
def test_repetition_penalty_positive_is_kept(value: float) -> None:
    assert SamplingParams.model_validate({"repetition_penalty": value}).repetition_penalty == value


@pytest.mark.parametrize("value", [0, -0.5, math.inf, math.nan])
def test_repetition_penalty_must_be_finite_and_positive(value: float) -> None:
    rejects({"repetition_penalty": value}, "repetition_penalty")


def test_temperature_range_and_greedy_normalization() -> None:
    rejects({"temperature": 2.5}, "temperature")
    rejects({"temperature": math.nan}, "temperature")
    greedy = SamplingParams.model_validate({"temperature": 0, "top_k": 5, "top_p": 0.5, "min_p": 0.2})
    assert (greedy.top_k, greedy.top_p, greedy.min_p) == (0, 1.0, 0.0)  # vLLM: irrelevant when greedy
    assert SamplingParams.model_validate({"temperature": 0.001}).temperature == 0.01
    assert SamplingParams.model_validate({"seed": -1}).seed is None


def test_logit_bias_keys_are_ids() -> None:
    sp = SamplingParams.model_validate({"logit_bias": {"17": -100, "3": 2.5}})
    assert sp.logit_bias == {17: -100.0, 3: 2.5}
    rejects({"logit_bias": {"hello": 1}}, "logit_bias")
    rejects({"logit_bias": {"-4": 1}}, "logit_bias")


def test_allowed_token_ids_and_bad_words() -> None:
    assert SamplingParams.model_validate({"allowed_token_ids": [5, 9]}).allowed_token_ids == [5, 9]
    rejects({"allowed_token_ids": []}, "allowed_token_ids")
    rejects({"allowed_token_ids": [-1]}, "allowed_token_ids")
    assert SamplingParams.model_validate({"bad_words": ["a", "b", "a"]}).bad_words == ["a", "b"]
    assert SamplingParams.model_validate({"bad_words": None}).bad_words == []
    rejects({"bad_words": ["ok", ""]}, "bad_words")


REFUSED = [
    ("structured_outputs", {"json": {"type": "object"}}, None),
    ("logprob_token_ids", [1, 2], None),
    ("prompt_logprob_token_ids", [1], None),
    ("prompt_logprob_start", 2, None),
    ("thinking_token_budget", 64, -1),
    ("repetition_detection", {"max_pattern_size": 4, "min_count": 3}, {"max_pattern_size": 0}),
    ("watermarking", True, False),
    ("routed_experts_prompt_start", 3, 0),
    ("trace_decode_token_ids", [4, 5], None),
]


@pytest.mark.parametrize(("name", "asks", "off"), REFUSED)
def test_unimplemented_fields_are_refused_unless_off(name: str, asks: object, off: object) -> None:
    rejects({name: asks}, name)
    SamplingParams.model_validate({name: off})


def test_transport_fields_vllm_render_emits_are_accepted() -> None:
    sp = SamplingParams.model_validate(
        {"output_kind": 2, "skip_clone": True, "skip_reading_prefix_cache": False, "flat_logprobs": True}
    )
    assert sp.skip_clone is True


def test_vllm_json_of_defaults_matches_vllm_render() -> None:
    # vLLM 0.33 normalizes stop/stop_token_ids/bad_words from None to [] and skip_reading_prefix_cache to a
    # bool, so its omit-defaults JSON carries them even for a request that set nothing (reference §5.1, §16).
    assert SamplingParams.model_validate({}).vllm_json() == {
        "stop": [], "stop_token_ids": [], "bad_words": [], "skip_reading_prefix_cache": False,
    }
    assert SamplingParams.model_validate({"prompt_logprobs": 1}).vllm_json()["skip_reading_prefix_cache"] is True
    assert SamplingParams.model_validate({"max_tokens": 16}).vllm_json()["max_tokens"] == 16


sampling_fields = st.fixed_dictionaries(
    {},
    optional={
        "n": st.integers(1, 4),
        "max_tokens": st.integers(1, 4096),
        "temperature": st.floats(0.0, 2.0),
        "top_p": st.floats(0.01, 1.0),
        "top_k": st.integers(-1, 50),
        "seed": st.integers(0, 2**32),
        "presence_penalty": st.floats(-2.0, 2.0),
        "frequency_penalty": st.floats(-2.0, 2.0),
        "repetition_penalty": st.floats(0.1, 3.0),
        "stop": st.lists(st.text(min_size=1, max_size=4), max_size=3),
        "stop_token_ids": st.lists(st.integers(0, 1000), max_size=3),
        "bad_words": st.lists(st.text(min_size=1, max_size=6), max_size=3),
        "logit_bias": st.dictionaries(st.integers(0, 1000).map(str), st.floats(-100, 100), max_size=3),
        "allowed_token_ids": st.lists(st.integers(0, 1000), min_size=1, max_size=4),
        "logprobs": st.integers(0, 5),
        "prompt_logprobs": st.integers(0, 5),
        "skip_special_tokens": st.booleans(),
        "output_kind": st.integers(0, 2),
        "skip_clone": st.booleans(),
        # Within the engine wire's range (past it is a 400: tests/e2e/test_hostile_input.py).
        "extra_args": st.dictionaries(st.text(max_size=5), st.integers(WIRE_INT_MIN, WIRE_INT_MAX), max_size=2),
    },
)


@settings(max_examples=200)
@given(sampling_fields)
def test_vllm_json_round_trips(fields: dict) -> None:
    """What /render emits parses back to the same params, and holds no key at pdserve's default except
    the ones vLLM itself normalizes and emits."""
    sp = SamplingParams.model_validate(fields)
    body = sp.vllm_json()
    assert SamplingParams.model_validate(body) == sp
    for name, value in body.items():
        default = SamplingParams.model_fields[name].get_default(call_default_factory=True)
        assert value != default or name in {"stop", "stop_token_ids", "bad_words", "skip_reading_prefix_cache"}


def test_openai_requests_name_what_pdserve_does_not_implement() -> None:
    chat = {"messages": [{"role": "user", "content": "x"}]}
    assert ChatCompletionRequest.model_validate(chat).unsupported_key() is None
    assert ChatCompletionRequest.model_validate({**chat, "response_format": {"type": "text"}}).unsupported_key() is None
    assert ChatCompletionRequest.model_validate({**chat, "use_beam_search": False}).unsupported_key() is None
    for key, value in [
        ("response_format", {"type": "json_object"}),
        ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
        ("structured_outputs", {"regex": "a+"}),
        ("guided_json", {"type": "object"}),
        ("guided_regex", "a+"),
        ("guided_choice", ["a", "b"]),
        ("guided_grammar", "root ::= 'a'"),
        ("guided_decoding_backend", "xgrammar"),
        ("use_beam_search", True),
        ("echo", True),
        ("logprob_token_ids", [1]),
        ("truncate_prompt_tokens", 10),
        ("chat_template", "{{ messages }}"),
        ("return_tokens_as_token_ids", True),
        ("thinking_token_budget", 10),
    ]:
        assert ChatCompletionRequest.model_validate({**chat, key: value}).unsupported_key() == key, key
    assert CompletionRequest.model_validate({"prompt": "x", "suffix": "y"}).unsupported_key() == "suffix"
    assert CompletionRequest.model_validate({"prompt": "x", "echo": True}).unsupported_key() == "echo"


def test_openai_logit_bias_is_clamped_like_vllm() -> None:
    chat = ChatCompletionRequest.model_validate(
        {"messages": [], "logit_bias": {"5": 250.0, "6": -1000.0, "7": 3.0}}
    )
    assert chat.clamped_logit_bias() == {"5": 100.0, "6": -100.0, "7": 3.0}


def test_generate_accepts_vllm_multimodal_keys_only_when_empty() -> None:
    base = {"token_ids": [1, 2], "sampling_params": {}}
    req = GenerateRequest.model_validate(
        {**base, "token_offsets": [[0, 1], [1, 3]], "features": None, "content_parts": None,
         "ec_transfer_params": None}
    )
    assert req.token_offsets == [(0, 1), (1, 3)]
    for key, value in [("features", {"mm_hashes": {"image": ["h"]}}),
                       ("content_parts", [{"type": "image_url", "url": "u"}]),
                       ("ec_transfer_params", {"x": 1})]:
        with pytest.raises(ValidationError, match=key):
            GenerateRequest.model_validate({**base, key: value})
