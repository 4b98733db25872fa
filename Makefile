# Every target installs what it needs into .venv first (pip and setuptools, torch 2.13.0, then the package),
# every package at the exact version of $(LOCK) (`make lock` refreshes it).
# The images install the same way: `make install VENV=/opt/venv TORCH_INDEX=... EXTRAS=...` (Dockerfile*).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.shardserve-installed
PYTEST_ARGS ?=
RUN_ARGS ?=
TORCH_INDEX ?=          # e.g. --index-url https://download.pytorch.org/whl/cpu (CPU-only torch wheels)
EXTRAS ?= test          # optional dependencies of pyproject.toml to install (comma-separated; empty: none)
# exact versions (pip constraints) of every package; the GPU image uses requirements-gpu.lock
LOCK ?= requirements.lock

.PHONY: install run test test-all test-fast bench proto lock

$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade -c $(LOCK) pip setuptools
	$(PY) -m pip install -q -c $(LOCK) torch==2.13.0 $(TORCH_INDEX)
	$(PY) -m pip install -q -c $(LOCK) --no-build-isolation -e '.$(if $(strip $(EXTRAS)),[$(strip $(EXTRAS))])'
	touch $(STAMP)

install: $(STAMP)

# Re-resolve every dependency to the newest versions pyproject.toml allows and write the locks; then
# run `make test` in a fresh venv (rm -r .venv) before committing them.
lock:
	python3 tools/lock_requirements.py

# Fetches the default model on first use and serves it with TP=2 on a local Ray cluster until Ctrl-C:
# OpenAI API on http://127.0.0.1:8000/v1, gRPC on 127.0.0.1:50051. Extra flags: make run RUN_ARGS="...".
run: install
	$(VENV)/bin/shardserve serve --tensor-parallel-size 2 $(RUN_ARGS)

# Everything but the `extended` tests (minutes each, partly covered by faster ones): what CI runs.
test: install
	$(PY) -m pytest -m "not extended" --durations=60 $(PYTEST_ARGS)

# Every test, the extended ones too (cold Inductor compiles of every family, the whole gpu_check dry run).
test-all: install
	$(PY) -m pytest $(PYTEST_ARGS)

# The fast subset (no real model, no Ray cluster): about 7 minutes on a 2-core machine without AVX-512.
test-fast: install
	$(PY) -m pytest -m "not slow and not ray" $(PYTEST_ARGS)

bench: install
	$(PY) benchmarks/bench_decode.py
	$(PY) benchmarks/bench_tp.py
	$(PY) benchmarks/bench_dp_attention.py
	$(PY) benchmarks/bench_moe_exchange.py
	$(PY) benchmarks/bench_dsa.py
	$(PY) benchmarks/bench_long_context.py
	$(PY) benchmarks/bench_speculative.py
	$(PY) benchmarks/bench_qwen3_next.py
	$(PY) benchmarks/bench_recovery.py
	$(PY) benchmarks/bench_structured.py
	$(PY) benchmarks/packed_accuracy.py
	$(PY) benchmarks/bench_packed_linear.py
	$(PY) benchmarks/profile_decode.py --attention-ab 4
	$(PY) benchmarks/bench_serving.py
	$(PY) benchmarks/bench_startup.py
	$(PY) benchmarks/cpu_per_token.py
