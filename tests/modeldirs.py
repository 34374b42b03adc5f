"""Model dirs made for a test: the real Qwen3 tokenizer files plus the JSON files a test needs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from pdserve.text.tokenizer import resolve_tokenizer_dir


def qwen3_model_dir(dest: Path, **json_files: dict[str, Any]) -> Path:
    """``dest`` with the Qwen3 tokenizer files and ``name.json`` for each keyword (``generation_config={...}``)."""
    for f in resolve_tokenizer_dir("qwen3").iterdir():
        shutil.copy(f, dest / f.name)
    for name, content in json_files.items():
        (dest / f"{name}.json").write_text(json.dumps(content))
    return dest
