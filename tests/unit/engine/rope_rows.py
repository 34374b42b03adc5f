"""llama.cpp's Q/K row permutation, which tests apply to write llama GGUFs the converter must undo."""

from __future__ import annotations

import numpy as np


def permute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation (the inverse of ``pdserve.checkpoints.gguf_tensors.unpermute_rope_rows``)."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    return weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
