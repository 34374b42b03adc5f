"""Render: OpenAI chat/completions requests -> ``GenerateRequest`` (chat template + tokenize + parse_context).

``/render`` is the authoritative preprocessing: the coupled OpenAI endpoints
call the same functions, so a rendered request and a coupled one reach the
engine identically.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from pdserve.protocol.errors import RequestError
from pdserve.protocol.generate import GenerateRequest, ParseContext, ReasoningParserKwargs
from pdserve.protocol.openai import ChatCompletionRequest, CompletionRequest, NamedToolChoice
from pdserve.protocol.sampling import SamplingParams
from pdserve.serve.app import AppState, format_validation_error
from pdserve.text.tokenizer import Tokenizer


def require_tokenizer(state: AppState) -> Tokenizer:
    if state.tokenizer is None:
        raise RequestError("this endpoint needs a tokenizer, but the server runs --tokens-only")
    return state.tokenizer


def _max_model_len(state: AppState) -> int | None:
    return state.engine.info.max_model_len if state.engine is not None else state.config.max_model_len


def _resolve_max_tokens(state: AppState, requested: int | None, prompt_len: int) -> int | None:
    limit = _max_model_len(state)
    if limit is None:
        return requested
    room = limit - prompt_len
    if room <= 0:
        raise RequestError(f"the prompt has {prompt_len} tokens; the model length is {limit}", param="messages")
    if requested is not None and requested > room:
        raise RequestError(
            f"max_tokens={requested} is over the {room} tokens left after the {prompt_len}-token prompt "
            f"(model length {limit})",
            param="max_tokens",
        )
    return requested if requested is not None else room


def _sampling(fields: dict[str, Any]) -> SamplingParams:
    """Build wire sampling params, keeping only what the client set (msgspec omit-defaults style)."""
    try:
        return SamplingParams.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        raise RequestError(format_validation_error(e)) from None


def _shared_sampling_fields(req: ChatCompletionRequest | CompletionRequest, max_tokens: int | None) -> dict[str, Any]:
    """The sampling fields chat and completions requests spell the same way."""
    return dict(
        n=req.n,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens or None,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        seed=req.seed,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos or None,
        prompt_logprobs=req.prompt_logprobs,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output or None,
        extra_args=req.vllm_xargs,
    )


def _check_tool_choice(state: AppState, chat: ChatCompletionRequest) -> None:
    parsers = state.parser_config
    has_tool_parser = parsers is not None and parsers.tool_call_parser is not None
    choice = chat.tool_choice
    if choice == "auto" and chat.tools and not (has_tool_parser and parsers.enable_auto_tool_choice):
        raise RequestError(
            '"auto" tool choice needs --enable-auto-tool-choice and --tool-call-parser on the server',
            param="tool_choice",
        )
    if (choice == "required" or isinstance(choice, NamedToolChoice)) and not has_tool_parser:
        raise RequestError(
            "tool_choice 'required' or a named tool needs --tool-call-parser on the server", param="tool_choice"
        )
    if isinstance(choice, NamedToolChoice):
        names = {t.function.name for t in chat.tools or []}
        if choice.function.name not in names:
            raise RequestError(
                "The tool specified in `tool_choice` does not match any of the specified `tools`",
                param="tool_choice",
            )


def parsers_active(state: AppState, chat: ChatCompletionRequest) -> bool:
    """Whether a parser will read this request's output (then special tokens must stay in the text)."""
    parsers = state.parser_config
    if parsers is None or not parsers.configured:
        return False
    return parsers.reasoning_parser is not None or chat.tool_choice != "none"


