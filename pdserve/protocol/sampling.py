"""Wire ``SamplingParams`` with vLLM's field names.

Unknown keys are dropped (vLLM type-validates known keys and ignores the rest).
``max_tokens`` is ``None`` when the client omitted it; the server then fills in
the room left in the model length instead of a small constant.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# One request may not fan out into more sequences than this (vLLM's VLLM_MAX_N_SEQUENCES).
MAX_N = 256


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="ignore")

    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logprobs: int | None = Field(None, ge=-1)
    prompt_logprobs: int | None = Field(None, ge=-1)
    detokenize: bool = True
    extra_args: dict[str, Any] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_to_list(cls, value: Any) -> Any:
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

    @field_validator("logprobs", "prompt_logprobs", mode="before")
    @classmethod
    def _bool_logprobs(cls, value: Any) -> Any:
        # vLLM accepts True as "the sampled token only plus one candidate"; False as off.
        if value is True:
            return 1
        if value is False:
            return None
        return value

    @model_validator(mode="after")
    def _consistent(self) -> SamplingParams:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are only supported when detokenize is true; use stop_token_ids")
        return self

    @property
    def provided(self) -> set[str]:
        """The keys the client actually sent (for server-side defaulting)."""
        return set(self.model_fields_set)
