"""Stateless ``/derender`` wire types (batch and client-carried streaming state)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from pydantic import BaseModel, Discriminator, Field, Tag, TypeAdapter, model_validator

from pdserve.protocol.generate import GenerateTokensResponse, GenerateTokensStreamResponse
from pdserve.protocol.limits import MAX_PROMPTS, TokenId
from pdserve.protocol.openai import (
    ChatCompletionRequest,
    ChatCompletionStreamResponse,
    CompletionRequest,
    CompletionStreamResponse,
)


class DerenderChatRequest(BaseModel):
    stream: Literal[False] = False
    model: str | None = None
    generate_response: GenerateTokensResponse
    prompt_tokens: int | None = Field(None, ge=0)
    prompt_token_ids: list[TokenId] | None = None
    chat_request: ChatCompletionRequest | None = None


class DerenderCompletionRequest(BaseModel):
    stream: Literal[False] = False
    model: str | None = None
    generate_responses: list[GenerateTokensResponse] = Field(min_length=1, max_length=MAX_PROMPTS)
    prompt_tokens: list[Annotated[int, Field(ge=0)]] | None = None
    prompt_token_ids: list[list[TokenId] | None] | None = None
    completion_request: CompletionRequest | None = None


class DerenderStreamState(BaseModel):
    """Everything a stateless server needs to continue a stream; the client echoes it verbatim.

    The parsed path replays ``output_token_ids`` in the original chunks
    (``output_chunk_lens``) into a fresh parser; the plain path replays only the
    last few ids, enough to rebuild an incomplete multi-byte character.

    ``prev_tokens``/``prefix_offset``/``read_offset`` are vLLM's plain-path decode window (token
    strings, and offsets into them). pdserve never writes them; it reads them, with vLLM's bounds,
    to continue a stream that a vLLM derenderer started.
    """

    role_sent: bool = False
    logprob_context_token_ids: list[TokenId] = Field(default_factory=list, max_length=4)
    logprob_text_offset: int = Field(0, ge=0)
    output_token_ids: list[TokenId] = Field(default_factory=list)
    output_chunk_lens: list[int] = Field(default_factory=list)
    tools_streamed: bool = False
    last_tool_call_ids: list[str] = Field(default_factory=list)
    prev_tokens: list[str] = Field(default_factory=list, max_length=1024)
    prefix_offset: int = Field(0, ge=0)
    read_offset: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _offsets_are_consistent(self) -> DerenderStreamState:
        if self.output_chunk_lens and (
            min(self.output_chunk_lens) <= 0 or sum(self.output_chunk_lens) != len(self.output_token_ids)
        ):
            raise ValueError("output_chunk_lens must be positive and sum to len(output_token_ids)")
        if not self.prefix_offset <= self.read_offset <= len(self.prev_tokens):
            raise ValueError("prefix_offset <= read_offset <= len(prev_tokens) must hold")
        return self


_encode = msgspec.json.Encoder().encode


def encode_stream_state(state: DerenderStreamState) -> bytes:
    """The state's JSON, from its fields as they are (all flat: bools, ints, lists of ids and strings): what
    ``model_dump_json`` writes, without pydantic's serializer walking every id of a long stream."""
    return _encode(dict(state))


class DerenderChatStreamRequest(BaseModel):
    stream: Literal[True]
    model: str | None = None
    generate_chunk: GenerateTokensStreamResponse
    stream_state: DerenderStreamState | None = None
    prompt_tokens: int | None = Field(None, ge=0)
    prompt_token_ids: list[TokenId] | None = None
    chat_request: ChatCompletionRequest | None = None


class DerenderCompletionStreamRequest(BaseModel):
    stream: Literal[True]
    model: str | None = None
    generate_chunk: GenerateTokensStreamResponse
    stream_state: DerenderStreamState | None = None
    prompt_tokens: int | None = Field(None, ge=0)
    prompt_token_ids: list[TokenId] | None = None
    completion_request: CompletionRequest | None = None


class DerenderChatStreamResponse(BaseModel):
    chunk: ChatCompletionStreamResponse
    stream_state: DerenderStreamState


class DerenderCompletionStreamResponse(BaseModel):
    chunk: CompletionStreamResponse
    stream_state: DerenderStreamState


def _stream_tag(value: Any) -> str:
    if isinstance(value, dict):
        return "stream" if value.get("stream") is True else "batch"
    return "stream" if getattr(value, "stream", False) else "batch"


def _batch_or_stream(batch: type[BaseModel], stream: type[BaseModel]) -> TypeAdapter[Any]:
    """One endpoint body: the batch request, or the streaming one when ``stream`` is true."""
    return TypeAdapter(
        Annotated[  # type: ignore[arg-type]  # a union of the classes given at run time
            Annotated[batch, Tag("batch")] | Annotated[stream, Tag("stream")], Discriminator(_stream_tag)
        ]
    )


chat_derender_adapter = _batch_or_stream(DerenderChatRequest, DerenderChatStreamRequest)
completion_derender_adapter = _batch_or_stream(DerenderCompletionRequest, DerenderCompletionStreamRequest)
