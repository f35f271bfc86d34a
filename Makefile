# The two commands the README opens with: `make demo` and `make test`.
# Both create the virtual environment from pyproject.toml on first use.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-from-pyproject
# the demo needs the package and the openai SDK only: no dev tools, no other extras
DEMO_STAMP := $(VENV)/.installed-for-demo

.PHONY: demo test lint docs pytest bench model-long install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,docs,openai,anthropic,langchain,litellm,dashboard,otel]'
	touch $(STAMP) $(DEMO_STAMP)

$(DEMO_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -e '.[openai]'
	touch $(DEMO_STAMP)

install: $(STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/budget-tasks demo

test: lint docs pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# the site, strict: a broken link, anchor or page fails it
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

pytest: $(STAMP)
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python -m benchmarks

# The ledger against its reference model, long: 1,250 trees of 40 steps on each of
# PostgreSQL's two paths (100,000 steps; the two run side by side, each printing how
# often the rarer rules were reached), then SQLite's default run.
LONG_MODEL = BUDGET_TASKS_MODEL_EXAMPLES=1250 BUDGET_TASKS_MODEL_STEPS=40 \
	$(BIN)/python -m pytest -p no:cacheprovider --timeout=0 -s tests/integration/test_model_stateful.py
model-long: $(STAMP)
	$(LONG_MODEL) -k pg-functions & one=$$!; \
	$(LONG_MODEL) -k pg-statements & two=$$!; \
	wait $$one; a=$$?; wait $$two; b=$$?; [ $$a -eq 0 ] && [ $$b -eq 0 ]
	$(BIN)/python -m pytest -p no:cacheprovider tests/integration/test_model_stateful.py -k sqlite

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis site
