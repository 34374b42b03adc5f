"""Per-request parser construction for the derender level."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pdserve.output.request_state import ChoiceParser
from pdserve.protocol.generate import GenerateRequest
from pdserve.protocol.openai import ChatCompletionRequest
from pdserve.serve.app import AppState


def parser_context(req: GenerateRequest) -> ChatCompletionRequest | None:
    """The request's parser context: ``chat_request`` (RFC shape) or ``parse_context`` (what /render emits)."""
    if req.chat_request is not None:
        return req.chat_request
    if req.parse_context is not None:
        return req.parse_context.to_chat_request()
    return None


def parsers_configured(state: AppState) -> bool:
    return state.parser_config is not None and state.parser_config.configured and state.tokenizer is not None


def make_parser_factory(
    state: AppState, context: ChatCompletionRequest | None, prompt_token_ids: Sequence[int]
) -> Callable[[], ChoiceParser] | None:
    """A factory of per-choice parsers, or None when plain text goes into ``message.content``."""
    if not parsers_configured(state):
        return None
    from pdserve.parsers import ChatParser

    config, tokenizer = state.parser_config, state.tokenizer
    return lambda: ChatParser(config, tokenizer, context, prompt_token_ids)


def chat_parser_factory(state: AppState, req: GenerateRequest) -> Callable[[], ChoiceParser] | None:
    return make_parser_factory(state, parser_context(req), req.token_ids)
