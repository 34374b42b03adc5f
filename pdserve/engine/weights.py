"""Load a Hugging Face model dir's safetensors shards into one state dict (what the models read).

Every checkpoint reaches the engine in this layout; :mod:`pdserve.checkpoints` builds it from
other sources (GGUF, the built-in test model).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file


def load_safetensors_dir(model_dir: Path) -> dict[str, torch.Tensor]:
    """Load every ``*.safetensors`` shard of a Hugging Face model dir into one state dict."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    return state
