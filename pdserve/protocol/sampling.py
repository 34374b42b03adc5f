"""Wire ``SamplingParams`` with vLLM 0.33's field names, ranges and normalization.

Unknown keys are dropped (vLLM type-validates known keys and ignores the rest).
Every key vLLM's ``SamplingParams`` knows is either honoured, accepted as the
transport detail it is (``output_kind``, ``skip_clone``, ...), or refused with a
400 naming it unless it holds its "off" value: never accepted and ignored.
``max_tokens`` is ``None`` when the client omitted it; the server then fills in
the room left in the model length instead of a small constant.
"""

from __future__ import annotations

from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from pdserve.protocol.limits import (
    MAX_BAD_WORDS,
    MAX_N,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    EngineJSON,
    StopString,
)

# vLLM's VLLM_MAX_NUM_BAD_WORDS: the most banned id sequences one request's bad_words may tokenize into.
MAX_BAD_WORD_SEQUENCES = 128
# Below this temperature sampling is greedy; a positive one under MIN_TEMPERATURE is raised to it (vLLM).
GREEDY_EPS = 1e-5
MIN_TEMPERATURE = 1e-2

# vLLM SamplingParams fields pdserve does not implement, with the values that mean "off".
# Any other value is refused: the client asked for behaviour it would not get.
UNSUPPORTED_OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "structured_outputs": (None,),
    "logprob_token_ids": (None,),
    "prompt_logprob_token_ids": (None,),
    "prompt_logprob_start": (None,),
    "thinking_token_budget": (None, -1),
    "repetition_detection": (None,),
    "watermarking": (None, False),
    "routed_experts_prompt_start": (0,),
    "trace_decode_token_ids": (None,),
}

# Fields vLLM's render always emits although they hold vLLM's default value on the pdserve side:
# vLLM's own default is None and its __post_init__ turns it into a list / bool.
_NORMALIZED_BY_VLLM = ("stop", "stop_token_ids", "bad_words", "skip_reading_prefix_cache")


