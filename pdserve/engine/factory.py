"""Build an engine from its spec: in this process (:func:`build_engine`) or as the step loop an
engine-core process drives (:func:`build_core`).

Runners are imported on demand, so a scripted server never loads torch. Runners import only
the spec, never this module.
"""

from __future__ import annotations

from pdserve.engine.api import Engine
from pdserve.engine.spec import EngineSpec
from pdserve.engine.stepping import StepCore


def build_engine(spec: EngineSpec) -> Engine:
    """Return an engine that runs in this process (call ``start()`` before use)."""
    if spec.kind == "scripted":
        from pdserve.engine.runners.scripted import ScriptedEngine

        return ScriptedEngine.from_spec(spec)
    if spec.kind == "torch":
        from pdserve.engine.runners.torch_runner import TorchEngine

        return TorchEngine.from_spec(spec)
    if spec.kind == "vllm":
        from pdserve.engine.runners.vllm_runner import VllmEngine

        return VllmEngine.from_spec(spec)
    raise _unknown(spec)


def build_core(spec: EngineSpec) -> StepCore:
    """Return a loaded step loop for the calling thread to drive (the engine core's main thread)."""
    if spec.kind == "scripted":
        from pdserve.engine.runners.scripted_core import ScriptedCore

        return ScriptedCore.from_spec(spec)
    if spec.kind == "torch":
        from pdserve.engine.runners.torch_runner import TorchSetup

        return TorchSetup.from_spec(spec).load()
    raise _unknown(spec)


def _unknown(spec: EngineSpec) -> ValueError:
    return ValueError(f"unknown engine kind {spec.kind!r}; choose 'scripted', 'torch' or 'vllm' (in process only)")
