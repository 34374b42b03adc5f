"""Facts of a Hugging Face model dir that more than one layer reads: its EOS ids and sampling defaults.

The engine needs the EOS ids to stop sequences; the tokenizer needs them too, so that a render server
without an engine can tell an EOS stop in derender. Both read them here, so they cannot disagree.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The sampling defaults vLLM takes from a model's generation_config.json (``--generation-config auto``):
# an OpenAI request that leaves one of these out gets the model's value, not the OpenAI default.
GENERATION_DEFAULT_KEYS = (
    "repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k", "top_p", "min_p",
    "max_new_tokens",
)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def model_eos_ids(directory: Path) -> list[int]:
    """``eos_token_id`` of config.json and generation_config.json (an int or a list), in that order.

    A generation config may list several EOS ids (Qwen3: ``<|im_end|>`` and ``<|endoftext|>``); a
    response that ends on any of them ended on EOS.
    """
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        value = _read_json(directory / name).get("eos_token_id")
        for candidate in value if isinstance(value, list) else [value]:
            if isinstance(candidate, int) and candidate not in ids:
                ids.append(candidate)
    return ids


def generation_defaults(directory: Path) -> dict[str, Any]:
    """The model's sampling defaults (``max_new_tokens`` renamed ``max_tokens``, as vLLM does)."""
    config = _read_json(directory / "generation_config.json")
    defaults = {key: config[key] for key in GENERATION_DEFAULT_KEYS if config.get(key) is not None}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    return defaults
