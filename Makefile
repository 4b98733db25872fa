# Every target installs what it needs into .venv first (torch 2.13.0 CPU build, then the package).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.shardserve-installed
PYTEST_ARGS ?=

.PHONY: install run test bench proto

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# Fetches the default model on first use and answers one chat prompt.
run: install
	$(VENV)/bin/shardserve generate --chat --prompt "What is the capital of France?" --max-tokens 32

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

bench: install
	$(PY) benchmarks/bench_decode.py
	$(PY) benchmarks/bench_tp.py
	$(PY) benchmarks/bench_dsa.py
