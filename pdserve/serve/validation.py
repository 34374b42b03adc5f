"""Server-side validation of generate requests (DESIGN.md rules that depend on the server).

Rules that the request alone decides live in the protocol validators; these
need the server's tokenizer, parser config and engine limits. Each failure is a
400 whose message says how to fix the request.
"""

from __future__ import annotations

from pdserve.protocol.errors import RequestError
from pdserve.protocol.generate import GenerateRequest
from pdserve.serve.app import AppState


def validate_generate(state: AppState, req: GenerateRequest) -> None:
    engine = state.require_engine()
    info = engine.info
    sp = req.sampling_params
    if req.model is not None and req.model != state.model_name:
        raise RequestError(
            f"model {req.model!r} is not served here; this server serves {state.model_name!r}",
            param="model",
            status=404,
            kind="NotFoundError",
        )
    # Rule 1: text/derender need a tokenizer.
    if req.output_mode != "tokens" and state.tokenizer is None:
        raise RequestError(
            f"output_mode={req.output_mode!r} needs a tokenizer, but this server runs --tokens-only; "
            "send output_mode='tokens' or route the request to a server that loads a tokenizer",
            param="output_mode",
        )
    # Rule 5: stop strings can never match without detokenization.
    if sp.stop and (state.tokenizer is None or state.config.tokens_only):
        raise RequestError(
            "stop strings are not supported on a --tokens-only server (they could never match); "
            "use sampling_params.stop_token_ids",
            param="sampling_params.stop",
        )
    # Rule 4: parser configured but no context -> raw markup would leak into content.
    if req.output_mode == "derender":
        parsers = state.parser_config
        if parsers is not None and parsers.configured and req.chat_request is None and req.parse_context is None:
            raise RequestError(
                "output_mode='derender' on a server with a reasoning or tool parser needs parser context: "
                "send parse_context (as /v1/chat/completions/render returns it) or chat_request; "
                "use output_mode='text' for plain text",
                param="parse_context",
            )
        if req.parse_context is not None:
            try:
                req.parse_context.to_chat_request()
            except ValueError as e:
                raise RequestError(str(e), param="parse_context") from None
    # Rule 6: limits.
    bad = next((t for t in req.token_ids if t >= info.vocab_size), None)
    if bad is not None:
        raise RequestError(
            f"token id {bad} is outside the vocabulary (size {info.vocab_size})", param="token_ids"
        )
    if sp.n > info.max_num_seqs:
        raise RequestError(f"n={sp.n} is over this server's limit of {info.max_num_seqs} sequences", param="n")
    prompt_len = len(req.token_ids)
    if prompt_len >= info.max_model_len:
        raise RequestError(
            f"the prompt has {prompt_len} tokens; this model's length is {info.max_model_len}, "
            "which leaves no room to generate",
            param="token_ids",
        )
    if sp.max_tokens is not None and prompt_len + sp.max_tokens > info.max_model_len:
        raise RequestError(
            f"prompt ({prompt_len} tokens) + max_tokens ({sp.max_tokens}) is over the model length "
            f"{info.max_model_len}; lower max_tokens to at most {info.max_model_len - prompt_len}",
            param="sampling_params.max_tokens",
        )
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(sp, name)
        if value is not None and (value < 0 or value > state.config.max_logprobs):
            raise RequestError(
                f"sampling_params.{name}={value} is not allowed; ask for 0..{state.config.max_logprobs} "
                "candidates per position",
                param=f"sampling_params.{name}",
            )
    if sp.min_tokens > (sp.max_tokens or info.max_model_len - prompt_len):
        raise RequestError("min_tokens is larger than the room left for generation", param="sampling_params.min_tokens")


def resolve_max_tokens(max_model_len: int, req: GenerateRequest) -> int:
    """The client's max_tokens, or all the room left in the model length when it sent none."""
    room = max_model_len - len(req.token_ids)
    return req.sampling_params.max_tokens if req.sampling_params.max_tokens is not None else room