class KnownExtraArgs(BaseModel):
    """The ``extra_args`` keys pdserve's engines read, with their types (other keys pass through)."""

    model_config = ConfigDict(extra="allow")

    # --engine scripted: replay this script (modulo the number of scripts).
    script_index: StrictInt | None = None
    # --engine scripted: this request's ids per engine step (the server's --tokens-per-step otherwise).
    tokens_per_step: StrictInt | None = Field(None, ge=1)
    # llm-d sends the P/D hand-off here instead of top level (checked by pdserve.protocol.kv).
    kv_transfer_params: dict[str, Any] | None = None


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: list[StopString] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    bad_words: list[StopString] = Field(default_factory=list, max_length=MAX_BAD_WORDS)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logprobs: int | None = Field(None, ge=-1)
    prompt_logprobs: int | None = Field(None, ge=-1)
    detokenize: bool = True
    # Per-id additive bias on the logits (JSON object keys are strings; they must parse as ids).
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    extra_args: EngineJSON | None = None
    # Transport details vLLM emits from /render: accepted, no effect on the answer. vLLM's generate
    # overwrites output_kind; pdserve has one logprobs wire format.
    output_kind: int = Field(0, ge=0, le=2)
    skip_clone: bool = False
    # The request computes its whole prompt, reading no cached block (it still leaves its blocks in the
    # cache); vLLM's default: True exactly when prompt_logprobs are asked for.
    skip_reading_prefix_cache: bool | None = None
    flat_logprobs: bool = False
    output_text_buffer_length: int = 0
    # Tokens per stream chunk, raised to the server's --stream-interval (pdserve.engine.coalesce).
    stream_interval: int | None = Field(None, ge=1)
    # Refused unless off (see UNSUPPORTED_OFF_VALUES).
    structured_outputs: Any = None
    logprob_token_ids: Any = None
    prompt_logprob_token_ids: Any = None
    prompt_logprob_start: Any = None
    thinking_token_budget: Any = None
    repetition_detection: Any = None
    watermarking: Any = None
    routed_experts_prompt_start: Any = 0
    trace_decode_token_ids: Any = None

    @field_validator("stop", "bad_words", mode="before")
    @classmethod
    def _str_to_list(cls, value: Any) -> Any:
        if value is None:
            return []
        if isinstance(value, str):
            return [value]
        return value

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value: list[str]) -> list[str]:
        if any(s == "" for s in value):
            raise ValueError("stop strings must be non-empty")
        return value

    @field_validator("bad_words")
    @classmethod
    def _bad_words(cls, value: list[str]) -> list[str]:
        if any(w == "" for w in value):
            raise ValueError("bad_words must be non-empty strings")
        return list(dict.fromkeys(value))

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _stop_ids_to_list(cls, value: Any) -> Any:
        return [] if value is None else value

    @field_validator("stop_token_ids")
    @classmethod
    def _dedupe_stop_ids(cls, value: list[int]) -> list[int]:
        if any(i < 0 for i in value):
            raise ValueError("stop_token_ids must be non-negative token ids")
        return list(dict.fromkeys(value))

    @field_validator("allowed_token_ids")
    @classmethod
    def _allowed_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is None:
            return None
        if not value:
            raise ValueError("allowed_token_ids must not be empty (omit it to allow every token)")
        if any(i < 0 for i in value):
            raise ValueError("allowed_token_ids must be non-negative token ids")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_ids(cls, value: dict[int, float] | None) -> dict[int, float] | None:
        if value is not None and any(i < 0 for i in value):
            raise ValueError("logit_bias keys must be non-negative token ids")
        return value

    @field_validator("extra_args")
    @classmethod
    def _known_extra_args(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        # The engine reads these keys; a wrong type must be refused here, not fail inside the engine.
        if value is not None:
            try:
                KnownExtraArgs.model_validate(value)
            except ValidationError as e:
                first = e.errors()[0]
                where = ".".join(str(x) for x in first["loc"])
                raise ValueError(f"{where}: {first['msg']}") from None
        return value

    @field_validator("seed")
    @classmethod
    def _seed(cls, value: int | None) -> int | None:
        return None if value == -1 else value  # vLLM: -1 means "no seed"

    @field_validator("logprobs", "prompt_logprobs", mode="before")
    @classmethod
    def _bool_logprobs(cls, value: Any) -> Any:
        # vLLM accepts True as "the sampled token only plus one candidate"; False as off.
        if value is True:
            return 1
        if value is False:
            return None
        return value

    @field_validator(*UNSUPPORTED_OFF_VALUES)
    @classmethod
    def _refuse_unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        name = info.field_name
        assert name is not None  # a field validator always runs for a field
        if not asks_nothing(name, value, UNSUPPORTED_OFF_VALUES[name]):
            raise ValueError(f"{name} is not supported by pdserve; omit it or send null")
        # vLLM normalizes thinking_token_budget=-1 ("unlimited") to None.
        return None if name == "thinking_token_budget" else value

    @model_validator(mode="after")
    def _consistent(self) -> SamplingParams:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are only supported when detokenize is true; use stop_token_ids")
        # vLLM's normalization, so both servers see (and /render emits) the same values.
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        if self.temperature < GREEDY_EPS:
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        if self.skip_reading_prefix_cache is None:
            self.skip_reading_prefix_cache = self.prompt_logprobs is not None
        return self

    @property
    def provided(self) -> set[str]:
        """The keys the client actually sent (for server-side defaulting)."""
        return set(self.model_fields_set)

    def vllm_json(self) -> dict[str, Any]:
        """The JSON vLLM 0.33's render emits for these params (msgspec ``omit_defaults``): fields
        that differ from their default, plus the ones vLLM normalizes away from its None default.
        ``max_tokens`` always goes out when set, so a generate server never re-defaults it."""
        body = self.model_dump(mode="json")
        out = {}
        for name, field in type(self).model_fields.items():
            default = field.get_default(call_default_factory=True)
            keep = name in _NORMALIZED_BY_VLLM or (name == "max_tokens" and self.max_tokens is not None)
            if keep or getattr(self, name) != default:
                out[name] = body[name]
        return out


def asks_nothing(name: str, value: Any, offs: tuple[Any, ...]) -> bool:
    """Whether an unsupported vLLM field holds one of its "off" values (type-exact: 0 is not False)."""
    if name == "repetition_detection" and isinstance(value, dict):
        return not value.get("max_pattern_size")  # vLLM: max_pattern_size 0 disables detection
    return any(value is off or (value == off and type(value) is type(off)) for off in offs)
