"""The vLLM runner keeps the Engine contract when vLLM takes an abort late: vLLM 0.32's engine core can run an
aborted request on for seconds (docs/compatibility.md, abort.stream), so the runner ends an aborted request's
stream itself at vLLM's next output. vLLM's AsyncLLM is replaced by one that ignores
every abort; the sampling params are vLLM's own."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pdserve.engine.runners.vllm_runner import VllmEngine
from pdserve.engine.spec import EngineSpec
from pdserve.protocol.engine import EngineOutput, EngineRequest, SequenceSampling


class DeafLLM:
    """Streams a token per step forever and ignores aborts (records them)."""

    errored = False

    def __init__(self) -> None:
        self.aborts: list[Any] = []

    async def abort(self, request_ids: Any) -> None:
        self.aborts.append(request_ids)

    def generate(self, prompt: Any, params: Any, request_id: str, priority: int = 0) -> AsyncIterator[Any]:
        async def steps() -> AsyncIterator[Any]:
            token = 0
            while True:
                token += 1
                seq = SimpleNamespace(index=0, token_ids=[token], logprobs=None, finish_reason=None, stop_reason=None)
                yield SimpleNamespace(outputs=[seq], num_cached_tokens=0, prompt_logprobs=None, kv_transfer_params=None)
                await asyncio.sleep(0)

        return steps()


def test_an_abort_vllm_loses_still_ends_the_stream_with_abort(model_dir: Path) -> None:
    engine = VllmEngine(model_dir, EngineSpec(kind="vllm", model=str(model_dir)))
    llm = engine._llm = DeafLLM()
    request = EngineRequest(request_id="r", prompt_token_ids=[1, 2, 3],
                            sampling=SequenceSampling(max_tokens=100_000, ignore_eos=True))

    async def go() -> list[EngineOutput]:
        outputs = []
        async for output in engine.generate(request):
            outputs.append(output)
            if len(outputs) == 3:
                await engine.abort(["r"], "client")
            assert len(outputs) < 10, "the stream ran on after its abort"
        return outputs

    outputs = asyncio.run(go())
    assert [o.finish_reason for o in outputs] == [None, None, None, "abort"]
    assert outputs[-1].abort_cause == "client" and len(llm.aborts) == 2  # ours, then the runner's own again
    assert not engine._running
