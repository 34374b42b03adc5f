"""Convert a GGUF file into a bf16 Hugging Face model dir (weights, configs, tokenizer).

torch and gguf are imported only while converting, so looking up a built dir stays light.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.checkpoints.cache import write_json
from pdserve.checkpoints.gguf_tokenizer import tokenizer_from_gguf_metadata

if TYPE_CHECKING:
    from pdserve.checkpoints.gguf_tensors import GGUFFile


def convert_gguf(source: Path, out: Path) -> None:
    """Write a GGUF model as a bf16 HF dir: weights, config, generation config and tokenizer."""
    import torch

    from pdserve.checkpoints.gguf_tensors import iter_gguf_tensors, read_gguf, save_safetensors

    gguf_file = read_gguf(source)
    config, generation_config = _hf_configs_from_gguf(gguf_file)
    tokenizer, tokenizer_config = tokenizer_from_gguf_metadata(gguf_file.metadata)
    state = dict(iter_gguf_tensors(gguf_file, torch.bfloat16))
    save_safetensors(state, out / "model.safetensors")
    write_json(out / "config.json", config)
    write_json(out / "generation_config.json", generation_config)
    tokenizer.save(str(out / "tokenizer.json"))
    write_json(out / "tokenizer_config.json", tokenizer_config)


def _f32(value: float) -> float:
    """GGUF stores floats as float32: print them back as the short decimal they came from (1e-05)."""
    import numpy as np

    return float(str(np.float32(value)))


def _hf_configs_from_gguf(g: GGUFFile) -> tuple[dict[str, Any], dict[str, Any]]:
    from pdserve.checkpoints.gguf_tensors import GGUF_ARCHITECTURES

    arch = g.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(GGUF_ARCHITECTURES)}")
    scaling = g.arch_value("rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported")
    hidden = int(g.arch_value("embedding_length"))
    heads = int(g.arch_value("attention.head_count"))
    tensor_names = {t.name for t in g.reader.tensors}
    meta = g.metadata
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    config = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(g.arch_value("vocab_size", len(meta["tokenizer.ggml.tokens"]))),
        "hidden_size": hidden,
        "intermediate_size": int(g.arch_value("feed_forward_length")),
        "num_hidden_layers": int(g.arch_value("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(g.arch_value("attention.head_count_kv", heads)),
        "head_dim": int(g.arch_value("attention.key_length", hidden // heads)),
        "rms_norm_eps": _f32(g.arch_value("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(g.arch_value("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(g.arch_value("context_length")),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu",
        "attention_bias": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "bfloat16",
    }
    eos_ids = [eos] + [
        i
        for key in ("eot_token_id", "eom_token_id")
        if (i := meta.get(f"tokenizer.ggml.{key}")) is not None and i != eos
    ]
    generation_config = {"bos_token_id": bos, "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids}
    if (pad := meta.get("tokenizer.ggml.padding_token_id")) is not None:
        generation_config["pad_token_id"] = pad
    return config, generation_config
