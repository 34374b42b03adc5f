"""The engine core process and its clients: routing, cross-client abort, death detection."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator

import pytest

from pdserve.engine import core_client
from pdserve.engine.api import EngineDeadError, EngineError
from pdserve.engine.core import EngineCoreHandle, start_engine_core
from pdserve.engine.core_client import EngineCoreClient
from pdserve.engine.spec import EngineSpec
from pdserve.protocol.engine import EngineOutput, EngineRequest, SequenceSampling
from tests.waiting import async_wait_until

PROMPT = [9707, 11, 1879, 0, 151644, 872, 198]


def req(rid: str, prompt: list[int] = PROMPT, **sampling: object) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=prompt, sampling=SequenceSampling(**sampling))  # type: ignore[arg-type]


async def collect(client: EngineCoreClient, request: EngineRequest) -> list[EngineOutput]:
    return [o async for o in client.generate(request)]


def token_ids(outputs: list[EngineOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


@pytest.fixture(scope="module")
def core() -> Iterator[EngineCoreHandle]:
    handle = start_engine_core(EngineSpec(kind="torch", model="qwen3-tiny", max_model_len=2048, max_num_seqs=8))
    yield handle
    handle.shutdown()


def test_two_clients_get_their_own_answers_and_either_can_abort(core: EngineCoreHandle) -> None:
    async def go() -> None:
        a = await EngineCoreClient.connect(core.addresses)
        b = await EngineCoreClient.connect(core.addresses)
        try:
            assert a.info == b.info == core.info and a.info.model_name == "qwen3-tiny"
            assert a.core_pid == core.process.pid
            ra, rb = await asyncio.gather(
                collect(a, req("from-a", max_tokens=5, temperature=0)),
                collect(b, req("from-b", max_tokens=7, temperature=0, n=2)),
            )
            assert {o.request_id for o in ra} == {"from-a"} and len(token_ids(ra)) == 5
            assert {o.request_id for o in rb} == {"from-b"} and len(token_ids(rb)) == 14
            assert token_ids(ra) == token_ids([o for o in rb if o.index == 0])[:5]

            # A long request of client a, aborted by client b: a's stream ends with the abort output.
            outputs: list[EngineOutput] = []
            async for o in a.generate(req("long", max_tokens=1500, temperature=0)):
                outputs.append(o)
                if len(outputs) == 3:
                    await b.abort(["long"])
            assert outputs[-1].finish_reason == "abort" and len(token_ids(outputs)) < 1500

            # An abort right behind the add (same connection, so ordered) still finds the request:
            # gather starts its tasks in order, and the first one sends the add before it waits.
            stream = a.generate(req("quick", max_tokens=1500, temperature=0))
            first, _ = await asyncio.gather(anext(stream), a.abort(["quick"]))
            quick = [first] + [o async for o in stream]
            assert quick[-1].finish_reason == "abort" and len(token_ids(quick)) < 1500

            # Errors come back as EngineError; the core keeps serving.
            with pytest.raises(EngineError, match="prompt_token_ids is empty"):
                await collect(b, req("bad", prompt=[]))
            # Stats come with heartbeats (each a new EngineStats): a later one reports nothing left running.
            stale = b.stats()
            await async_wait_until(
                lambda: b.stats() is not stale and b.stats().running_requests == 0,
                lambda: f"a heartbeat reports no running request (last: {b.stats()})",
            )
            assert b.is_healthy()
        finally:
            await a.shutdown()
            await b.shutdown()
        assert not a.is_healthy()

    asyncio.run(go())


@pytest.mark.parametrize("watch", ["pidfd", "poll"])
def test_core_death_fails_in_flight_requests_and_new_ones(watch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``pidfd``: the client waits on the core's pidfd and never reads /proc; ``poll``: where pidfds are
    missing, it polls the pid instead."""
    polled: list[int] = []
    if watch == "pidfd":
        monkeypatch.setattr(core_client, "_pid_alive", lambda pid: polled.append(pid) or True)
    else:
        monkeypatch.setattr(core_client, "_open_pidfd", lambda pid: None)
    handle = start_engine_core(EngineSpec(kind="torch", model="qwen3-tiny", max_model_len=4096))
    exited = f"engine core process {handle.process.pid} exited"  # the pid watch saw it, not a heartbeat timeout

    async def go() -> None:
        client = await EngineCoreClient.connect(handle.addresses)
        try:
            stream = client.generate(req("doomed", max_tokens=4000, temperature=0))
            await anext(stream)
            os.kill(handle.process.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match=exited):
                async for _ in stream:
                    pass
            assert not client.is_healthy()
            # A new request fails on its first step, with the same cause, without reaching any core.
            with pytest.raises(EngineDeadError, match=exited):
                await anext(client.generate(req("after")))
        finally:
            await client.shutdown()

    try:
        asyncio.run(go())
    finally:
        handle.shutdown()
    assert polled == []  # with a pidfd, /proc was never read


