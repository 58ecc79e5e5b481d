# Every target works on a fresh clone with only Python 3 and make.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HOST ?=
PORT ?=
ARGS ?=

.PHONY: serve test lint typecheck unit bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

serve: $(STAMP)  ## serve the built-in mock on 127.0.0.1:8000 (or SLOTSERVE_*; flags: ARGS='...')
	$(BIN)/slotserve serve $(if $(HOST),--host $(HOST)) $(if $(PORT),--port $(PORT)) $(ARGS)

test: $(STAMP) lint typecheck unit  ## ruff, mypy and the whole pytest suite

lint: $(STAMP)
	$(BIN)/ruff check app tests benchmarks docker
	$(BIN)/ruff format --check app tests benchmarks docker

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/pytest

bench: $(STAMP)  ## the engine benchmark (benchmarks/ has the others; figures in docs/benchmarks.md)
	$(BIN)/python benchmarks/engine_overhead.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
