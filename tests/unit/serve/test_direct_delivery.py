"""The driver's direct path (serve.driver: updates emitted from the engine's dispatch while the stream's
task waits) against its own loop alone: for any outputs, steps, readiness of the outlet and pace of the
consumer, the client gets the same updates in the same order, and the direct path is really used.

Unit level: an engine made of the real OutputChannels (the same ones the engine-core client and the
torch engine deliver through), fed step by step by the test; the e2e test in
tests/e2e/test_engine_core.py checks the same path on a real server.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.api import DirectDelivery
from pdserve.engine.channels import OutputChannels
from pdserve.engine.messages import StepOutputs
from pdserve.output.request_state import ChoiceUpdate, OutputConfig, RequestState
from pdserve.protocol.engine import ABORT_BY_CLIENT, EngineOutput, EngineRequest, SequenceSampling
from pdserve.serve.driver import drive
from pdserve.text.detokenizer import StopConfig
from pdserve.text.tokenizer import Tokenizer

TOK = Tokenizer.load("qwen3")
RID = "r#1"
PROMPT = TOK.encode("Count:")


class ChannelEngine:
    """Delivers the outputs it is handed through real OutputChannels, as the engine-core client does."""

    def __init__(self) -> None:
        self.channels = OutputChannels()
        self.aborted: list[list[str]] = []
        self.stopped: list[int] = []

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        return self.channels.stream(request.request_id, lambda: None, lambda: self.aborted.append([RID]))

    def attach_sink(self, request_id: str, sink: Callable[[EngineOutput], bool]) -> bool:
        return self.channels.attach_sink(request_id, sink)

    def direct_outputs(self) -> int:
        return self.channels.direct_outputs

    async def abort(self, request_ids: list[str], cause: str = ABORT_BY_CLIENT) -> None:
        self.aborted.append(request_ids)

    async def stop_sequence(self, request_id: str, index: int) -> None:
        self.stopped.append(index)


@dataclass
class Outlet:
    """Ready or not by a drawn pattern; what it emits lands where the consumer's updates land."""

    pattern: list[bool]
    received: list[ChoiceUpdate]
    asked: int = 0
    emitted: int = 0

    def ready(self) -> bool:
        self.asked += 1
        return self.pattern[self.asked % len(self.pattern)]

    def emit(self, update: ChoiceUpdate) -> None:
        self.emitted += 1
        self.received.append(update)


@dataclass
class Plan:
    mode: str
    n: int
    steps: list[list[EngineOutput]]  # one engine step's outputs each; the last step finishes every sequence
    pauses: list[int] = field(default_factory=list)  # loop turns the consumer spends on each update


def run(plan: Plan, outlet_pattern: list[bool] | None, stop: tuple[str, ...] = ()) -> tuple[list, int, int]:
    """The updates the client gets, how many came the direct way, and the engine's direct count."""
    engine = ChannelEngine()
    assert isinstance(engine, DirectDelivery)
    config = OutputConfig(mode=plan.mode, prompt_token_ids=PROMPT, tokenizer=TOK,  # type: ignore[arg-type]
                          stop=StopConfig(stop=stop), streaming=True)
    state = RequestState(RID, plan.n, config)
    request = EngineRequest(request_id=RID, prompt_token_ids=PROMPT, sampling=SequenceSampling(max_tokens=64))
    received: list[ChoiceUpdate] = []
    outlet = None if outlet_pattern is None else Outlet(outlet_pattern, received)

    async def consume() -> None:
        k = 0
        async for update in drive(engine, request, state, outlet):  # type: ignore[arg-type]
            received.append(update)
            for _ in range(plan.pauses[k % len(plan.pauses)] if plan.pauses else 0):
                await asyncio.sleep(0)  # a write that waits for the client: steps keep coming meanwhile
            k += 1

    async def feed() -> None:
        for outputs in plan.steps:
            await asyncio.sleep(0)
            finished = [RID] if outputs is plan.steps[-1] else []
            engine.channels.deliver(StepOutputs(outputs=list(outputs), finished=finished))

    async def main() -> None:
        await asyncio.gather(consume(), feed())

    asyncio.run(main())
    return received, outlet.emitted if outlet else 0, engine.direct_outputs()


WORD_IDS = TOK.encode(" one two three four five six seven eight nine ten 你好 😀 <tool_call>")


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    mode = draw(st.sampled_from(["tokens", "text", "derender"]))
    n = draw(st.integers(1, 2))
    lengths = [draw(st.integers(1, 12)) for _ in range(n)]
    per_seq: list[list[EngineOutput]] = []
    for index, length in enumerate(lengths):
        ids = draw(st.lists(st.sampled_from(WORD_IDS), min_size=length, max_size=length))
        outs = [EngineOutput(request_id=RID, index=index, new_token_ids=[t]) for t in ids]
        outs[-1].finish_reason = draw(st.sampled_from(["length", "stop"]))
        per_seq.append(outs)
    steps: list[list[EngineOutput]] = []
    while any(per_seq):  # one output per unfinished sequence per step, sometimes two steps in one message
        step = [seq.pop(0) for seq in per_seq if seq]
        if steps and draw(st.booleans()):
            steps[-1].extend(step)
        else:
            steps.append(step)
    pauses = draw(st.lists(st.integers(0, 3), max_size=5))
    return Plan(mode, n, steps, pauses)


@settings(max_examples=150, deadline=None)
@given(plan=plans(), pattern=st.lists(st.booleans(), min_size=1, max_size=6))
def test_direct_delivery_gives_the_client_the_same_updates_in_order(plan: Plan, pattern: list[bool]) -> None:
    reference, _, _ = run(plan, None)
    got, emitted, direct = run(plan, pattern)
    assert got == reference
    assert emitted <= direct  # an output the sink took may release nothing (text held back): no update


def test_the_direct_path_carries_the_middle_of_a_stream() -> None:
    """With a ready outlet and a prompt consumer, only the first and the last output go through the loop."""
    ids = TOK.encode(" one two three four five six")
    steps = [[EngineOutput(request_id=RID, new_token_ids=[t])] for t in ids]
    steps[-1][0].finish_reason = "length"
    got, emitted, direct = run(Plan("text", 1, steps), [True])
    assert "".join(u.text for u in got) == " one two three four five six"
    assert direct == len(ids) - 2 and emitted == direct


def test_a_request_with_stop_strings_never_goes_direct() -> None:
    """There the frontend may end a sequence itself, which needs the engine told (stop_sequence)."""
    ids = TOK.encode(" one two three four")
    steps = [[EngineOutput(request_id=RID, new_token_ids=[t])] for t in ids]
    steps[-1][0].finish_reason = "length"
    got, emitted, direct = run(Plan("text", 1, steps), [True], stop=(" three",))
    assert (emitted, direct) == (0, 0)
    assert "".join(u.text for u in got) == " one two"
