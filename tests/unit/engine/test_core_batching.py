"""The hot path of one engine step: one message per client, dispatched to its iterators in one pass,
and requests admitted in one step prefilled in one batch.

The core's turn runs the real torch step loop (qwen3-tiny); only the socket is a recording double,
so the test counts exactly what the core would put on the wire.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
import msgspec.structs
import pytest

from pdserve.engine.channels import OutputChannels
from pdserve.engine.core_server import CoreServer
from pdserve.engine.messages import AddRequest, CoreMessage, Hello, Ready, StepOutputs
from pdserve.engine.output_stream import OutputStreamClosed
from pdserve.engine.runners.torch_runner import TorchSetup
from pdserve.engine.step_loop import StepLoop
from pdserve.protocol.engine import EngineOutput, EngineRequest, PositionLogprobs, SequenceSampling

PROMPT = [9707, 11, 1879, 0, 151644, 872, 198]


class RecordingSocket:
    """Stands in for the ROUTER socket (nothing to receive) and the clients' output streams (every
    message a client is sent is recorded with the name of its stream)."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, Any]] = []
        self._decoder = msgspec.msgpack.Decoder(CoreMessage)

    def poll(self, timeout_ms: int) -> int:
        return 0

    def connect_stream(self, name: str) -> Any:
        recorder = self

        class Stream:
            backlog = 0

            def send(self, payload: bytes) -> None:
                recorder.sent.append((name.encode(), recorder._decoder.decode(payload)))

        return Stream()


@pytest.fixture(scope="module")
def steps() -> StepLoop:
    return TorchSetup.create("qwen3-tiny", max_model_len=64, max_num_seqs=8).load()


def request(rid: str, max_tokens: int) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=PROMPT, sampling=SequenceSampling(max_tokens=max_tokens))


def test_one_step_with_n_running_requests_is_one_message_per_client(steps: StepLoop) -> None:
    sock = RecordingSocket()
    server = CoreServer(steps, sock, parent_pid=0, connect_stream=sock.connect_stream)  # type: ignore[arg-type]
    clients = {b"a": ["a0", "a1", "a2", "a3"], b"b": ["b0", "b1"]}
    for identity, rids in clients.items():
        server.handle(identity, Hello(outputs=identity.decode()))
        for rid in rids:
            server.handle(identity, AddRequest(request(rid, max_tokens=5)))
    assert all(isinstance(message, Ready) for _, message in sock.sent)

    for turn in range(1, 4):  # the prefill(+first decode) step, then decode steps: all six requests run in each
        sock.sent.clear()
        server.turn(0.0)
        assert sorted(identity for identity, _ in sock.sent) == [b"a", b"b"], "one message per client per step"
        for identity, message in sock.sent:
            assert isinstance(message, StepOutputs) and message.step == turn
            assert sorted({o.request_id for o in message.outputs}) == clients[identity]
            assert all(len(o.new_token_ids) == 1 for o in message.outputs)

    while steps.has_work():  # drain, so the module's step loop is idle again
        server.turn(0.0)
    assert not server.owners


def test_a_step_batch_reaches_every_iterator_in_one_dispatch() -> None:
    async def go() -> dict[str, list[EngineOutput]]:
        channels = OutputChannels()
        rids = [f"r{i}" for i in range(5)]
        streams = {rid: channels.stream(rid, lambda: None, lambda: None) for rid in rids}
        firsts = {rid: asyncio.ensure_future(anext(stream)) for rid, stream in streams.items()}
        await asyncio.sleep(0)  # every iterator has opened its channel and waits
        outputs = [EngineOutput(request_id=rid, index=0, new_token_ids=[7]) for rid in rids]
        channels.deliver(StepOutputs(outputs=outputs, finished=rids))
        assert channels.batches_delivered == 1
        got = {rid: [await first] for rid, first in firsts.items()}
        for rid, stream in streams.items():
            got[rid] += [o async for o in stream]
        return got

    got = asyncio.run(go())
    assert {rid: [o.new_token_ids for o in outs] for rid, outs in got.items()} == {f"r{i}": [[7]] for i in range(5)}


def _admitted_together() -> list[EngineRequest]:
    """Requests of every kind a batched prefill must keep apart (7 sequences, 6 computed at first)."""

    def make(rid: str, prompt: list[int], **sampling: Any) -> EngineRequest:
        return EngineRequest(request_id=rid, prompt_token_ids=prompt, sampling=SequenceSampling(**sampling))

    return [
        make("pair", PROMPT, n=2, max_tokens=6, temperature=0.8, seed=3, logprobs=2),
        make("prompt-logprobs", [151644, 872, 198, *PROMPT], max_tokens=5, temperature=0, prompt_logprobs=3),
        make("one-token", [872], max_tokens=1, temperature=0),  # retires in the prefill step: its slot moves
        make("dropped", PROMPT[2:], n=2, max_tokens=4, temperature=0, logprobs=1),  # index 0 stopped while waiting
        make("long", list(range(300, 340)), max_tokens=7, temperature=0),
    ]


