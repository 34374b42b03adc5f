"""Server-side validation of generate requests (DESIGN.md rules that depend on the server).

Rules that the request alone decides live in the protocol validators; these
need the server's tokenizer, parser config and engine limits. Each failure is a
400 whose message says how to fix the request.

Validation reads the request once and hands back what it parsed on the way (:class:`Checked`: the KV
intent, the parser context, bad_words as id sequences), so admission (:mod:`pdserve.serve.admission`)
builds the engine request from those values instead of parsing them again, and the client's request
is never written to.
"""

from __future__ import annotations

from typing import NamedTuple

from pdserve.protocol.engine import EngineInfo
from pdserve.protocol.errors import RequestError
from pdserve.protocol.generate import GenerateRequest
from pdserve.protocol.kv import PARAM as KV_PARAM
from pdserve.protocol.kv import KVIntent, parse_kv_transfer_params
from pdserve.protocol.openai import ChatCompletionRequest
from pdserve.protocol.sampling import MAX_BAD_WORD_SEQUENCES, SamplingParams
from pdserve.serve.state import AppState
from pdserve.text.tokenizer import Tokenizer


class Checked(NamedTuple):
    """What validating a request parsed, each once: the request's KV hand-off intent, its parser context
    (derender only; None: plain text into ``message.content``) and its bad_words as banned id sequences
    (None when it has none)."""

    kv: KVIntent
    chat_context: ChatCompletionRequest | None
    bad_words_token_ids: list[list[int]] | None


def _check_kv_transfer(info: EngineInfo, req: GenerateRequest) -> KVIntent:
    """kv_transfer_params (vLLM NixlConnector keys) well formed, and a hand-off this server can do.

    With vLLM's own connector (``info.kv_connector``) the decode leg's pull keys are vLLM's to read.
    """
    kv = parse_kv_transfer_params(req.effective_kv_transfer_params(), pulls=info.kv_connector is None)
    if not kv.any:
        return kv
    if info.kv is None and info.kv_connector is None:
        raise RequestError(
            "kv_transfer_params ask for a KV hand-off (do_remote_decode / do_remote_prefill), but this server "
            "was started without --kv-transfer nixl; start prefill and decode servers with it, or drop the params",
            param=KV_PARAM,
        )
    leg, other = ("prefill", "decode") if kv.export else ("decode", "prefill")
    if info.kv_role == other:
        flag = "do_remote_decode" if kv.export else "do_remote_prefill"
        raise RequestError(
            f"kv_transfer_params.{flag} asks for a {leg} leg, but this server takes {other} legs only "
            f"(--kv-role {other}); send it to a {leg} server",
            param=KV_PARAM,
        )
    if kv.export and req.sampling_params.n != 1:
        raise RequestError("a prefill leg (do_remote_decode) must have n=1", param=KV_PARAM)
    if kv.remote_prefill and req.sampling_params.prompt_logprobs is not None:
        raise RequestError(
            "prompt_logprobs need the prompt computed on this server, but a decode leg (do_remote_prefill) pulls "
            "its KV; ask for prompt_logprobs on the prefill leg",
            param="sampling_params.prompt_logprobs",
        )
    return kv


def chat_context(req: GenerateRequest) -> ChatCompletionRequest | None:
    """The request's parser context: ``chat_request`` (RFC shape) or ``parse_context`` (what /render
    emits) as a message-less chat request; a parse_context that does not hold together is a 400."""
    if req.chat_request is not None:
        return req.chat_request
    if req.parse_context is None:
        return None
    try:
        return req.parse_context.to_chat_request()
    except ValueError as e:
        raise RequestError(str(e), param="parse_context") from None


def validate_generate(state: AppState, req: GenerateRequest) -> Checked:
    """Every server-side rule, in DESIGN.md's order (the first broken one is the 400); what the checks
    parsed comes back, for admission to build from."""
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
    if req.priority != 0:
        # vLLM refuses a non-zero priority unless priority scheduling is on; pdserve admits FCFS only.
        raise RequestError(
            f"priority={req.priority} needs priority scheduling, which this server does not run "
            "(requests are admitted first come, first served); send priority 0",
            param="priority",
        )
    # Rule 1: text/derender need a tokenizer.
    if req.detokenizes and state.tokenizer is None:
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
    if sp.bad_words and (state.tokenizer is None or state.config.tokens_only):
        raise RequestError(
            "bad_words are not supported on a --tokens-only server (they need the tokenizer); "
            "ban ids with sampling_params.logit_bias (-100) or allowed_token_ids instead",
            param="sampling_params.bad_words",
        )
    # Rule 4: parser configured but no context -> raw markup would leak into content.
    context = None
    if req.derenders:
        parsers = state.parser_config
        if parsers is not None and parsers.configured and req.chat_request is None and req.parse_context is None:
            raise RequestError(
                "output_mode='derender' on a server with a reasoning or tool parser needs parser context: "
                "send parse_context (as /v1/chat/completions/render returns it) or chat_request; "
                "use output_mode='text' for plain text",
                param="parse_context",
            )
        context = chat_context(req)
    kv = _check_kv_transfer(info, req)
    # Rule 6: limits.
    bad = next((t for t in req.token_ids if t >= info.vocab_size), None)
    if bad is not None:
        raise RequestError(
            f"token_ids: token id {bad} is outside the vocabulary (size {info.vocab_size})", param="token_ids"
        )
    _check_sampling_ids(sp, info.vocab_size)
    banned = None
    if sp.bad_words and state.tokenizer is not None:
        banned = bad_words_token_ids(state.tokenizer, sp.bad_words, info.vocab_size)
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
    return Checked(kv, context, banned)


def _check_sampling_ids(sp: SamplingParams, vocab_size: int) -> None:
    """Token ids inside sampling_params index the logits: each must be in the vocabulary."""
    for name, ids in (
        ("stop_token_ids", sp.stop_token_ids),
        ("allowed_token_ids", sp.allowed_token_ids or ()),
        ("logit_bias", sp.logit_bias or ()),
    ):
        bad = sorted(i for i in ids if i >= vocab_size)
        if bad:
            raise RequestError(
                f"sampling_params.{name} has token ids outside the vocabulary (size {vocab_size}): {bad[:8]}",
                param=f"sampling_params.{name}",
            )


def bad_words_token_ids(tokenizer: Tokenizer, words: list[str], vocab_size: int) -> list[list[int]]:
    """The id sequences that ``bad_words`` bans, tokenized the way vLLM does.

    Each word (leading whitespace dropped) is banned as it tokenizes at the start of a text; its
    space-prefixed form is banned too when that is a different word token of the same length (the
    mid-text spelling under byte-level BPE), so the word is blocked both at the start and after a space.
    """
    sequences: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip())
        if not bare:
            raise RequestError(
                f"bad_words entry {word!r} tokenizes to no tokens", param="sampling_params.bad_words"
            )
        sequences.append(bare)
        spaced = tokenizer.encode(" " + word.lstrip())
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(spaced)
    if len(sequences) > MAX_BAD_WORD_SEQUENCES:
        raise RequestError(
            f"bad_words tokenize into {len(sequences)} sequences; at most {MAX_BAD_WORD_SEQUENCES} are allowed",
            param="sampling_params.bad_words",
        )
    outside = sorted({i for seq in sequences for i in seq if i >= vocab_size})
    if outside:
        raise RequestError(
            f"bad_words tokenize into ids outside the model vocabulary (size {vocab_size}): {outside[:8]}",
            param="sampling_params.bad_words",
        )
    return sequences

