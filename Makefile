# Two commands on a fresh machine: `make demo` runs the main job, `make test`
# passes the test suite. Both install what they need through `make setup`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tiderl-installed

.PHONY: setup demo test test-fast coverage coverage-gap clean-venv

setup: $(STAMP)

# Idempotent: re-runs only when pyproject.toml or the setup script changed.
$(STAMP): pyproject.toml tools/setup_env.sh
	PYTHON=$(PYTHON) VENV=$(VENV) bash tools/setup_env.sh
	touch $(STAMP)

demo: setup
	$(VENV)/bin/tiderl run jobs/quickstart.yaml

test: setup
	bash tools/run_tests.sh

coverage: setup
	bash tools/coverage.sh

# The lines a real short run executes that the fast tests never reach (after `make coverage`).
coverage-gap: setup
	$(PY) tools/coverage_gap.py --fast .coverage-data

test-fast: setup
	$(PY) -m pytest -q -m "not slow and not juicefs and not vllm and not slurm"

clean-venv:
	rm -rf $(VENV)
