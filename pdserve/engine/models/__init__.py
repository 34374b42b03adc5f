"""Supported architectures and the one way to load them from a Hugging Face-style dir."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from pdserve.engine.models.llama import DECODE_MICROBATCH, KVCache, LlamaForCausalLM, ModelConfig
from pdserve.engine.models.qwen3 import Qwen3ForCausalLM
from pdserve.engine.weights import load_safetensors_dir

ARCHITECTURES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}

__all__ = [
    "ARCHITECTURES",
    "DECODE_MICROBATCH",
    "KVCache",
    "LlamaForCausalLM",
    "ModelConfig",
    "Qwen3ForCausalLM",
    "load_model",
    "model_config",
]


def model_config(raw: Mapping[str, Any]) -> ModelConfig:
    """Parse a ``config.json`` dict; fails with the supported list for an unknown architecture."""
    arch = (raw.get("architectures") or ["?"])[0]
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
    return ModelConfig.from_hf(raw)


def load_model(
    model_dir: Path, dtype: torch.dtype, max_positions: int, *, batch_invariant: bool = False
) -> LlamaForCausalLM:
    """Load weights (all safetensors shards) into the architecture's model class."""
    cfg = model_config(json.loads((model_dir / "config.json").read_text()))
    state = load_safetensors_dir(model_dir)
    return ARCHITECTURES[cfg.architecture](cfg, state, dtype, max_positions, batch_invariant=batch_invariant)
