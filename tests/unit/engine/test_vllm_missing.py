"""``--engine vllm`` without vLLM installed: a clear error that names ``make vllm-env``, exit code 2,
before any model is built (the main venv never has vLLM; under .venv-vllm the lookup is made to miss)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from pdserve.cli import build_parser
from pdserve.engine.runners import vllm_runner
from pdserve.engine.spec import EngineSpec
from pdserve.serve.cli import run_server_command


@pytest.fixture
def no_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        vllm_runner.importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )


def test_serve_with_engine_vllm_names_make_vllm_env(no_vllm: None, capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["serve", "/nonexistent-model-dir", "--engine", "vllm"])
    assert run_server_command(args) == 2
    err = capsys.readouterr().err
    assert "make vllm-env" in err and "--engine vllm needs vLLM" in err


def test_building_the_engine_names_make_vllm_env(no_vllm: None) -> None:
    with pytest.raises(ValueError, match="make vllm-env"):
        vllm_runner.VllmEngine.from_spec(EngineSpec(kind="vllm", model="/nonexistent-model-dir"))


def test_the_runner_module_does_not_import_vllm() -> None:
    # Lazy: importing the module (as the factory does) leaves vLLM unloaded, even where it is installed.
    code = "import sys, pdserve.engine.runners.vllm_runner; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "False"
