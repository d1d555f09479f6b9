# One entry point for people and CI. Each target creates .venv and installs everything it needs.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo test lint clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The pinned CPU/normal build first: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

# just the environment: then `source .venv/bin/activate` puts `dipaco` on PATH (README "Using it")
venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/dipaco demo

# pytest workers (pytest-xdist); 0 runs the suite in this process, in file order
TEST_WORKERS ?= 2

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

# what `make`, the demo and the README's walkthrough leave behind (the walkthrough's coordinator state included)
clean:
	rm -rf $(VENV) dipaco-demo .dipaco corpus shards refit exports coordinator.log