def text_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with OpenAI content-part lists flattened to strings (text parts only), so text chat
    templates can render them."""
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise RequestError(
                        f"messages[{i}].content: only text content parts are supported", param="messages"
                    )
                texts.append(part["text"])
            message = {**message, "content": "".join(texts)}
        out.append(message)
    return out


def render_chat(state: AppState, chat: ChatCompletionRequest, request_id: str | None = None) -> GenerateRequest:
    tokenizer = require_tokenizer(state)
    _check_tool_choice(state, chat)
    template_kwargs = dict(chat.chat_template_kwargs or {})
    tools = [t.model_dump(exclude_none=True) for t in chat.tools] if chat.tools else None
    try:
        prompt = tokenizer.apply_chat_template(
            text_messages(chat.messages),
            tools=tools,
            add_generation_prompt=chat.add_generation_prompt,
            continue_final_message=chat.continue_final_message,
            **template_kwargs,
        )
    except Exception as e:  # template errors (raise_exception, bad message shapes) are the client's
        raise RequestError(f"chat template failed: {e}", param="messages") from None
    token_ids = tokenizer.encode(prompt)
    if not token_ids:
        raise RequestError("No token_ids rendered", param="messages")
    max_tokens = _resolve_max_tokens(state, chat.max_completion_tokens or chat.max_tokens, len(token_ids))
    skip_special = chat.skip_special_tokens
    if parsers_active(state, chat):
        skip_special = False
    sampling = _sampling(
        _shared_sampling_fields(chat, max_tokens)
        | dict(logprobs=chat.top_logprobs if chat.logprobs else None, skip_special_tokens=skip_special)
    )
    parsers = state.parser_config
    reasoning_kwargs = None
    reasoning_ended = None
    if parsers is not None and parsers.reasoning_parser is not None:
        reasoning_kwargs = ReasoningParserKwargs(chat_template_kwargs=template_kwargs)
        if not chat.include_reasoning:
            reasoning_ended = True
    history_calls = sum(len(m.get("tool_calls") or []) for m in chat.messages if isinstance(m, dict))
    return GenerateRequest(
        request_id=f"chatcmpl-{request_id or chat.request_id}",
        token_ids=token_ids,
        sampling_params=sampling,
        model=chat.model,
        stream=bool(chat.stream),
        stream_options=chat.stream_options if chat.stream else None,
        return_token_ids=chat.return_token_ids,
        kv_transfer_params=chat.kv_transfer_params,
        cache_salt=chat.cache_salt,
        priority=chat.priority,
        reasoning_ended=reasoning_ended,
        reasoning_parser_kwargs=reasoning_kwargs,
        parse_context=ParseContext(
            tools=chat.tools,
            tool_choice=chat.tool_choice,
            parallel_tool_calls=chat.parallel_tool_calls,
            include_reasoning=chat.include_reasoning,
            chat_template_kwargs=template_kwargs,
            history_tool_call_cnt=history_calls,
        ),
    )


def completion_prompts(tokenizer: Tokenizer, prompt: Any) -> list[list[int]]:
    """All prompt shapes OpenAI allows: str, [str], [int], [[int]]."""
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if isinstance(prompt, list) and prompt:
        return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]
    raise RequestError("prompt must be a string, a list of strings, a list of token ids or a list of those")


def render_completion(state: AppState, req: CompletionRequest, request_id: str | None = None) -> list[GenerateRequest]:
    tokenizer = require_tokenizer(state)
    prompts = completion_prompts(tokenizer, req.prompt)
    base = f"cmpl-{request_id or req.request_id}"
    out = []
    for i, ids in enumerate(prompts):
        if not ids:
            raise RequestError(f"prompt {i} is empty", param="prompt")
        max_tokens = _resolve_max_tokens(state, req.max_tokens, len(ids))
        sampling = _sampling(
            _shared_sampling_fields(req, max_tokens)
            | dict(logprobs=req.logprobs, skip_special_tokens=req.skip_special_tokens)
        )
        out.append(
            GenerateRequest(
                request_id=base if len(prompts) == 1 else f"{base}-{i}",
                token_ids=ids,
                sampling_params=sampling,
                model=req.model,
                stream=bool(req.stream),
                stream_options=req.stream_options if req.stream else None,
                return_token_ids=req.return_token_ids,
                kv_transfer_params=req.kv_transfer_params,
                priority=req.priority,
            )
        )
    return out
