"""OpenAI-shaped wire types (chat/completions requests, messages, deltas, logprobs).

Field names follow vLLM 0.33: the parsed chain of thought is ``reasoning``
(``reasoning_content`` is accepted on input assistant messages only).

One file over the usual size on purpose: the request models carry vLLM's whole field list (each field
honoured or refused, see docs/protocol.md), and keeping them next to the message and delta shapes they
share keeps that audit in one place.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

import msgspec
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_serializer

from pdserve.protocol.limits import (
    MAX_DOCUMENTS,
    MAX_MESSAGES,
    MAX_PROMPTS,
    MAX_TOOLS,
    CacheSalt,
    EngineJSON,
    RequestId,
    TokenId,
)
from pdserve.protocol.sampling import asks_nothing


def random_hex() -> str:
    return uuid.uuid4().hex


def make_tool_call_id() -> str:
    return f"chatcmpl-tool-{random_hex()}"


class OpenAIModel(BaseModel):
    """Base for OpenAI types: unknown input keys are accepted (and ignored by us)."""

    model_config = ConfigDict(extra="allow")


# ---------------------------------------------------------------- tools


class FunctionDefinition(OpenAIModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolsParam(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedToolFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: NamedToolFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str = Field(default_factory=make_tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    id: str | None = None
    type: Literal["function"] | None = None
    index: int
    function: DeltaFunctionCall | None = None


# ---------------------------------------------------------------- messages


class MessageFunctionCall(OpenAIModel):
    name: str
    arguments: str | dict[str, Any]


class MessageToolCall(OpenAIModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: MessageFunctionCall


class MessageContentPart(OpenAIModel):
    type: str


class ChatMessageParam(OpenAIModel):
    """The shape of one input message, checked before any chat template reads it: a template that
    trips over a wrong type fails with an error naming nothing (``'int object' has no attribute ...``)."""

    role: str
    content: str | list[MessageContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None


_message_shape = TypeAdapter(ChatMessageParam)


def _checked_message(message: dict[str, Any]) -> dict[str, Any]:
    try:
        _message_shape.validate_python(message)
    except ValidationError as e:
        first = e.errors()[0]
        raise ValueError(f"{'.'.join(str(x) for x in first['loc'])}: {first['msg']}") from None
    return message


# An input message: kept as the dict the client sent (templates read any extra key), its shape checked.
MessageParam = Annotated[dict[str, Any], AfterValidator(_checked_message)]


def _drop_empty_tool_calls(data: dict[str, Any]) -> dict[str, Any]:
    if not data.get("tool_calls"):
        data.pop("tool_calls", None)
    return data


class ChatMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _serialize(self, handler: Any) -> dict[str, Any]:
        return _drop_empty_tool_calls(handler(self))


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _serialize(self, handler: Any) -> dict[str, Any]:
        return _drop_empty_tool_calls(handler(self))

    def is_empty(self) -> bool:
        return self.role is None and self.content is None and self.reasoning is None and not self.tool_calls


class TextDelta(msgspec.Struct):
    """A stream delta without tool calls: what a chat or derender stream sends for almost every token.

    Made per token on the hot path, so a plain struct, a fraction of a validated DeltaMessage's cost; a
    delta with tool calls is a DeltaMessage. Both read alike (role, content, reasoning, tool_calls,
    is_empty), and :meth:`message` gives the model where one is needed.
    """

    role: str | None = None
    content: str | None = None
    reasoning: str | None = None

    @property
    def tool_calls(self) -> list[DeltaToolCall]:
        return []

    def is_empty(self) -> bool:
        return self.role is None and self.content is None and self.reasoning is None

    def message(self) -> DeltaMessage:
        return DeltaMessage(role=self.role, content=self.content, reasoning=self.reasoning)

    def model_dump(self, **kwargs: Any) -> dict[str, Any]:
        """The DeltaMessage's dump, for code that reads either kind as a model (off the hot path)."""
        return self.message().model_dump(**kwargs)


# What a streaming parser step hands out: text only (the usual case) or a delta with tool calls.
StreamDelta = TextDelta | DeltaMessage


# ---------------------------------------------------------------- logprobs


