"""Build an in-process engine from a serialisable spec.

The spec is a msgspec Struct so the serve CLI can hand it to the engine-core
process unchanged; the same function builds the engine on either side.
"""

from __future__ import annotations

import msgspec

from pdserve.engine.api import Engine


class EngineSpec(msgspec.Struct, kw_only=True):
    kind: str  # "scripted" | "torch"
    model: str | None = None
    tokenizer: str | None = None
    script: str | None = None
    tokens_per_step: int = 1
    step_ms: float = 0.0
    max_model_len: int | None = None
    max_num_seqs: int = 16
    dtype: str = "bfloat16"
    seed: int = 0
    batch_invariant: bool = False  # torch: fixed-shape matmuls (see docs/engine.md)


def build_engine(spec: EngineSpec) -> Engine:
    """Return an engine that runs in this process (call ``start()`` before use)."""
    if spec.kind == "scripted":
        from pdserve.engine.runners.scripted import ScriptedEngine

        return ScriptedEngine.from_spec(spec)
    if spec.kind == "torch":
        from pdserve.engine.runners.torch_runner import TorchEngine

        return TorchEngine.from_spec(spec)
    raise ValueError(f"unknown engine kind {spec.kind!r}; choose 'scripted' or 'torch'")
