# windserve — one-command run and test.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL ?=
ARGS ?=

.PHONY: run test bench lint install clean

# Create the venv and install pinned deps when missing or when pyproject.toml changed.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(PY) -m scripts.run $(if $(MODEL),--model $(MODEL)) $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

bench: $(STAMP)
	$(PY) -m bench $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy libs protos services

clean:
	rm -rf .run .pytest_cache .ruff_cache .mypy_cache
