"""Render: OpenAI chat/completions requests -> ``GenerateRequest`` (chat template + tokenize + parse_context).

``/render`` is the authoritative preprocessing: the coupled OpenAI endpoints
call the same functions, so a rendered request and a coupled one reach the
engine identically.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from pdserve.protocol.engine import SAMPLING_FIELDS
from pdserve.protocol.errors import RequestError
from pdserve.protocol.generate import GenerateRequest, ParseContext, ReasoningParserKwargs
from pdserve.protocol.openai import ChatCompletionRequest, CompletionRequest, NamedToolChoice, SamplingRequest
from pdserve.protocol.sampling import SamplingParams
from pdserve.serve.admission import model_max_tokens, resolve_max_tokens
from pdserve.serve.http.body import format_validation_error
from pdserve.serve.requests import skip_special_tokens
from pdserve.serve.state import AppState
from pdserve.text.tokenizer import Tokenizer

# vLLM's RequestOutputKind values as its render emits them in sampling_params.output_kind.
OUTPUT_KIND_DELTA = 1
OUTPUT_KIND_FINAL_ONLY = 2


def _max_model_len(state: AppState) -> int | None:
    return state.engine.info.max_model_len if state.engine is not None else state.config.max_model_len


def _max_tokens(state: AppState, requested: int | None, prompt_len: int) -> int | None:
    """The client's max_tokens, else the model's ``max_new_tokens`` capped by the room left (vLLM's rule,
    :func:`~pdserve.serve.admission.resolve_max_tokens`); a prompt or a max_tokens that does not fit
    the model length is the client's 400."""
    limit = _max_model_len(state)
    if limit is not None:
        room = limit - prompt_len
        if room <= 0:
            raise RequestError(f"the prompt has {prompt_len} tokens; the model length is {limit}", param="messages")
        if requested is not None and requested > room:
            raise RequestError(
                f"max_tokens={requested} is over the {room} tokens left after the {prompt_len}-token prompt "
                f"(model length {limit})",
                param="max_tokens",
            )
    return resolve_max_tokens(requested, prompt_len, limit, model_max_tokens(state))


def _sampling(fields: dict[str, Any]) -> SamplingParams:
    """Build wire sampling params, keeping only what the client set (msgspec omit-defaults style)."""
    try:
        return SamplingParams.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        raise RequestError(format_validation_error(e)) from None


def _generate_request(**fields: Any) -> GenerateRequest:
    """The rendered request; what the OpenAI request let through but generate refuses is the client's 400."""
    try:
        return GenerateRequest(**fields)
    except ValidationError as e:
        raise RequestError(format_validation_error(e)) from None


def _check_supported(req: SamplingRequest) -> None:
    """Refuse (400 naming the key) what vLLM would honour but pdserve does not implement."""
    name = req.unsupported_key()
    if name == "response_format":
        kind = (req.response_format or {}).get("type")
        raise RequestError(
            f"response_format of type {kind!r} is not supported: pdserve has no structured output; "
            'send {"type": "text"} or omit response_format',
            param="response_format",
        )
    if name is not None:
        raise RequestError(f"{name} is not supported by pdserve; omit it or send its default", param=name)


def _shared_sampling_fields(
    req: ChatCompletionRequest | CompletionRequest, max_tokens: int | None, model_defaults: dict[str, Any]
) -> dict[str, Any]:
    """The sampling fields chat and completions requests spell the same way (vLLM's to_sampling_params).

    A sampling knob the client left out takes the model's generation_config.json value, then the
    OpenAI default (vLLM's order: user, server default, OpenAI default).
    """

    def knob(name: str) -> Any:
        value = getattr(req, name)
        return value if value is not None else model_defaults.get(name)

    # Every engine sampling field the OpenAI request spells as the engine does, by name (the model's
    # defaults only name sampling knobs); the rest are spelled its own way, below, or per endpoint.
    engine_fields = {name: knob(name) for name in SAMPLING_FIELDS if name not in OPENAI_SPELLED_APART}
    return engine_fields | dict(
        max_tokens=max_tokens,
        min_tokens=req.min_tokens or None,
        ignore_eos=req.ignore_eos or None,
        logit_bias=req.clamped_logit_bias(),
        # Frontend-side fields (text, transport): not the engine's.
        stop=req.stop,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output or None,
        bad_words=req.bad_words,
        extra_args=req.vllm_xargs,
        stream_interval=req.stream_interval,
        # What vLLM's render emits: the output kind the request streams with, and a fresh object.
        output_kind=OUTPUT_KIND_DELTA if req.stream else OUTPUT_KIND_FINAL_ONLY,
        skip_clone=True,
    )


