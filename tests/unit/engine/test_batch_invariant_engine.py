"""``--batch-invariant``: from the CLI flag to the engine, a sequence's output never depends on its batch."""

from __future__ import annotations

import asyncio

import pytest
from tokenizers import Tokenizer

from pdserve.checkpoints.resolve import resolve_model
from pdserve.cli import build_parser
from pdserve.engine.factory import build_engine
from pdserve.engine.spec import EngineSpec
from pdserve.protocol.engine import EngineOutput, EngineRequest, SequenceSampling
from pdserve.serve.cli import serve_config

MODEL = "smollm2-135m"
# More sequences than the ~32 rows at which oneDNN switches kernels on AMX CPUs.
BATCH = 40


def _outputs(spec: EngineSpec, prompts: list[list[int]]) -> list[list[EngineOutput]]:
    """Greedy outputs (with logprobs) of ``prompts`` decoded together by a fresh engine built from ``spec``."""

    async def go() -> list[list[EngineOutput]]:
        engine = build_engine(spec)
        await engine.start()
        try:
            sampling = SequenceSampling(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)

            async def one(i: int) -> list[EngineOutput]:
                request = EngineRequest(request_id=f"r{i}", prompt_token_ids=prompts[i], sampling=sampling)
                return [o async for o in engine.generate(request)]

            return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))
        finally:
            await engine.shutdown()

    return asyncio.run(go())


def test_batch_invariant_engine_gives_a_sequence_the_same_tokens_and_logprobs_in_a_wide_batch() -> None:
    """On AMX CPUs the default engine fails this: its logprobs in the batch differ in the last bits."""
    tokenizer = Tokenizer.from_file(str(resolve_model(MODEL) / "tokenizer.json"))

    def chat(text: str) -> list[int]:
        return tokenizer.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n").ids

    probe = chat("What is the capital of France?")
    others = [chat(f"Count to {i} in words" + ", please" * (i % 7)) for i in range(BATCH - 1)]
    spec = EngineSpec(kind="torch", model=MODEL, max_model_len=256, max_num_seqs=BATCH, batch_invariant=True)
    alone = _outputs(spec, [probe])[0]
    batched = _outputs(spec, [*others[:25], probe, *others[25:]])[25]
    assert [o.new_token_ids for o in batched] == [o.new_token_ids for o in alone]
    assert [o.new_logprobs for o in batched] == [o.new_logprobs for o in alone]


def test_batch_invariant_flag_reaches_the_engine_spec_and_is_off_by_default() -> None:
    parser = build_parser()
    assert serve_config(parser.parse_args(["serve", "--batch-invariant"])).engine.batch_invariant is True
    assert serve_config(parser.parse_args(["serve"])).engine.batch_invariant is False


def test_batch_invariant_flag_is_refused_for_the_scripted_engine() -> None:
    with pytest.raises(ValueError, match="--batch-invariant"):
        serve_config(build_parser().parse_args(["serve", "--engine", "scripted", "--batch-invariant"]))
