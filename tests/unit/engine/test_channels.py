"""The per-request channels behind ``Engine.generate``: order, ends, failures, and when an abort is owed."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator

import pytest

from pdserve.engine.api import EngineError
from pdserve.engine.channels import OutputChannels
from pdserve.engine.messages import RequestFailed, StepOutputs
from pdserve.protocol.engine import EngineOutput


def out(rid: str, token: int, finish: str | None = None) -> EngineOutput:
    return EngineOutput(request_id=rid, new_token_ids=[token], finish_reason=finish)


class Recorder:
    def __init__(self) -> None:
        self.submitted = 0
        self.abandoned = 0

    def submit(self) -> None:
        self.submitted += 1

    def abandon(self) -> None:
        self.abandoned += 1


def test_outputs_queued_before_and_after_the_reader_waits_come_in_order_then_the_end() -> None:
    async def main() -> tuple[list[int], Recorder]:
        channels, rec = OutputChannels(), Recorder()
        stream = channels.stream("r", rec.submit, rec.abandon)
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)  # the reader now waits on an empty channel
        channels.deliver(StepOutputs(outputs=[out("r", 1), out("other", 9)]))
        got = [(await first).new_token_ids[0]]
        channels.deliver(StepOutputs(outputs=[out("r", 2)]))
        channels.deliver(StepOutputs(outputs=[out("r", 3, "length")], finished=["r"]))
        got += [o.new_token_ids[0] async for o in stream]
        return got, rec

    got, rec = asyncio.run(main())
    assert got == [1, 2, 3]
    assert (rec.submitted, rec.abandoned) == (1, 0)


async def first_output(
    channels: OutputChannels, rec: Recorder, batch: StepOutputs
) -> tuple[AsyncGenerator[EngineOutput, None], EngineOutput]:
    """Open request "r"'s stream (the channel exists once its reader waits), deliver ``batch``, take one output."""
    stream = channels.stream("r", rec.submit, rec.abandon)
    first = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    channels.deliver(batch)
    return stream, await first


def test_a_consumer_that_stops_after_the_last_output_owes_no_abort() -> None:
    """The end is queued behind the last output in the same pass: the request is over, not abandoned."""

    async def main() -> Recorder:
        channels, rec = OutputChannels(), Recorder()
        stream, _ = await first_output(channels, rec, StepOutputs(outputs=[out("r", 1, "stop")], finished=["r"]))
        await stream.aclose()
        return rec

    assert asyncio.run(main()).abandoned == 0


def test_a_consumer_that_stops_while_the_request_runs_aborts_it() -> None:
    async def main() -> Recorder:
        channels, rec = OutputChannels(), Recorder()
        stream, _ = await first_output(channels, rec, StepOutputs(outputs=[out("r", 1), out("r", 2)]))
        await stream.aclose()
        return rec

    assert asyncio.run(main()).abandoned == 1


def test_a_reader_cancelled_while_waiting_aborts_and_the_channel_is_gone() -> None:
    async def main() -> tuple[Recorder, OutputChannels]:
        channels, rec = OutputChannels(), Recorder()
        stream = channels.stream("r", rec.submit, rec.abandon)
        waiting = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        await stream.aclose()
        channels.deliver(StepOutputs(outputs=[out("r", 1)]))  # for nobody now: dropped
        return rec, channels

    rec, channels = asyncio.run(main())
    assert rec.abandoned == 1
    assert channels._queues == {}


def test_a_failure_ends_the_stream_with_the_engine_error_and_no_abort() -> None:
    async def main() -> tuple[list[int], Recorder]:
        channels, rec = OutputChannels(), Recorder()
        batch = StepOutputs(outputs=[out("r", 1)], failed=[RequestFailed("r", "boom")])
        stream, first = await first_output(channels, rec, batch)
        got = [first.new_token_ids[0]]
        with pytest.raises(EngineError, match="boom"):
            async for o in stream:
                got.append(o.new_token_ids[0])
        return got, rec

    got, rec = asyncio.run(main())
    assert got == [1]
    assert rec.abandoned == 0


def test_a_second_stream_with_a_running_id_is_refused() -> None:
    async def main() -> None:
        channels, rec = OutputChannels(), Recorder()
        first, _ = await first_output(channels, rec, StepOutputs(outputs=[out("r", 1)]))
        with pytest.raises(EngineError, match="already running"):
            await anext(channels.stream("r", rec.submit, rec.abandon))
        await first.aclose()

    asyncio.run(main())


def test_a_sink_takes_outputs_while_the_reader_waits_and_the_reader_gets_the_rest() -> None:
    """What the sink takes is neither queued nor wakes the reader; what it declines and the end reach the reader."""

    async def main() -> tuple[list[int], list[int], int]:
        channels, rec = OutputChannels(), Recorder()
        stream, first = await first_output(channels, rec, StepOutputs(outputs=[out("r", 1)]))
        taken: list[int] = []
        assert channels.attach_sink("r", lambda o: o.finish_reason is None and not taken.append(o.new_token_ids[0]))
        second = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)
        channels.deliver(StepOutputs(outputs=[out("r", 2), out("r", 3)]))
        await asyncio.sleep(0)
        assert not second.done(), "outputs the sink took must not wake the reader"
        channels.deliver(StepOutputs(outputs=[out("r", 4, "length")], finished=["r"]))
        read = [(await second).new_token_ids[0]] + [o.new_token_ids[0] async for o in stream]
        return [first.new_token_ids[0]] + read, taken, channels.direct_outputs

    read, taken, direct = asyncio.run(main())
    assert taken == [2, 3] and direct == 2
    assert read == [1, 4]


def test_after_a_declined_output_everything_queues_until_the_reader_caught_up() -> None:
    """Order: once the sink declines, later outputs of the same pass (and of later passes, while the
    reader has not come back to an empty channel) are queued behind it, not sunk ahead of it."""

    async def main() -> tuple[list[int], list[int]]:
        channels, rec = OutputChannels(), Recorder()
        stream, _ = await first_output(channels, rec, StepOutputs(outputs=[out("r", 1)]))
        taken: list[int] = []

        def sink(o: EngineOutput) -> bool:
            if o.new_token_ids[0] == 2:
                return False
            taken.append(o.new_token_ids[0])
            return True

        channels.attach_sink("r", sink)
        nxt = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)
        channels.deliver(StepOutputs(outputs=[out("r", 2), out("r", 3)]))
        channels.deliver(StepOutputs(outputs=[out("r", 4)]))
        read = [(await nxt).new_token_ids[0], (await anext(stream)).new_token_ids[0],
                (await anext(stream)).new_token_ids[0]]
        later = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)  # the reader waits on an empty channel again: the sink takes the next
        channels.deliver(StepOutputs(outputs=[out("r", 5)], finished=["r"]))
        with contextlib.suppress(StopAsyncIteration):
            await later
        return read, taken

    read, taken = asyncio.run(main())
    assert read == [2, 3, 4]
    assert taken == [5]


def test_no_sink_without_a_running_request() -> None:
    assert not OutputChannels().attach_sink("nobody", lambda o: True)
