# The two commands the README opens with: `make demo` and `make test`.
# Both create the virtual environment from pyproject.toml on first use.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-from-pyproject

.PHONY: demo test lint pytest bench model-long install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,openai,anthropic,langchain,litellm,dashboard,otel]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/budget-tasks demo

test: lint pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

pytest: $(STAMP)
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python -m benchmarks

# The ledger against its reference model, long: 1,250 trees of 40 steps on each of
# PostgreSQL's two paths (100,000 steps), then SQLite's default run.
model-long: $(STAMP)
	BUDGET_TASKS_MODEL_EXAMPLES=1250 BUDGET_TASKS_MODEL_STEPS=40 \
		$(BIN)/python -m pytest -p no:cacheprovider --timeout=0 tests/integration/test_model_stateful.py -k pg
	$(BIN)/python -m pytest -p no:cacheprovider tests/integration/test_model_stateful.py -k sqlite

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
