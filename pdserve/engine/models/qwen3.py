"""Qwen3 causal LM: Llama plus an RMSNorm over each query and key head before RoPE."""

from __future__ import annotations

from typing import ClassVar

import torch

from pdserve.engine.models.llama import LayerWeights, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    extra_layer_weights: ClassVar[dict[str, str]] = {
        "self_attn.q_norm.weight": "q_norm",
        "self_attn.k_norm.weight": "k_norm",
    }

    def _normalize_qk(self, layer: LayerWeights, heads: torch.Tensor) -> torch.Tensor:
        q, k, v = heads.split([self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.num_kv_heads], 1)
        return torch.cat([self._rms_norm(q, layer.q_norm), self._rms_norm(k, layer.k_norm), v], 1)
