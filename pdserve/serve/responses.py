"""Responses for prepared requests: the one stream runner, :func:`respond`, runs any response surface
(pdserve.output.surfaces) to completion (batch) or as merged update streams (SSE), with the direct writes
from the engine's dispatch, usage and per-request metrics.

Both paths tie the engine requests to the client connection: a client that
goes away cancels the drivers, whose cleanup aborts the engine requests.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from pdserve.engine.api import EngineError
from pdserve.output.policy import usage_of
from pdserve.output.request_state import ChoiceUpdate, RequestState
from pdserve.output.surfaces import Surface
from pdserve.protocol.engine import EngineRequest
from pdserve.protocol.errors import RequestError
from pdserve.protocol.openai import PromptTokensDetails, UsageInfo
from pdserve.protocol.sse import DONE, sse_event
from pdserve.serve.driver import Outlet, drive
from pdserve.serve.event_stream import DirectBody, DirectEvents, EventStreamResponse
from pdserve.serve.http.errors import engine_error_body, error_body
from pdserve.serve.http.handlers import logger, report_stream_error
from pdserve.serve.inflight import Prepared, StreamWatch
from pdserve.serve.state import AppState
from pdserve.serve.tracing import record_engine_requests
from pdserve.web.disconnect import ClientGone, unless_disconnected


async def respond(request: Request, state: AppState, prepared: Sequence[Prepared], surface: Surface,
                  stream: bool) -> Response:
    """Answer ``prepared`` (one client request's engine requests) on ``surface``: a batch answer, or an SSE
    stream of the surface's opening, a chunk per update that carries one, and its closing. Counted under
    the surface's labels."""
    states = [rstate for _, rstate in prepared]
    per_request_metrics = state.config.enable_per_request_metrics
    if not stream:
        def answer() -> BaseModel:
            metrics = states[0].metrics() if per_request_metrics and len(states) == 1 else None
            return surface.batch(states, total_usage(states, state.config.enable_prompt_tokens_details), metrics)

        return await respond_batch(request, state, prepared, surface.labels, answer)
    direct = DirectBody()
    return respond_stream(state, surface.labels, prepared, _events(state, prepared, surface, direct), direct)


def total_usage(states: Sequence[RequestState], cached_details: bool) -> UsageInfo:
    """Usage summed over a client request's engine requests (completions' prompts); with ``cached_details``
    (--enable-prompt-tokens-details) the prompt positions read from the prefix cache too."""
    prompt_tokens = sum(len(s.config.prompt_token_ids) for s in states)
    usage = usage_of(prompt_tokens, sum(s.completion_tokens for s in states))
    if cached_details:
        usage.prompt_tokens_details = PromptTokensDetails(cached_tokens=sum(s.num_cached_tokens for s in states))
    return usage


class _StreamEvents:
    """One stream's events, update by update: used by the stream's own loop and by the direct writes from
    the engine's dispatch alike (serve.driver), so both give the same bytes."""

    __slots__ = ("tokens_out", "states", "surface", "continuous", "metrics_of")

    def __init__(self, state: AppState, states: Sequence[RequestState], surface: Surface) -> None:
        self.tokens_out = state.metrics.tokens_out
        self.states = states
        self.surface = surface
        self.continuous = surface.continuous_usage
        # Per-request timing rides on the last chunk, when enabled and there is one request (as vLLM: a
        # multi-prompt completions request is several requests, with no one timing).
        self.metrics_of = states[0] if state.config.enable_per_request_metrics and len(states) == 1 else None

    def event(self, k: int, update: ChoiceUpdate) -> bytes | None:
        self.tokens_out.inc(len(update.token_ids))
        surface = self.surface
        if not surface.carries(update):
            return None
        rstate = self.states[k]
        usage = None
        if self.continuous:
            usage = usage_of(len(rstate.config.prompt_token_ids), len(rstate.choices[update.index].token_ids))
        timed = self.metrics_of
        metrics = timed.metrics() if timed is not None and timed.finished else None
        return surface.event(update, usage, metrics, k)

    def first(self, update: ChoiceUpdate) -> bytes | None:
        """:meth:`event` of the first (the only) request: the direct writes' event."""
        return self.event(0, update)


async def _events(state: AppState, prepared: Sequence[Prepared], surface: Surface,
                  direct: DirectBody) -> AsyncIterator[str | bytes]:
    states = [rstate for _, rstate in prepared]
    events = _StreamEvents(state, states, surface)
    for chunk in surface.opening():
        yield sse_event(chunk)
    async for k, update in merged_updates(state, prepared, DirectEvents(direct, events.first)):
        event = events.event(k, update)
        if event is not None:
            yield event
    for chunk in surface.closing(total_usage(states, state.config.enable_prompt_tokens_details)):
        yield sse_event(chunk)


async def run_batch(request: Request, state: AppState, prepared: Sequence[Prepared]) -> None:
    """Run every request to the end; raises ClientGone (after aborting) if the client leaves."""
    engine = state.require_engine()

    async def collect(ereq: EngineRequest, rstate: RequestState) -> None:
        async for update in drive(engine, ereq, rstate):
            state.metrics.tokens_out.inc(len(update.token_ids))

    await unless_disconnected(request.receive, asyncio.gather(*(collect(e, r) for e, r in prepared)))


async def respond_batch(
    request: Request,
    state: AppState,
    prepared: Sequence[Prepared],
    labels: tuple[str, str],
    build: Callable[[], BaseModel],
) -> Response:
    """Run to completion and answer with ``build()``; counts the request under ``labels``
    (endpoint, output mode) with its status: 200, 499 (client left) or the engine error's 5xx."""
    _admit(state, prepared, labels)
    state.metrics.running.inc()
    status = "200"
    try:
        await run_batch(request, state, prepared)
        return JSONResponse(build().model_dump(mode="json"))
    except ClientGone:
        status = "499"
        return Response(status_code=499)
    except EngineError as e:
        status = str(engine_error_body(e)[0])
        raise
    except RequestError as e:
        status = str(e.status)
        raise
    except Exception:
        status = "500"  # a server bug: the error handler answers 500, so the count must say so too
        raise
    finally:
        state.inflight.release(prepared)
        _answered(state, labels, status, prepared)


def _answered(state: AppState, labels: tuple[str, str], status: str, prepared: Sequence[Prepared]) -> None:
    """A request answered (batch or stream): out of the running gauge, counted under ``labels`` with its
    status, a success's TTFT and TPOT into their histograms, and with --otlp-traces-endpoint its spans."""
    state.metrics.running.dec()
    state.metrics.requests.labels(*labels, status).inc()
    if status == "200":
        state.metrics.observe_timing(rstate for _, rstate in prepared)
    if state.tracing is not None:
        record_engine_requests(prepared, status)


def _admit(state: AppState, prepared: Sequence[Prepared], labels: tuple[str, str]) -> None:
    """:meth:`InFlight.admit`, counting a refusal (503) under ``labels`` as every answer is counted."""
    try:
        state.inflight.admit(prepared)
    except RequestError as e:
        state.metrics.requests.labels(*labels, str(e.status)).inc()
        raise


def respond_stream(
    state: AppState,
    labels: tuple[str, str],
    prepared: Sequence[Prepared],
    events: AsyncIterator[str | bytes],
    direct: DirectBody | None = None,
) -> EventStreamResponse:
    """SSE response around an endpoint's events: the running gauge, any failure after the headers (engine
    error, a request error found late, a server bug) as a final ``data: {"error": ...}`` event,
    ``data: [DONE]`` last, and the request counted under ``labels`` with its status: 200, the error's
    status or 499 (client left). Admission (:meth:`InFlight.admit`) happens here, before the 200 headers: an
    overloaded or draining server answers 503. ``direct`` is where the response lends its connection to
    the events' producer (serve.event_stream.DirectBody)."""
    _admit(state, prepared, labels)

    async def framed() -> AsyncIterator[str | bytes]:
        state.metrics.running.inc()
        status = "200"
        try:
            # aclosing: a client that leaves closes the endpoint's events (and its drivers) at once.
            async with contextlib.aclosing(events) as inner:
                async for event in inner:
                    yield event
        except EngineError as e:
            code, body = engine_error_body(e)
            status = str(code)
            report_stream_error(code)
            yield sse_event(body)
        except RequestError as e:
            status = str(e.status)
            yield sse_event(e.to_response().model_dump())
        except Exception as e:  # a server bug after the 200 headers: still a verdict, never a silent stop
            logger.exception("pdserve: stream failed")
            status = "500"
            report_stream_error(500)
            yield sse_event(error_body(f"internal server error: {type(e).__name__}", 500, "InternalServerError"))
        except asyncio.CancelledError:
            status = "499"
            raise
        finally:
            _answered(state, labels, status, prepared)
        yield DONE

    watch = StreamWatch()
    state.inflight.streams.add(watch)

    def close() -> None:
        state.inflight.streams.discard(watch)
        state.inflight.release(prepared)

    return EventStreamResponse(framed(), watch, close, direct)


async def merged_updates(
    state: AppState, prepared: Sequence[Prepared], outlet: Outlet | None = None
) -> AsyncIterator[tuple[int, ChoiceUpdate]]:
    """Updates of several requests as they come, tagged with the request's position. ``outlet``
    (serve.driver) serves a single request only: several are merged through a queue, which the
    direct writes would overtake."""
    engine = state.require_engine()
    if len(prepared) == 1:
        ereq, rstate = prepared[0]
        async for update in drive(engine, ereq, rstate, outlet):
            yield 0, update
        return
    queue: asyncio.Queue[tuple[int, ChoiceUpdate] | BaseException | None] = asyncio.Queue()

    async def pump(k: int, ereq: EngineRequest, rstate: RequestState) -> None:
        try:
            async for update in drive(engine, ereq, rstate):
                await queue.put((k, update))
        except Exception as e:  # surfaced to the consumer below
            await queue.put(e)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(k, e, r)) for k, (e, r) in enumerate(prepared)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
