"""``POST /inference/v1/generate`` and the abort routes."""

from __future__ import annotations

from fastapi import APIRouter, BackgroundTasks, Request
from fastapi.responses import Response

from pdserve.output.surfaces import generate_surface
from pdserve.protocol.errors import RequestError
from pdserve.protocol.generate import AbortRequest, GenerateRequest
from pdserve.serve.admission import admit
from pdserve.serve.http.body import parse_body
from pdserve.serve.responses import respond
from pdserve.serve.state import app_state

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
    opts = req.stream_options
    surface = generate_surface(req.output_mode)(
        request_id, state.model_name, want_logprobs=rstate.config.want_logprobs,
        prompt_token_ids=req.prompt_ids if req.return_token_ids else None,
        include_usage=bool(opts and opts.include_usage), continuous_usage=bool(opts and opts.continuous_usage_stats),
        tokenizer=state.tokenizer,
    )
    return await respond(request, state, [(ereq, rstate)], surface, bool(req.stream))


async def _abort(request: Request, background: BackgroundTasks) -> Response:
    state = app_state(request)
    body = await parse_body(request, AbortRequest)
    engine = state.require_engine()
    background.add_task(engine.abort, body.request_ids)
    return Response(status_code=200)


router.add_api_route("/inference/v1/abort_requests", _abort, methods=["POST"])
router.add_api_route("/abort_requests", _abort, methods=["POST"])
