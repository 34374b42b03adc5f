"""The in-process scripted engine: :class:`~pdserve.engine.runners.scripted_core.ScriptedCore` in the one
engine loop, on a thread of this process (:class:`~pdserve.engine.inproc.InProcessCore`).

The replay rules and state are the core's (see there). The loop steps every running request once per
``step_ms``, whether or not its consumer has read the previous step, as a model engine does: the same
loop, the same stream-interval holding and the same abort path as the engine core process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdserve.engine.inproc import InProcessCore
from pdserve.engine.runners.scripted_core import ScriptedCore, spec_options
from pdserve.engine.spec import EngineSpec, TokenScript


class ScriptedEngine(InProcessCore):
    """An in-process :class:`~pdserve.engine.api.Engine` that replays scripts (see module docstring)."""

    def __init__(self, scripts: Sequence[TokenScript], **options: Any) -> None:
        """``options`` are :class:`ScriptedCore`'s: vocab_size, eos_token_ids, tokens_per_step, step_ms, ..."""
        core = ScriptedCore(scripts, **options)
        super().__init__(lambda: core, core.info, thread_name="pdserve-scripted-engine")

    @classmethod
    def from_spec(cls, spec: EngineSpec) -> ScriptedEngine:
        return cls(spec.scripts, **spec_options(spec))
