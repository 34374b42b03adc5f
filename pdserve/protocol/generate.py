"""``POST /inference/v1/generate`` request and response types (vLLM 0.33 wire + ``output_mode``).

Responses and stream chunks are discriminated by ``output_mode``; a body without
the key is a ``tokens`` response (what servers that predate the field send).
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationInfo,
    field_validator,
    model_validator,
)

from pdserve.protocol.limits import MAX_ABORT_IDS, CacheSalt, ChoiceIndex, EngineJSON, GenerateRequestId, TokenId
from pdserve.protocol.openai import (
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionToolsParam,
    ChatMessage,
    DeltaMessage,
    NamedToolChoice,
    StreamOptions,
    UsageInfo,
)
from pdserve.protocol.sampling import SamplingParams

OutputMode = Literal["tokens", "text", "derender"]


def decodes_text(mode: OutputMode) -> bool:
    """The mode's answer carries text (``text``, ``derender``): it needs a tokenizer and detokenization.
    Asked here, by name, so a new mode is added in one place instead of at every comparison."""
    return mode != "tokens"


def parses_message(mode: OutputMode) -> bool:
    """The mode's answer is a chat message (``derender``): the reasoning and tool parsers run on it."""
    return mode == "derender"


class ParseContext(BaseModel):
    """What ``/render`` emits so a decode server can build the request's parsers."""

    model_config = ConfigDict(extra="allow")

    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = "none"
    parallel_tool_calls: bool | None = True
    include_reasoning: bool = True
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    history_tool_call_cnt: int = Field(0, ge=0)

    def to_chat_request(self) -> ChatCompletionRequest:
        """A message-less chat request carrying only the parser context."""
        names = {t.function.name for t in self.tools or []}
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError("The tool specified in `tool_choice` does not match any of the specified `tools`")
        return ChatCompletionRequest(
            messages=[],
            tools=self.tools,
            tool_choice=self.tool_choice,
            parallel_tool_calls=self.parallel_tool_calls,
            include_reasoning=self.include_reasoning,
            chat_template_kwargs=self.chat_template_kwargs,
        )


class ReasoningParserKwargs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)


