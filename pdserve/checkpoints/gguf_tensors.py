"""GGUF tensors in (dequantized, renamed to Hugging Face names), one safetensors file out.

The engine's models only understand Hugging Face tensor names and layouts, so a GGUF
is translated once (:mod:`pdserve.checkpoints.resolve` caches the result as a safetensors
dir) rather than teaching every model two naming schemes.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file

# GGUF architecture name -> the Hugging Face class the converted dir declares.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


@dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF: scalar/array metadata by key and the raw tensor records."""

    path: Path
    metadata: dict[str, Any]
    reader: GGUFReader

    @property
    def architecture(self) -> str:
        return str(self.metadata["general.architecture"])

    def arch_value(self, key: str, default: Any = None) -> Any:
        """Metadata under the architecture prefix, e.g. ``block_count`` -> ``llama.block_count``."""
        return self.metadata.get(f"{self.architecture}.{key}", default)


def read_gguf(path: str | Path) -> GGUFFile:
    """Open a GGUF file (memory-mapped) and decode all of its metadata fields."""
    reader = GGUFReader(str(path))
    metadata = {name: field.contents() for name, field in reader.fields.items()}
    return GGUFFile(path=Path(path), metadata=metadata, reader=reader)


def hf_tensor_name(gguf_name: str) -> str:
    """Map one GGUF tensor name to its Hugging Face name (clear error for unknown tensors)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_RE.match(gguf_name)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        raise ValueError(
            f"unsupported GGUF tensor {gguf_name!r}; known: {sorted(_GLOBAL_NAMES)} and blk.N.{{{','.join(_BLOCK_NAMES)}}}"
        )
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation for ``llama`` GGUFs.

    llama.cpp rotates interleaved pairs (GPT-J style) and its converter reorders each
    head's rows from Hugging Face's half-split layout into pairs; Hugging Face RoPE
    (rotate_half) needs the original order back.
    """
    rows = weight.shape[0]
    head_dim = rows // num_heads
    return weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def iter_gguf_tensors(gguf_file: GGUFFile, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every tensor, dequantized to float32 then cast to ``dtype``.

    Any quantization the ``gguf`` package can dequantize is accepted (Q4_0/Q4_1/Q8_0/K-quants/F16/BF16/F32).
    """
    arch = gguf_file.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(GGUF_ARCHITECTURES)}")
    num_heads = int(gguf_file.arch_value("attention.head_count"))
    num_kv_heads = int(gguf_file.arch_value("attention.head_count_kv", num_heads))
    for record in gguf_file.reader.tensors:
        name = hf_tensor_name(record.name)
        logical_shape = tuple(int(d) for d in reversed(record.shape))
        array = np.asarray(dequantize(record.data, record.tensor_type), dtype=np.float32).reshape(logical_shape)
        if arch == "llama" and name.endswith("q_proj.weight"):
            array = unpermute_rope_rows(array, num_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            array = unpermute_rope_rows(array, num_kv_heads)
        yield name, torch.from_numpy(np.array(array, order="C")).to(dtype)


def save_safetensors(state: Mapping[str, torch.Tensor], path: Path) -> None:
    """Write a single-file safetensors checkpoint (contiguous tensors, ``format=pt`` like HF)."""
    save_file({name: t.contiguous() for name, t in state.items()}, str(path), metadata={"format": "pt"})
