"""Rebuild a Hugging Face tokenizer (tokenizer.json + tokenizer_config.json) from GGUF metadata."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


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
