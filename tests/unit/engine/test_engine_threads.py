"""The torch engine sizes its thread pool from the CPUs it may run on, in a process of its own.

Each case runs in a fresh spawned process, as the engine core does: the thread count is
per-process state, and the affinity mask is narrowed there after torch has started its
OpenMP runtime (which sized itself from the wider mask), as a later ``taskset -p`` or a
CPU manager would do.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import pytest

from pdserve.engine.core import start_engine_core
from pdserve.engine.factory import build_engine
from pdserve.engine.runners.torch_runner import TorchEngine
from pdserve.engine.spec import EngineSpec
from pdserve.protocol.engine import EngineRequest, SequenceSampling

ALLOWED = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
needs_two_cpus = pytest.mark.skipif(len(ALLOWED) < 2, reason="needs at least 2 allowed CPUs to narrow the mask")


def _engine_threads_under(cpus: list[int]) -> tuple[int, int, int]:
    """In a fresh process: start torch on the full mask, narrow it to ``cpus``, start the engine as the core
    does (``build_engine``), decode a few tokens; return (torch threads before, engine threads, tokens)."""
    import torch

    torch.ones(64, 64) @ torch.ones(64, 64)  # the OpenMP runtime starts, sized from the full mask
    before = torch.get_num_threads()
    os.sched_setaffinity(0, cpus)

    async def go() -> tuple[int, int]:
        engine = build_engine(EngineSpec(kind="torch", model="qwen3-tiny", max_model_len=64, max_num_seqs=2))
        assert isinstance(engine, TorchEngine)
        await engine.start()
        try:
            sampling = SequenceSampling(max_tokens=4, ignore_eos=True)
            request = EngineRequest(request_id="r", prompt_token_ids=[9707, 11, 1879], sampling=sampling)
            produced = [t async for o in engine.generate(request) for t in o.new_token_ids]
            assert engine.info.intra_op_threads is not None
            return engine.info.intra_op_threads, len(produced)
        finally:
            await engine.shutdown()

    threads, produced = asyncio.run(go())
    return before, threads, produced


def _in_fresh_process(cpus: list[int]) -> tuple[int, int, int]:
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_engine_threads_under, cpus).result(timeout=300)


@needs_two_cpus
def test_engine_pinned_to_one_cpu_runs_one_thread() -> None:
    before, threads, produced = _in_fresh_process(ALLOWED[:1])
    if before < 2:
        pytest.skip("torch sizes itself to one thread here even on the full mask")
    assert threads == 1
    assert produced == 4


@needs_two_cpus
def test_engine_uses_every_allowed_cpu() -> None:
    _, threads, _ = _in_fresh_process(ALLOWED[:2])
    assert threads == 2


@needs_two_cpus
def test_omp_num_threads_still_caps_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    _, threads, _ = _in_fresh_process(ALLOWED[:2])
    assert threads == 1


def _core_threads_under(cpus: list[int]) -> int | None:
    """In a fresh process pinned to ``cpus``: start an engine-core process (it inherits the mask, as under
    ``taskset``) and return the thread count its ready message reports."""
    import torch

    torch.ones(64, 64) @ torch.ones(64, 64)
    os.sched_setaffinity(0, cpus)
    handle = start_engine_core(EngineSpec(kind="torch", model="qwen3-tiny", max_model_len=64, max_num_seqs=2))
    try:
        return handle.info.intra_op_threads
    finally:
        handle.shutdown()


@needs_two_cpus
def test_engine_core_process_reports_threads_sized_from_its_mask() -> None:
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        assert pool.submit(_core_threads_under, ALLOWED[:1]).result(timeout=300) == 1
        assert pool.submit(_core_threads_under, ALLOWED[:2]).result(timeout=300) == 2
