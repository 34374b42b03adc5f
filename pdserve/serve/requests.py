"""Client requests -> what the engine and the output layer run: the engine request, the output
config (stop rules, logprob cut, special tokens) and the per-choice parser factory.

Generate, the coupled OpenAI endpoints and stateless derender all build their configs here, so
one request is postprocessed the same way whichever surface it came through. Admission
(:mod:`pdserve.serve.admission`) calls the builders for a served request, with what validation parsed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from pdserve.output import live
from pdserve.output.request_state import ChoiceParser, OutputConfig
from pdserve.protocol.engine import EngineRequest, SequenceSampling, sampling_values
from pdserve.protocol.generate import GenerateRequest
from pdserve.protocol.kv import KVIntent
from pdserve.protocol.openai import ChatCompletionRequest, CompletionRequest
from pdserve.serve.state import AppState
from pdserve.text.detokenizer import StopConfig
from pdserve.text.logprobs import chat_top_limit, completion_top_limit

# A render server (no engine) with no --max-model-len bounds derender input by this.
DEFAULT_MAX_LEN = 131072
# No vocabulary has this many ids: a top_k past it keeps every candidate, as 0 does (the sampler reads any
# top_k >= vocab so); sent as 0, it stays in the engine wire's 64-bit range.
TOP_K_KEEPS_ALL = 2**31
# Engine sampling fields the server fills in rather than copying from the client's params.
_SET_BY_SERVER = ("max_tokens", "top_k", "bad_words_token_ids")


def make_parser_factory(
    state: AppState, context: ChatCompletionRequest | None, prompt_token_ids: Sequence[int]
) -> Callable[[], ChoiceParser] | None:
    """A factory of per-choice parsers, or None when plain text goes into ``message.content``."""
    if not state.parsers_configured:
        return None
    from pdserve.parsers import ChatParser

    config, tokenizer = state.parser_config, state.tokenizer
    return lambda: live.tracked(live.parsers, ChatParser(config, tokenizer, context, prompt_token_ids))


def skip_special_tokens(requested: bool | None, parser_reads_output: bool) -> bool | None:
    """Whether detokenization drops special tokens: as the client asked, unless a parser reads the
    text, which needs its markup tokens (vLLM's adjust_request does the same)."""
    return False if parser_reads_output else requested


def engine_request(
    req: GenerateRequest,
    request_id: str,
    max_tokens: int,
    stream_interval: int = 1,
    *,
    kv: KVIntent,
    bad_words_token_ids: list[list[int]] | None = None,
) -> EngineRequest:
    """The engine's view of a validated request: every engine sampling field as the client's params
    hold it (:data:`~pdserve.protocol.engine.SAMPLING_FIELDS`), but ``max_tokens`` resolved, ``top_k``
    fitted to the wire and ``bad_words`` as the id sequences validation tokenized; ``kv`` is the
    parsed intent of ``kv_transfer_params``."""
    sp = req.sampling_params
    if sp.bad_words and bad_words_token_ids is None:
        raise RuntimeError("bad_words reached the engine untokenized: build it through admission.admit")
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=req.token_ids,
        sampling=SequenceSampling(
            **sampling_values(sp, skip=_SET_BY_SERVER),
            max_tokens=max_tokens,
            top_k=0 if sp.top_k >= TOP_K_KEEPS_ALL else sp.top_k,
            bad_words_token_ids=bad_words_token_ids,
        ),
        kv_transfer_params=req.effective_kv_transfer_params(),
        kv=kv,
        priority=req.priority,
        extra_args=sp.extra_args,
        stream_interval=stream_interval,
        prior_output_tokens=req.prior_output_tokens,
        cache_salt=req.cache_salt,
        skip_reading_prefix_cache=bool(sp.skip_reading_prefix_cache),
    )


def output_config(
    state: AppState, req: GenerateRequest, context: ChatCompletionRequest | None, completions_cut: bool = False
) -> OutputConfig:
    """Postprocessing for one request; ``context`` is its parser context (derender). Candidate cuts:
    chat keeps k (sampled counted first), completions keep k+1, generate ``text`` keeps every
    candidate the engine returned."""
    sp = req.sampling_params
    parser_factory = None
    top_limit = None
    if req.derenders:
        parser_factory = make_parser_factory(state, context, req.prompt_ids)
        top_limit = chat_top_limit(sp.logprobs)
    elif completions_cut:
        top_limit = completion_top_limit(sp.logprobs)
    return OutputConfig(
        mode=req.output_mode,
        prompt_token_ids=req.prompt_ids,
        tokenizer=state.tokenizer,
        skip_special_tokens=bool(skip_special_tokens(sp.skip_special_tokens, parser_factory is not None)),
        # The engine's EOS ids, so a stop on EOS is told from any other "stop" the same way derender does.
        stop=StopConfig(
            tuple(sp.stop), sp.include_stop_str_in_output, sp.min_tokens, frozenset(sp.stop_token_ids),
            _eos_token_ids(state), sp.ignore_eos,
        ),
        want_logprobs=sp.logprobs is not None,
        top_logprobs_limit=top_limit,
        parser_factory=parser_factory,
        streaming=bool(req.stream),
        # Stream chunks embed logprob content as JSON written ahead; completions chunks have their own shape.
        encoded_logprobs=bool(req.stream) and not completions_cut,
    )