class ChatCompletionLogProb(BaseModel):
    # Read by attribute too: the frontend decodes logprobs as plain structs (text.logprobs.TokenLogprobs).
    model_config = ConfigDict(from_attributes=True)

    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(BaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


# ---------------------------------------------------------------- usage / errors


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class StreamOptions(BaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


# ---------------------------------------------------------------- requests

# vLLM 0.33 request keys pdserve does not implement, with the values that ask for nothing (accepted).
# Anything else is a 400 naming the key: the client would otherwise get an answer it did not ask for.
# guided_* were removed from vLLM's request types (it now ignores them); pdserve refuses them because a
# client that sends one expects constrained output.
UNSUPPORTED_REQUEST_KEYS: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (False, None),
    "structured_outputs": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "guided_decoding_backend": (None,),
    "guided_whitespace_pattern": (None,),
    "structural_tag": (None,),
    "logprob_token_ids": (None,),
    "thinking_token_budget": (None, -1),
    "watermarking": (None, False),
    "truncate_prompt_tokens": (None,),
    "chat_template": (None,),
    "media_io_kwargs": (None,),
    "mm_processor_kwargs": (None,),
    "return_tokens_as_token_ids": (None, False),
    "return_weight_versions": (False, None),
    "routed_experts_prompt_start": (0, None),
    "return_token_offsets": (None, False),
    "return_prompt_text": (None, False),
    "ec_transfer_params": (None,),
    "repetition_detection": (None,),
    "echo": (False, None),
    "suffix": (None,),
    "prompt_embeds": (None,),
}

ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
# vLLM clamps OpenAI logit_bias values into this range.
LOGIT_BIAS_LIMIT = 100.0


class SamplingRequest(OpenAIModel):
    """The sampling fields chat and completions requests share (vLLM's names and defaults)."""

    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = Field(default_factory=list)
    response_format: dict[str, Any] | None = None
    add_special_tokens: bool = False
    # Tokens per stream chunk, raised to the server's --stream-interval; ignored without stream.
    stream_interval: int | None = Field(None, ge=1)

    def unsupported_key(self) -> str | None:
        """The first key that asks for something pdserve does not implement (None when all is served)."""
        if self.response_format is not None and self.response_format.get("type") != "text":
            return "response_format"
        for name, offs in UNSUPPORTED_REQUEST_KEYS.items():
            if name in self.model_fields_set or name in (self.model_extra or {}):
                if not asks_nothing(name, getattr(self, name, None), offs):
                    return name
        return None

    def clamped_logit_bias(self) -> dict[str, float] | None:
        """logit_bias with each value clamped to [-100, 100], as vLLM's OpenAI layer does."""
        if self.logit_bias is None:
            return None
        return {k: min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, v)) for k, v in self.logit_bias.items()}


class ChatCompletionRequest(SamplingRequest):
    """The chat request (also the RFC's ``chat_request`` parser context on generate)."""

    messages: list[MessageParam] = Field(max_length=MAX_MESSAGES)
    model: str | None = None
    tools: list[ChatCompletionToolsParam] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = "none"
    parallel_tool_calls: bool | None = True
    include_reasoning: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    min_tokens: int = 0
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    prompt_logprobs: int | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None
    request_id: RequestId = Field(default_factory=random_hex)
    kv_transfer_params: EngineJSON | None = None
    # Engine-specific knobs, forwarded as sampling_params.extra_args (vLLM's name).
    vllm_xargs: EngineJSON | None = None
    priority: int = 0
    cache_salt: CacheSalt | None = None
    # Passed to the chat template as vLLM does (reasoning_effort also sets enable_thinking).
    reasoning_effort: ReasoningEffort | None = None
    documents: list[dict[str, str]] | None = Field(None, max_length=MAX_DOCUMENTS)

    def model_post_init(self, __context: Any) -> None:
        # A request with tools and no explicit tool_choice means "auto" (OpenAI default).
        if self.tools and "tool_choice" not in self.model_fields_set:
            self.tool_choice = "auto"
        self._check_tool_choice()

    def _check_tool_choice(self) -> None:
        """A forced tool call needs a tool to call (vLLM refuses these too)."""
        names = {t.function.name for t in self.tools or []}
        if self.tool_choice == "required" and not names:
            raise ValueError("tool_choice='required' needs tools: send the tools the model may call, or "
                             "tool_choice 'auto' or 'none'")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError("The tool specified in `tool_choice` does not match any of the specified `tools`")

    def named_tool(self) -> str | None:
        """The forced tool's name when tool_choice names one."""
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None


class CompletionRequest(SamplingRequest):
    prompt: (
        str
        | Annotated[list[str], Field(max_length=MAX_PROMPTS)]
        | list[TokenId]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(max_length=MAX_PROMPTS)]
    )
    model: str | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    add_special_tokens: bool = True  # vLLM's completions default (chat's is False: the template adds them)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None
    request_id: RequestId = Field(default_factory=random_hex)
    kv_transfer_params: EngineJSON | None = None
    vllm_xargs: EngineJSON | None = None
    priority: int = 0
    cache_salt: CacheSalt | None = None


# ---------------------------------------------------------------- responses


def now() -> int:
    return int(time.time())


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None  # --enable-per-request-metrics


class ChatCompletionResponseStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None
    metrics: dict[str, Any] | None = None  # --enable-per-request-metrics


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    kv_transfer_params: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None  # --enable-per-request-metrics


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None
    metrics: dict[str, Any] | None = None  # --enable-per-request-metrics
