# Two entry points that work on a fresh machine with Python 3.11 and pip:
#   make demo   set up .venv, then build a tiny Wan model, fine-tune it, export it, generate a sample
#   make test   set up .venv, check generated/ for drift (spindle patchgen --check), then run the test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: setup demo test clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/spindle demo --out demo_out

test: $(STAMP)
	$(VENV)/bin/spindle patchgen --check
	$(PY) -m pytest -q tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

clean:
	rm -rf $(VENV) demo_out