class GenerateRequest(BaseModel):
    """vLLM 0.33's ``GenerateRequest`` (fields in its order, so /render bodies line up key by key) plus
    pdserve's ``chat_request`` parser context."""

    model_config = ConfigDict(extra="ignore")

    request_id: GenerateRequestId = Field(default_factory=lambda: uuid.uuid4().hex)
    token_ids: list[int] = Field(min_length=1)
    # Char offsets per prompt token (vLLM's render fills them on request); informational only.
    token_offsets: list[tuple[int, int]] | None = None
    # Multimodal inputs: pdserve serves text only, so these must be null (or empty).
    features: dict[str, Any] | None = None
    content_parts: list[dict[str, Any]] | None = None
    sampling_params: SamplingParams
    model: str | None = None
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: ReasoningParserKwargs | None = None
    return_token_ids: bool | None = None
    output_mode: OutputMode = "tokens"
    parse_context: ParseContext | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: CacheSalt | None = None
    priority: int = Field(0, ge=-(2**63), le=2**63 - 1)
    kv_transfer_params: EngineJSON | None = None
    # Encoder-cache transfer (multimodal disaggregation): text only here, so null.
    ec_transfer_params: dict[str, Any] | None = None
    chat_request: ChatCompletionRequest | None = None
    # pdserve: a resumed stream. Its prior output (streamed to the client by another server, whose decode
    # member then failed) ends token_ids, in stream chunks of these lengths. Those ids are treated as
    # output: replayed chunk by chunk into the detokenizer, stop strings and parsers (whose state depends
    # on the chunking) without being sent again, counted as completion tokens in usage and as output by
    # the engine's penalties; the engine continues after them. sampling_params.max_tokens / min_tokens
    # count the new tokens only.
    prior_output_chunks: list[Annotated[int, Field(ge=1)]] | None = None

    @field_validator("features", "ec_transfer_params")
    @classmethod
    def _text_only(cls, value: dict[str, Any] | None, info: ValidationInfo) -> dict[str, Any] | None:
        if value is not None:
            raise ValueError(f"multimodal {info.field_name} are not supported: pdserve serves text only; send null")
        return value

    @field_validator("content_parts")
    @classmethod
    def _no_content_parts(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if value:
            raise ValueError("multimodal content_parts are not supported: pdserve serves text only; send null")
        return value

    @property
    def detokenizes(self) -> bool:
        """Whether the output is text (``text``, ``derender``): serving it takes a tokenizer."""
        return self.output_mode != "tokens"

    @property
    def derenders(self) -> bool:
        """Whether the output is an OpenAI message (``derender``): the request's parsers read it."""
        return self.output_mode == "derender"

    @model_validator(mode="after")
    def _check_request(self) -> GenerateRequest:
        # DESIGN.md validation rules 2, 3 and 6 (the request alone decides these).
        if any(t < 0 for t in self.token_ids):
            raise ValueError("token_ids must be non-negative integers")
        if self.output_mode != "tokens" and "detokenize" in self.sampling_params.provided:
            if not self.sampling_params.detokenize:
                raise ValueError(
                    f"output_mode={self.output_mode!r} needs detokenization, but sampling_params.detokenize "
                    "is false; drop detokenize or use output_mode='tokens'"
                )
        if self.chat_request is not None and self.output_mode != "derender":
            raise ValueError(
                f"chat_request is only used with output_mode='derender' (got {self.output_mode!r}); "
                "set output_mode='derender' or drop chat_request"
            )
        if self.chat_request is not None and self.parse_context is not None:
            raise ValueError("give either chat_request or parse_context as parser context, not both")
        if self.prior_output_chunks:
            self._check_prior_output()
        return self

    def _check_prior_output(self) -> None:
        if self.prior_output_tokens >= len(self.token_ids):
            raise ValueError(
                f"prior_output_chunks hold {self.prior_output_tokens} ids, which leaves no prompt: they must "
                f"be fewer than the token_ids ({len(self.token_ids)}), which hold the prompt, then the prior output"
            )
        if not self.stream:
            raise ValueError("prior_output_chunks resume a stream; send stream=true (a batch request has "
                             "nothing sent yet to resume)")
        if self.sampling_params.n != 1:
            raise ValueError(f"prior_output_chunks continue one sequence; send n=1 (got n={self.sampling_params.n})")
        if self.sampling_params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs cannot be asked of a resumed stream (its prompt holds prior "
                             "output; the first leg sent the prompt's logprobs); drop prompt_logprobs")

    @property
    def prior_output_tokens(self) -> int:
        """How many of ``token_ids`` (the last ones) are prior output."""
        return sum(self.prior_output_chunks or ())

    @property
    def prompt_ids(self) -> list[int]:
        """The prompt: ``token_ids`` without the prior output ids."""
        return self.token_ids[: len(self.token_ids) - self.prior_output_tokens]

    @property
    def prior_output_chunk_ids(self) -> list[list[int]]:
        """The output already sent, chunk by chunk (``prior_output_chunks``), which this server continues."""
        chunks, pos = [], len(self.token_ids) - self.prior_output_tokens
        for size in self.prior_output_chunks or ():
            chunks.append(self.token_ids[pos : pos + size])
            pos += size
        return chunks

    def effective_kv_transfer_params(self) -> dict[str, Any] | None:
        """Top-level kv_transfer_params win over ``sampling_params.extra_args`` (llm-d sends either)."""
        if self.kv_transfer_params is not None:
            return self.kv_transfer_params
        extra = self.sampling_params.extra_args or {}
        return extra.get("kv_transfer_params")


# ---------------------------------------------------------------- logprobs (tokens level)


class GenerateLogProb(BaseModel):
    token_id: int
    logprob: float
    rank: int | None = None


class GenerateLogProbsContent(GenerateLogProb):
    top_logprobs: list[GenerateLogProb] = Field(default_factory=list)


class GenerateLogProbs(BaseModel):
    content: list[GenerateLogProbsContent] | None = None


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# ---------------------------------------------------------------- batch responses


class GenerateChoiceBase(BaseModel):
    index: ChoiceIndex
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None
    token_ids: list[TokenId] | None = None
    routed_experts: str | None = None
    sampling_mask: list[list[int]] | None = None
    weight_versions: list[dict[str, Any]] | None = None


class GenerateTokensChoice(GenerateChoiceBase):
    logprobs: GenerateLogProbs | None = None


class GenerateTextChoice(GenerateChoiceBase):
    text: str
    logprobs: ChatCompletionLogProbs | None = None


class GenerateDerenderChoice(GenerateChoiceBase):
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None


class GenerateResponseBase(BaseModel):
    request_id: str
    model: str | None = None
    created: int | None = None
    # Optional as in vLLM: derender accepts responses assembled elsewhere without it.
    usage: UsageInfo | None = None
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None
    prompt_token_id_logprobs: str | None = None
    prompt_token_ids: list[TokenId] | None = None
    mm_placeholders: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None


class GenerateTokensResponse(GenerateResponseBase):
    output_mode: Literal["tokens"] = "tokens"
    choices: list[GenerateTokensChoice]


class GenerateTextResponse(GenerateResponseBase):
    output_mode: Literal["text"] = "text"
    choices: list[GenerateTextChoice]


class GenerateDerenderResponse(GenerateResponseBase):
    output_mode: Literal["derender"] = "derender"
    choices: list[GenerateDerenderChoice]


# ---------------------------------------------------------------- stream chunks


class GenerateStreamChoiceBase(BaseModel):
    index: ChoiceIndex
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[TokenId] | None = None
    routed_experts: str | None = None
    sampling_mask: list[list[int]] | None = None
    weight_versions: list[dict[str, Any]] | None = None


class GenerateTokensStreamChoice(GenerateStreamChoiceBase):
    logprobs: GenerateLogProbs | None = None


class GenerateTextStreamChoice(GenerateStreamChoiceBase):
    text: str = ""
    logprobs: ChatCompletionLogProbs | None = None


class GenerateDerenderStreamChoice(GenerateStreamChoiceBase):
    delta: DeltaMessage = Field(default_factory=DeltaMessage)
    logprobs: ChatCompletionLogProbs | None = None


class GenerateStreamResponseBase(BaseModel):
    request_id: str
    usage: UsageInfo | None = None
    prompt_token_ids: list[TokenId] | None = None
    # Per-request timing (--enable-per-request-metrics) on the chunk that finishes the request.
    metrics: dict[str, Any] | None = None


class GenerateTokensStreamResponse(GenerateStreamResponseBase):
    output_mode: Literal["tokens"] = "tokens"
    choices: list[GenerateTokensStreamChoice]


class GenerateTextStreamResponse(GenerateStreamResponseBase):
    output_mode: Literal["text"] = "text"
    choices: list[GenerateTextStreamChoice]


class GenerateDerenderStreamResponse(GenerateStreamResponseBase):
    output_mode: Literal["derender"] = "derender"
    choices: list[GenerateDerenderStreamChoice]


def _mode_of(value: Any) -> str:
    if isinstance(value, dict):
        return value.get("output_mode") or "tokens"
    return getattr(value, "output_mode", "tokens")


GenerateResponse = Annotated[
    Annotated[GenerateTokensResponse, Tag("tokens")]
    | Annotated[GenerateTextResponse, Tag("text")]
    | Annotated[GenerateDerenderResponse, Tag("derender")],
    Discriminator(_mode_of),
]
GenerateStreamResponse = Annotated[
    Annotated[GenerateTokensStreamResponse, Tag("tokens")]
    | Annotated[GenerateTextStreamResponse, Tag("text")]
    | Annotated[GenerateDerenderStreamResponse, Tag("derender")],
    Discriminator(_mode_of),
]
generate_response_adapter: TypeAdapter[Any] = TypeAdapter(GenerateResponse)
generate_stream_response_adapter: TypeAdapter[Any] = TypeAdapter(GenerateStreamResponse)


class AbortRequest(BaseModel):
    request_ids: list[str] = Field(max_length=MAX_ABORT_IDS)
