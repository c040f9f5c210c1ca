# Entry points that work on a fresh machine with Python 3.11 and pip (see CONTRIBUTING.md):
#   make demo        set up .venv, then build a tiny Wan model, fine-tune it, export it, generate a sample
#   make lint        ruff check + ruff format --check (the config is [tool.ruff] in pyproject.toml)
#   make typecheck   mypy over spindle/ (the config is [tool.mypy] in pyproject.toml)
#   make test        lint, typecheck, generated/ drift check (spindle patchgen --check), then the test
#                    suite on 2 pytest-xdist workers with its 15 slowest tests listed (what CI runs)
#   make format      apply ruff's formatter and safe fixes
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# pytest-xdist workers; a test module runs whole on one of them, except the long ones (tests/conftest.py)
PYTEST_WORKERS ?= 2

.PHONY: setup demo lint format typecheck test clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/spindle demo --out demo_out

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(STAMP)
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

typecheck: $(STAMP)
	$(PY) -m mypy

test: lint typecheck
	$(VENV)/bin/spindle patchgen --check
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadscope --durations=15 $(PYTEST_ARGS) tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

clean:
	rm -rf $(VENV) demo_out .mypy_cache .ruff_cache
