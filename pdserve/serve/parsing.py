"""Per-request parser construction for the derender level."""

from __future__ import annotations

from collections.abc import Callable

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


def chat_parser_factory(state: AppState, req: GenerateRequest) -> Callable[[], ChoiceParser] | None:
    """A factory of per-choice parsers, or None when plain text goes into ``message.content``."""
    config = state.parser_config
    if config is None or not config.configured or state.tokenizer is None:
        return None
    from pdserve.parsers import ChatParser

    context = parser_context(req)
    tokenizer = state.tokenizer
    prompt = req.token_ids
    return lambda: ChatParser(config, tokenizer, context, prompt)
