"""The build cache: each built model dir is written once into a temp dir and renamed into place.

Built dirs live under ``${PDSERVE_CACHE_DIR:-~/.cache/pdserve}/models``; a marker file records the
source it was built from, so a changed source (or a new build format) is rebuilt and concurrent
first runs never see (or leave) a half-written model.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Bump when the layout or contents of built dirs change; older cache entries are rebuilt.
_FORMAT_VERSION = 1
_MARKER = "pdserve_build.json"


def cache_root() -> Path:
    """Where built model dirs live: ``$PDSERVE_CACHE_DIR`` or ``~/.cache/pdserve``."""
    return Path(os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve")


def file_identity(path: Path) -> str:
    if not path.is_file():
        raise FileNotFoundError(f"model file {path} does not exist")
    stat = path.stat()
    return f"{path}:{stat.st_size}:{stat.st_mtime_ns}"


def ensure_built(name: str, source: str, build: Callable[[Path], None]) -> Path:
    """Return ``cache_root()/models/name``, building it first unless a current build is there."""
    final = cache_root() / "models" / name
    if _is_current(final, source):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=final.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary readable dir
    try:
        build(tmp)
        write_json(tmp / _MARKER, {"format_version": _FORMAT_VERSION, "source": source})
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


def write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")