# Engine sampling fields an OpenAI request does not carry under the engine's name and value: set here
# (max_tokens resolved, unset when falsy, logit_bias clamped), per endpoint (logprobs: chat's
# top_logprobs, completions' logprobs) or by admission (bad_words tokenized into id sequences).
OPENAI_SPELLED_APART = frozenset(
    {"max_tokens", "min_tokens", "ignore_eos", "logit_bias", "logprobs", "bad_words_token_ids"}
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


def effective_template_kwargs(chat: ChatCompletionRequest) -> dict[str, Any]:
    """The request's chat_template_kwargs plus what reasoning_effort implies (vLLM: the effort is a
    template variable, and it switches thinking on or off unless enable_thinking was given)."""
    kwargs = dict(chat.chat_template_kwargs or {})
    if chat.reasoning_effort is not None:
        kwargs.setdefault("enable_thinking", chat.reasoning_effort != "none")
        kwargs["reasoning_effort"] = chat.reasoning_effort
    return kwargs


def render_chat(state: AppState, chat: ChatCompletionRequest, request_id: str | None = None) -> GenerateRequest:
    tokenizer = state.require_tokenizer()
    _check_supported(chat)
    _check_tool_choice(state, chat)
    if chat.continue_final_message and chat.add_generation_prompt and "add_generation_prompt" in chat.model_fields_set:
        raise RequestError(
            "Cannot set both continue_final_message and add_generation_prompt to true", param="continue_final_message"
        )
    if chat.top_logprobs and not chat.logprobs:
        raise RequestError("top_logprobs needs logprobs set to true", param="top_logprobs")
    template_kwargs = effective_template_kwargs(chat)
    tools = [t.model_dump(exclude_none=True) for t in chat.tools] if chat.tools else None
    documents = {"documents": chat.documents} if chat.documents is not None else {}
    try:
        prompt = tokenizer.apply_chat_template(
            text_messages(chat.messages),
            tools=tools,
            add_generation_prompt=chat.add_generation_prompt,
            continue_final_message=chat.continue_final_message,
            **documents,
            **template_kwargs,
        )
    except Exception as e:  # template errors (raise_exception, bad message shapes) are the client's
        raise RequestError(f"chat template failed: {e}", param="messages") from None
    token_ids = tokenizer.encode(prompt, add_special_tokens=chat.add_special_tokens)
    if not token_ids:
        raise RequestError("No token_ids rendered", param="messages")
    max_tokens = _max_tokens(state, chat.max_completion_tokens or chat.max_tokens, len(token_ids))
    skip_special = skip_special_tokens(chat.skip_special_tokens, parsers_active(state, chat))
    sampling = _sampling(
        _shared_sampling_fields(chat, max_tokens, tokenizer.generation_defaults)
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
    return _generate_request(
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


def completion_prompts(tokenizer: Tokenizer, prompt: Any, add_special_tokens: bool = True) -> list[list[int]]:
    """All prompt shapes OpenAI allows: str, [str], [int], [[int]] (ids are taken as they are)."""
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt, add_special_tokens=add_special_tokens)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if isinstance(prompt, list) and prompt:
        return [
            tokenizer.encode(p, add_special_tokens=add_special_tokens) if isinstance(p, str) else list(p)
            for p in prompt
        ]
    raise RequestError("prompt must be a string, a list of strings, a list of token ids or a list of those")


def render_completion(state: AppState, req: CompletionRequest, request_id: str | None = None) -> list[GenerateRequest]:
    tokenizer = state.require_tokenizer()
    _check_supported(req)
    prompts = completion_prompts(tokenizer, req.prompt, req.add_special_tokens)
    base = f"cmpl-{request_id or req.request_id}"
    out = []
    for i, ids in enumerate(prompts):
        if not ids:
            raise RequestError(f"prompt {i} is empty", param="prompt")
        max_tokens = _max_tokens(state, req.max_tokens, len(ids))
        sampling = _sampling(
            _shared_sampling_fields(req, max_tokens, tokenizer.generation_defaults)
            | dict(logprobs=req.logprobs, skip_special_tokens=req.skip_special_tokens)
        )
        out.append(
            _generate_request(
                request_id=base if len(prompts) == 1 else f"{base}-{i}",
                token_ids=ids,
                sampling_params=sampling,
                model=req.model,
                stream=bool(req.stream),
                stream_options=req.stream_options if req.stream else None,
                return_token_ids=req.return_token_ids,
                kv_transfer_params=req.kv_transfer_params,
                cache_salt=req.cache_salt,
                priority=req.priority,
            )
        )
    return out
