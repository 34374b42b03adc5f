from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pdserve.text.tokenizer import Tokenizer

# The case fixtures live in tests/fixtures (imported as ``tests.fixtures.parser_cases``),
# which needs the repository root importable also when pytest is run without ``-m``.
_ROOT = str(Path(__file__).resolve().parents[3])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return Tokenizer.load("qwen3")