def _run(steps: StepLoop, requests: list[EngineRequest]) -> list[EngineOutput]:
    """Every output of ``requests`` added at once and run to the end (scheduled_at cleared)."""
    for r in requests:
        steps.add(r)
    steps.stop_sequence("dropped", 0)
    outputs: list[EngineOutput] = []
    while steps.has_work():
        steps.step()
        outputs += [msgspec.structs.replace(o, scheduled_at=None) for o in steps.take_outputs().outputs]
    return outputs


def _logprob_values(outputs: list[EngineOutput]) -> tuple[list[EngineOutput], list[float]]:
    """``outputs`` with every logprob value taken out (set to 0.0), and those values in order: the
    first must stay equal when a kernel rounds a float32 row a bit differently, the second close."""
    values: list[float] = []

    def zeroed(position: PositionLogprobs | None) -> PositionLogprobs | None:
        if position is None:
            return None
        values.extend(position.logprobs)
        return msgspec.structs.replace(position, logprobs=[0.0] * len(position.logprobs))

    stripped = [
        msgspec.structs.replace(
            o,
            new_logprobs=None if o.new_logprobs is None else [zeroed(p) for p in o.new_logprobs],
            prompt_logprobs=None if o.prompt_logprobs is None else [zeroed(p) for p in o.prompt_logprobs],
        )
        for o in outputs
    ]
    return stripped, values


@pytest.mark.parametrize(("dtype", "batch_invariant"), [("bfloat16", True), ("float32", False)])
def test_requests_admitted_together_prefill_in_one_batch_and_give_what_they_give_alone(
    dtype: str, batch_invariant: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """n=2 (its slot copied), prompt_logprobs, a one-token prompt that finishes at once, a sequence
    stopped while waiting: the same tokens, logprobs and prompt logprobs as each request alone."""
    steps = TorchSetup.create(
        "qwen3-tiny", dtype=dtype, max_model_len=128, max_num_seqs=8, batch_invariant=batch_invariant,
        enable_prefix_caching=False,  # each request alone computes its whole prompt again, as it did together
    ).load()
    batches: list[list[int]] = []
    prefill_batch = steps.model.prefill_batch

    def recording(token_ids: Any, lengths: list[int], *rest: Any) -> Any:
        batches.append(list(lengths))
        return prefill_batch(token_ids, lengths, *rest)

    monkeypatch.setattr(steps.model, "prefill_batch", recording)
    requests = _admitted_together()
    together = _run(steps, requests)
    assert batches == [[len(r.prompt_token_ids) for r in requests]], "one forward pass for all five prompts"
    assert steps.stats().prompt_tokens_computed == sum(len(r.prompt_token_ids) for r in requests)
    for r in requests:
        batched, alone = [o for o in together if o.request_id == r.request_id], _run(steps, [r])
        if batch_invariant:
            assert batched == alone, r.request_id
        else:  # the default kernels may round a row differently in another batch (docs/engine.md)
            (batched_rest, batched_values), (alone_rest, alone_values) = map(_logprob_values, (batched, alone))
            assert batched_rest == alone_rest, r.request_id
            assert batched_values == pytest.approx(alone_values, rel=1e-5, abs=1e-5), r.request_id
    plp = next(o.prompt_logprobs for o in together if o.request_id == "prompt-logprobs" and o.prompt_logprobs)
    assert len(plp) == len(requests[1].prompt_token_ids)
    assert {o.index for o in together if o.request_id == "dropped"} == {1}
    assert {o.index for o in together if o.request_id == "pair"} == {0, 1}


@pytest.mark.parametrize("stopping", [False, True])
def test_a_client_whose_output_stream_closed_loses_its_requests_and_is_reported_unless_the_loop_stops(
    steps: StepLoop, stopping: bool, caplog: pytest.LogCaptureFixture,
) -> None:
    """A stream that breaks under a running loop is a client gone wrong: a warning, and its requests aborted. Under
    a loop that is stopping (an in-process engine shutting down: its client closes its stream as the loop ends) it
    is the expected end, and says nothing."""
    sock, broken = RecordingSocket(), False

    def connect(name: str) -> Any:
        recording = sock.connect_stream(name)

        class Stream:
            backlog = 0

            def send(self, payload: bytes) -> None:
                if broken:
                    raise OutputStreamClosed("the client's output stream closed")
                recording.send(payload)

            def close(self) -> None:
                pass

        return Stream()

    server = CoreServer(steps, sock, parent_pid=0, connect_stream=connect)  # type: ignore[arg-type]
    server.handle(b"a", Hello(outputs="a"))
    server.handle(b"a", AddRequest(request("closing", max_tokens=50)))
    server.turn(0.0)
    assert server.owners == {"closing": b"a"}
    broken, server.stopped = True, stopping
    with caplog.at_level(logging.WARNING, logger="pdserve.engine.core_server"):
        server.turn(0.0)  # its step's outputs meet the closed stream: dropped, its request aborted
        assert not server.streams
        server.turn(0.0)  # the abort takes effect at the next step
    assert not server.owners
    warned = [r for r in caplog.records if "output stream closed" in r.getMessage()]
    assert len(warned) == (0 if stopping else 1)
    while steps.has_work():  # drain, so the module's step loop is idle again
        server.turn(0.0)
