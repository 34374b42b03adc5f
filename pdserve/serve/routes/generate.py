"""``POST /inference/v1/generate`` and the abort routes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, BackgroundTasks, Request
from fastapi.responses import Response

from pdserve.output.generate_builders import batch_response, stream_chunk
from pdserve.output.policy import usage_chunk, usage_of
from pdserve.output.request_state import ChoiceUpdate, RequestState
from pdserve.protocol.engine import EngineRequest
from pdserve.protocol.errors import RequestError
from pdserve.protocol.generate import AbortRequest, GenerateRequest, GenerateResponseBase
from pdserve.protocol.sse import sse_event, sse_event_bytes
from pdserve.serve.admission import admit
from pdserve.serve.driver import drive
from pdserve.serve.event_stream import DirectBody, DirectEvents
from pdserve.serve.http import parse_body
from pdserve.serve.responses import respond_batch, respond_stream
from pdserve.serve.state import AppState, app_state
from pdserve.text.logprobs import prompt_logprob_dicts

router = APIRouter()


@router.post("/inference/v1/generate")
async def generate(request: Request) -> Response:
    state = app_state(request)
    mode = "tokens"
    try:
        req = await parse_body(request, GenerateRequest)
        mode = req.output_mode
        # vLLM's wire behaviour: every generate request id takes this prefix, whatever its output_mode
        # (clients abort by it). Keep it as vLLM spells it.
        request_id = "generate-tokens-" + (request.headers.get("x-request-id") or req.request_id)
        ereq, rstate = admit(state, req, request_id).pair
    except RequestError as e:
        state.metrics.requests.labels("generate", mode, str(e.status)).inc()
        raise
    base = {
        "request_id": request_id,
        "model": state.model_name,
        "prompt_token_ids": req.token_ids if req.return_token_ids else None,
    }
    if req.stream:
        direct = DirectBody()
        return respond_stream(state, ("generate", req.output_mode), [(ereq, rstate)],
                              _stream(state, req, ereq, rstate, direct), direct)
    return await respond_batch(
        request, state, [(ereq, rstate)], ("generate", req.output_mode), _batch_builder(state, rstate, base)
    )


def _batch_builder(state: AppState, rstate: RequestState, base: dict) -> Callable[[], GenerateResponseBase]:
    def build() -> GenerateResponseBase:
        if rstate.prompt_logprobs is not None:
            base["prompt_logprobs"] = prompt_logprob_dicts(state.tokenizer, rstate.prompt_logprobs)
        base["kv_transfer_params"] = rstate.kv_transfer_params
        if state.config.enable_per_request_metrics:
            base["metrics"] = rstate.metrics()
        return batch_response(rstate, base)

    return build


class _StreamEvents:
    """One generate stream's events, update by update: used by the stream's own loop and by the direct
    writes from the engine's dispatch alike (serve.driver), so both give the same bytes."""

    def __init__(self, state: AppState, req: GenerateRequest, rstate: RequestState) -> None:
        self.state, self.req, self.rstate = state, req, rstate
        opts = req.stream_options
        self.include_usage = bool(opts and opts.include_usage)
        self.continuous = self.include_usage and bool(opts and opts.continuous_usage_stats)
        self.per_request_metrics = state.config.enable_per_request_metrics
        self.seen: set[int] = set()
        self.first_chunk = True

    def event(self, update: ChoiceUpdate) -> bytes | None:
        if update.is_empty():
            return None
        rstate = self.rstate
        self.state.metrics.tokens_out.inc(len(update.token_ids))
        usage = None
        if self.continuous:
            usage = usage_of(len(self.req.token_ids), len(rstate.choices[update.index].token_ids))
        metrics = rstate.metrics() if self.per_request_metrics and rstate.finished else None
        chunk = stream_chunk(rstate, update, usage, first_for_choice=update.index not in self.seen, metrics=metrics)
        self.seen.add(update.index)
        if self.first_chunk and self.req.return_token_ids:
            chunk["prompt_token_ids"] = self.req.token_ids
        self.first_chunk = False
        return sse_event_bytes(chunk)


async def _stream(
    state: AppState, req: GenerateRequest, ereq: EngineRequest, rstate: RequestState, direct: DirectBody
) -> AsyncIterator[str | bytes]:
    events = _StreamEvents(state, req, rstate)
    async for update in drive(state.require_engine(), ereq, rstate, DirectEvents(direct, events.event)):
        event = events.event(update)
        if event is not None:
            yield event
    if events.include_usage:
        head = {"request_id": rstate.request_id, "output_mode": req.output_mode}
        yield sse_event(usage_chunk(head, usage_of(len(req.token_ids), rstate.completion_tokens)))


async def _abort(request: Request, background: BackgroundTasks) -> Response:
    state = app_state(request)
    body = await parse_body(request, AbortRequest)
    engine = state.require_engine()
    background.add_task(engine.abort, body.request_ids)
    return Response(status_code=200)


router.add_api_route("/inference/v1/abort_requests", _abort, methods=["POST"])
router.add_api_route("/abort_requests", _abort, methods=["POST"])