def stream_interval(state: AppState, req: GenerateRequest) -> int:
    """Tokens per stream chunk: the request's ``stream_interval`` raised to the server's
    ``--stream-interval`` (vLLM's rule); a batch request has no chunks to coalesce. Capped at the model
    length, which chunks the same (no sequence is longer) and keeps the engine wire's int in range."""
    if not req.stream:
        return 1
    asked = max(req.sampling_params.stream_interval or 1, state.config.stream_interval)
    return min(asked, state.require_engine().info.max_model_len)


# ---------------------------------------------------------------- stateless derender


def max_model_len(state: AppState) -> int:
    """The length derender input is bounded by: the engine's, else the configured one."""
    if state.engine is not None:
        return state.engine.info.max_model_len
    return state.config.max_model_len or DEFAULT_MAX_LEN


def _eos_token_ids(state: AppState) -> tuple[int, ...]:
    """The model's EOS ids, primary first: the engine's where there is one (so derender agrees with
    generate on the same server), else those of the tokenizer dir (a render server)."""
    if state.engine is not None:
        return tuple(state.engine.info.eos_token_ids)
    return state.tokenizer.eos_token_ids if state.tokenizer is not None else ()


def stop_tokens_config(state: AppState, request: ChatCompletionRequest | CompletionRequest | None) -> StopConfig:
    """What tells a stop token at the end of a response: the request's stop ids, the model's EOS ids."""
    if request is None:
        return StopConfig(eos_token_ids=_eos_token_ids(state))
    return StopConfig(
        include_stop_str_in_output=request.include_stop_str_in_output, min_tokens=request.min_tokens,
        stop_token_ids=frozenset(request.stop_token_ids or ()), eos_token_ids=_eos_token_ids(state),
        ignore_eos=request.ignore_eos,
    )


def batch_stop_config(
    state: AppState, finish_reason: str | None, stop_reason: int | str | None,
    request: ChatCompletionRequest | CompletionRequest | None,
) -> StopConfig:
    """Batch derender: stop strings to re-cut with, as vLLM does. None unless the response finished
    with "stop" and no stop token id; the matched string when the engine reported one (tokens mode
    returns the ids up to the one that completed it); else the request's list."""
    config = stop_tokens_config(state, request)
    if finish_reason != "stop" or isinstance(stop_reason, int):
        return config
    if isinstance(stop_reason, str):
        return replace(config, stop=(stop_reason,))
    stops = request.stop if request else None
    if isinstance(stops, str):
        stops = [stops]
    return replace(config, stop=tuple(s for s in stops or () if s))


def derender_chat_config(
    state: AppState, chat: ChatCompletionRequest | None, prompt_ids: Sequence[int], stop: StopConfig, streaming: bool,
    want_logprobs: bool,
) -> OutputConfig:
    factory = make_parser_factory(state, chat, prompt_ids)
    requested = chat is None or chat.skip_special_tokens is not False
    return OutputConfig(
        mode="derender", prompt_token_ids=prompt_ids, tokenizer=state.tokenizer,
        skip_special_tokens=bool(skip_special_tokens(requested, factory is not None)), stop=stop,
        want_logprobs=want_logprobs, top_logprobs_limit=derender_chat_top_limit(chat), parser_factory=factory,
        streaming=streaming,
    )


def derender_chat_top_limit(chat: ChatCompletionRequest | None) -> int | None:
    return chat_top_limit(chat.top_logprobs if chat is not None and chat.logprobs else None)


def derender_completion_config(
    state: AppState, req: CompletionRequest | None, prompt_ids: Sequence[int], stop: StopConfig, want_logprobs: bool
) -> OutputConfig:
    return OutputConfig(
        mode="text", prompt_token_ids=prompt_ids, tokenizer=state.tokenizer,
        skip_special_tokens=req is None or req.skip_special_tokens, stop=stop, want_logprobs=want_logprobs,
        top_logprobs_limit=completion_top_limit(req.logprobs if req is not None else None),
    )
