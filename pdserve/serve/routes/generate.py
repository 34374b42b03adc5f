"""``POST /inference/v1/generate`` and the abort routes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, BackgroundTasks, Request
from fastapi.responses import Response

from pdserve.engine.api import EngineRequest, SequenceSampling
from pdserve.output.driver import drive
from pdserve.output.generate_builders import batch_response, stream_chunk, usage_of
from pdserve.output.request_state import OutputConfig, RequestState
from pdserve.protocol.errors import RequestError
from pdserve.protocol.generate import AbortRequest, GenerateRequest, GenerateResponseBase
from pdserve.serve.app import AppState, app_state, parse_body
from pdserve.serve.parsing import chat_parser_factory
from pdserve.serve.running import respond_batch, respond_stream
from pdserve.serve.sse import sse_event
from pdserve.serve.validation import resolve_max_tokens, validate_generate
from pdserve.text.detokenizer import StopConfig
from pdserve.text.logprobs import prompt_logprob_dicts

router = APIRouter()


def engine_request(req: GenerateRequest, request_id: str, max_tokens: int) -> EngineRequest:
    """The engine's view of a validated request (validation tokenized ``bad_words`` into id sequences)."""
    sp = req.sampling_params
    if sp.bad_words and sp.bad_words_token_ids is None:
        raise RuntimeError("bad_words reached the engine untokenized: validate_generate must run first")
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=req.token_ids,
        sampling=SequenceSampling(
            n=sp.n,
            max_tokens=max_tokens,
            min_tokens=sp.min_tokens,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            min_p=sp.min_p,
            seed=sp.seed,
            stop_token_ids=sp.stop_token_ids,
            ignore_eos=sp.ignore_eos,
            presence_penalty=sp.presence_penalty,
            frequency_penalty=sp.frequency_penalty,
            repetition_penalty=sp.repetition_penalty,
            logit_bias=sp.logit_bias,
            allowed_token_ids=sp.allowed_token_ids,
            bad_words_token_ids=sp.bad_words_token_ids,
            logprobs=sp.logprobs,
            prompt_logprobs=sp.prompt_logprobs,
        ),
        kv_transfer_params=req.effective_kv_transfer_params(),
        priority=req.priority,
        extra_args=sp.extra_args,
    )


def output_config(state: AppState, req: GenerateRequest, completions_cut: bool = False) -> OutputConfig:
    """Postprocessing for one request. Candidate cuts: chat keeps k (sampled counted first),
    completions keep k+1, generate ``text`` keeps every candidate the engine returned."""
    sp = req.sampling_params
    parser_factory = None
    top_limit = None
    if req.output_mode == "derender":
        parser_factory = chat_parser_factory(state, req)
        top_limit = None if sp.logprobs is None else max(sp.logprobs, 0)
    elif completions_cut and sp.logprobs is not None:
        top_limit = sp.logprobs + 1
    skip_special = sp.skip_special_tokens
    if parser_factory is not None and state.parser_config is not None and state.parser_config.configured:
        skip_special = False  # parsers need their markup tokens (vLLM's adjust_request does the same)
    return OutputConfig(
        mode=req.output_mode,
        prompt_token_ids=req.token_ids,
        tokenizer=state.tokenizer,
        skip_special_tokens=skip_special,
        # The engine's EOS ids, so a stop on EOS is told from any other "stop" the same way derender does.
        stop=StopConfig(
            tuple(sp.stop), sp.include_stop_str_in_output, sp.min_tokens, frozenset(sp.stop_token_ids),
            tuple(state.require_engine().info.eos_token_ids), sp.ignore_eos,
        ),
        want_logprobs=sp.logprobs is not None,
        top_logprobs_limit=top_limit,
        parser_factory=parser_factory,
        streaming=bool(req.stream),
    )


def prepare(
    state: AppState, req: GenerateRequest, request_id: str, completions_cut: bool = False
) -> tuple[EngineRequest, RequestState]:
    """The engine request and its request-scoped output state (call after validation)."""
    model_max_tokens = state.tokenizer.generation_defaults.get("max_tokens") if state.tokenizer else None
    max_tokens = resolve_max_tokens(state.require_engine().info.max_model_len, req, model_max_tokens)
    rstate = RequestState(request_id, req.sampling_params.n, output_config(state, req, completions_cut))
    return engine_request(req, request_id, max_tokens), rstate


@router.post("/inference/v1/generate")
async def generate(request: Request) -> Response:
    state = app_state(request)
    mode = "tokens"
    try:
        req = await parse_body(request, GenerateRequest)
        mode = req.output_mode
        validate_generate(state, req)
    except RequestError as e:
        state.metrics.requests.labels("generate", mode, str(e.status)).inc()
        raise
    request_id = "generate-tokens-" + (request.headers.get("x-request-id") or req.request_id)
    ereq, rstate = prepare(state, req, request_id)
    base = {
        "request_id": request_id,
        "model": state.model_name,
        "prompt_token_ids": req.token_ids if req.return_token_ids else None,
    }
    if req.stream:
        return respond_stream(state, ("generate", req.output_mode), _stream(state, req, ereq, rstate))
    return await respond_batch(
        request, state, [(ereq, rstate)], ("generate", req.output_mode), _batch_builder(state, rstate, base)
    )


def _batch_builder(state: AppState, rstate: RequestState, base: dict) -> Callable[[], GenerateResponseBase]:
    def build() -> GenerateResponseBase:
        if rstate.prompt_logprobs is not None:
            base["prompt_logprobs"] = prompt_logprob_dicts(state.tokenizer, rstate.prompt_logprobs)
        base["kv_transfer_params"] = rstate.kv_transfer_params
        return batch_response(rstate, base)

    return build


async def _stream(state: AppState, req: GenerateRequest, ereq: EngineRequest, rstate: RequestState) -> AsyncIterator[str]:
    engine = state.require_engine()
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = include_usage and bool(opts and opts.continuous_usage_stats)
    prompt_len = len(req.token_ids)
    seen: set[int] = set()
    first_chunk = True
    async for update in drive(engine, ereq, rstate):
        if update.is_empty():
            continue
        state.metrics.tokens_out.inc(len(update.token_ids))
        usage = None
        if continuous:
            usage = usage_of(prompt_len, len(rstate.choices[update.index].token_ids))
        chunk = stream_chunk(rstate, update, usage, first_for_choice=update.index not in seen)
        seen.add(update.index)
        if first_chunk and req.return_token_ids:
            chunk["prompt_token_ids"] = req.token_ids
        first_chunk = False
        yield sse_event(chunk)
    if include_usage:
        usage_chunk: dict[str, Any] = {
            "request_id": rstate.request_id,
            "output_mode": req.output_mode,
            "choices": [],
            "usage": usage_of(prompt_len, rstate.completion_tokens).model_dump(exclude_none=True),
        }
        yield sse_event(usage_chunk)


async def _abort(request: Request, background: BackgroundTasks) -> Response:
    state = app_state(request)
    body = await parse_body(request, AbortRequest)
    engine = state.require_engine()
    background.add_task(engine.abort, body.request_ids)
    return Response(status_code=200)


router.add_api_route("/inference/v1/abort_requests", _abort, methods=["POST"])
router.add_api_route("/abort_requests", _abort, methods=["POST"])