def test_startup_failure_reports_the_cause() -> None:
    with pytest.raises(EngineError, match="unknown model 'no-such-model'"):
        start_engine_core(EngineSpec(kind="torch", model="no-such-model"), ready_timeout=120)


@pytest.mark.slow
def test_smollm2_core_answers_through_the_client() -> None:
    import json

    import jinja2
    from tokenizers import Tokenizer

    from pdserve.checkpoints.resolve import resolve_model

    model_dir = resolve_model("smollm2-135m")
    template = json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.encode(jinja2.Template(template).render(messages=messages, add_generation_prompt=True)).ids
    handle = start_engine_core(EngineSpec(kind="torch", model="smollm2-135m", max_model_len=1024))

    async def go() -> list[EngineOutput]:
        client = await EngineCoreClient.connect(handle.addresses)
        try:
            return await collect(client, req("paris", prompt=prompt, max_tokens=20, temperature=0, logprobs=1))
        finally:
            await client.shutdown()

    try:
        outputs = asyncio.run(go())
    finally:
        handle.shutdown()
    assert "Paris" in tokenizer.decode(token_ids(outputs))
    assert outputs[-1].finish_reason == "stop" and outputs[-1].new_logprobs[0].ranks[0] == 1


def test_one_message_per_engine_step_reaches_the_client(core: EngineCoreHandle) -> None:
    """The hot path over the real core process: N streams decoding together cost one ZMQ message per
    step (not one per request), and the client dispatches each message in one pass."""
    streams, tokens = 6, 40

    async def go() -> tuple[int, list[list[EngineOutput]]]:
        client = await EngineCoreClient.connect(core.addresses)
        try:
            before = client.step_messages
            results = await asyncio.gather(
                *(collect(client, req(f"batched-{i}", max_tokens=tokens, temperature=0, ignore_eos=True))
                  for i in range(streams))
            )
            return client.step_messages - before, list(results)
        finally:
            await client.shutdown()

    messages, results = asyncio.run(go())
    assert all(len(token_ids(r)) == tokens for r in results)
    outputs = sum(len(r) for r in results)
    assert outputs >= streams * tokens
    # Requests admitted a few steps apart add a few steps; a message per output would be >= 240.
    assert messages <= tokens + 2 * streams, (messages, outputs)


def test_a_stream_interval_is_held_in_the_core_so_the_client_wakes_per_chunk(core: EngineCoreHandle) -> None:
    """With stream_interval 5 the core sends a request's outputs once per 5 tokens (the first token and the
    end at once): the same greedy tokens, in about a fifth of the messages; n=2 sequences are held apart."""
    tokens = 41

    async def go() -> tuple[dict[int, tuple[int, list[EngineOutput]]], list[EngineOutput]]:
        client = await EngineCoreClient.connect(core.addresses)
        try:
            runs = {}
            for interval in (1, 5):
                before = client.step_messages
                request = req(f"interval-{interval}", max_tokens=tokens, temperature=0, ignore_eos=True)
                request.stream_interval = interval
                outputs = await collect(client, request)
                runs[interval] = (client.step_messages - before, outputs)
            pair = req("interval-n2", max_tokens=12, temperature=0, ignore_eos=True, n=2)
            pair.stream_interval = 4
            return runs, await collect(client, pair)
        finally:
            await client.shutdown()

    runs, pair = asyncio.run(go())
    (per_step, every), (held, chunked) = runs[1], runs[5]
    assert token_ids(chunked) == token_ids(every) and len(token_ids(every)) == tokens
    assert [len(o.new_token_ids) for o in chunked] == [1] + [5] * 8
    assert chunked[-1].finish_reason == "length" and all(o.finish_reason is None for o in chunked[:-1])
    assert per_step >= tokens - 2 and held <= len(chunked) + 1, (per_step, held)
    for index in (0, 1):
        sizes = [len(o.new_token_ids) for o in pair if o.index == index]
        assert sizes == [1, 4, 4, 3], (index, sizes)
    assert token_ids([o for o in pair if o.index == 0]) == token_ids(every)[:12]
